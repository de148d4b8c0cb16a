"""The static AMP checker: reads Python training code and bash launch scripts, runs nothing,
and reports mixed-precision mistakes (docs/amp_checker.md).

    checker.py       the command (``amp-static-check``), ``check_paths`` / ``check_source``
    catalog.py       the table the checker runs: every rule and its extension visitors
    rules/           one module per rule family, each rule declared on its visitor
    context.py       one parsed file: names, parents, casts, autocast regions
    scopes.py        the bindings of each scope; values.py: what names hold, by dataflow
    questions.py     the fixpoint that answers questions asking each other
    project.py       the scanned tree as programs (imports, call sites, who vouches for whom)
    intent.py        what a cast or a backward is for; precision.py: which precision trains
    loose.py         the rules' forms for loose files, where no training is seen
    launch_rules.py  launch hazards in bash launch scripts

A finding, its levels and the report formats are ``training_profiler.findings_report``'s, shared
with the run-time audit. Nothing is imported here, so importing a submodule stays cheap.
"""
