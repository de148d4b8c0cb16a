"""Where the AMP checker's rules live: each rule's words (id, name, severity, explanation,
suggestion) are declared on its visitor class, in the visitor's own family module, and the tables
the checker runs are assembled from the family modules in rule-id order. A rule whose text drifted
into a table elsewhere, a declared visitor its family forgot to list, or a family module the
package forgot would each fail here."""
from __future__ import annotations

import ast
import inspect
import pkgutil
import sys
from pathlib import Path

import training_profiler.amp_checker.rules as amp_rules
from training_profiler.amp_checker.catalog import RULES as CHECKED_RULES
from training_profiler.amp_checker.rules.base import Rule

PACKAGE = Path(amp_rules.__file__).parent
DECLARED_RULES = amp_rules.RULES + amp_rules.BUG_KIND_RULES


def _decorator_call(visitor: type) -> ast.Call:
    """The ``@declare_rule(...)`` call above ``visitor``'s class statement in its own module."""
    tree = ast.parse(Path(inspect.getsourcefile(visitor)).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == visitor.__name__)
    calls = [d for d in cls.decorator_list if isinstance(d, ast.Call)
             and isinstance(d.func, ast.Name) and d.func.id == "declare_rule"]
    assert len(calls) == 1, f"{visitor.__name__} is not declared by one @declare_rule on its class"
    return calls[0]


def _constant(node: ast.AST) -> object:
    assert isinstance(node, ast.Constant), ast.unparse(node)
    return node.value


def test_every_rule_text_is_declared_on_its_visitor_in_the_visitors_module() -> None:
    assert DECLARED_RULES
    for rule in DECLARED_RULES:
        visitor = rule.visitor
        assert visitor.__module__.startswith("training_profiler.amp_checker.rules."), rule.id
        assert visitor.rule is rule, rule.id
        call = _decorator_call(visitor)
        rule_id, name, severity = call.args
        kw = {k.arg: k.value for k in call.keywords}
        assert (_constant(rule_id), _constant(name), ast.unparse(severity)) == \
            (rule.id, rule.name, f"Severity.{rule.severity.name}"), rule.id
        assert _constant(kw["explanation"]) == rule.explanation, rule.id
        assert _constant(kw["suggestion"]) == rule.suggestion, rule.id
        assert rule.explanation.strip() and rule.suggestion.strip(), rule.id


def test_each_family_lists_exactly_the_rules_it_declares() -> None:
    for family in amp_rules.FAMILIES + amp_rules.BUG_KIND_FAMILIES:
        declared = {obj.rule for obj in vars(family).values() if inspect.isclass(obj)
                    and obj.__module__ == family.__name__ and isinstance(vars(obj).get("rule"), Rule)}
        assert declared and set(family.RULES) == declared, family.__name__
        assert [r.id for r in family.RULES] == sorted(r.id for r in family.RULES), family.__name__


def test_every_family_module_is_assembled_once() -> None:
    """A module holding a declared rule must be one of the package's families, or its rules
    would never run."""
    families = amp_rules.FAMILIES + amp_rules.BUG_KIND_FAMILIES
    assert len(set(families)) == len(families)
    for info in pkgutil.iter_modules([str(PACKAGE)]):
        module = sys.modules[f"{amp_rules.__name__}.{info.name}"]
        has_rules = any(inspect.isclass(o) and o.__module__ == module.__name__ and "rule" in vars(o)
                        for o in vars(module).values())
        assert has_rules == (module in families), info.name


def test_tables_are_in_rule_id_order_with_unique_ids_and_names() -> None:
    for table in (amp_rules.RULES, amp_rules.BUG_KIND_RULES, CHECKED_RULES):
        ids = [r.id for r in table]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        assert len({r.name for r in table}) == len(table)
    assert [r.id for r in CHECKED_RULES] == [r.id for r in DECLARED_RULES]
    assert amp_rules.RULES[-1].id < amp_rules.BUG_KIND_RULES[0].id
    assert set(amp_rules.RULES_BY_ID) == {r.id for r in amp_rules.RULES}


# ---- walking docs/architecture.md's "A checker rule" with a rule declared here -------------------
from quant.vocabulary import Severity  # noqa: E402
from training_profiler.amp_checker.rules import casts as _casts_family  # noqa: E402
from training_profiler.amp_checker.rules.base import RuleVisitor, declare_rule  # noqa: E402

_TEST_ID = "AMP900"  # a test-only id, above every real rule


@declare_rule(_TEST_ID, "test-default-dtype-half", Severity.MEDIUM,
              explanation="Test-only rule: the default dtype set to float16 makes every new tensor half.",
              suggestion="Leave the default dtype float32; let autocast choose per op.")
class _DefaultDtypeHalf(RuleVisitor):
    """``torch.set_default_dtype(torch.float16)``: declared in this test, never shipped."""

    def visit_Call(self, node: ast.Call) -> None:
        if self.ctx.call_name(node) == "torch.set_default_dtype" and node.args \
                and self.ctx.literal_dtype(node.args[0]) == "float16":
            self.report(node, "default dtype set to float16")
        self.generic_visit(node)


def test_a_rule_declared_and_listed_as_the_architecture_page_says_runs(
        tmp_path: Path, monkeypatch, capsys) -> None:
    """One class in a family module (here: the test's, listed in the ``casts`` family's
    ``RULES``) is all a rule needs: the package's ``RULES`` puts it in id order, the catalog and
    the command read that, and the rule fires in ``check_paths`` and shows in ``--list-rules``."""
    import importlib

    from training_profiler.amp_checker import catalog, checker

    (tmp_path / "train.py").write_text("import torch\ntorch.set_default_dtype(torch.float16)\n")
    assert _TEST_ID not in {r.id for r in checker._ALL_RULES}
    monkeypatch.setattr(_casts_family, "RULES", _casts_family.RULES + (_DefaultDtypeHalf.rule,))
    monkeypatch.setattr(amp_rules, "RULES", amp_rules._in_id_order(amp_rules.FAMILIES))
    try:
        importlib.reload(catalog)
        importlib.reload(checker)
        ids = [r.id for r in amp_rules.RULES]
        assert ids == sorted(ids) and ids[-1] == _TEST_ID  # in rule-id order, as the checker runs them
        assert [r.id for r in catalog.RULES[:len(ids)]] == ids
        found = [(f.rule_id, f.line, f.message) for f in checker.check_paths([str(tmp_path)]).findings
                 if f.rule_id == _TEST_ID]
        assert found == [(_TEST_ID, 2, "default dtype set to float16")]
        assert checker.main(["--list-rules"]) in (0, None)
        assert any(line.startswith(_TEST_ID) and "test-default-dtype-half" in line
                   for line in capsys.readouterr().out.splitlines())
    finally:
        monkeypatch.undo()
        importlib.reload(catalog)
        importlib.reload(checker)
    assert _TEST_ID not in {r.id for r in checker._ALL_RULES}
