"""The shared command line of quick-visualize, visualize-tensors and enhanced-tensor-visualizer.

Exit codes: 0 = figures drawn (problems, if any, are listed), 2 = a usage error or a folder with
nothing readable to draw (one line on stderr naming the argument or folder and the fix), 1 = the
tool failed.
"""
from __future__ import annotations

import argparse

from lowp_common import (
    CommandParser,
    HelpWithDefaults,
    UserError,
    check_writable,
    claim_folder,
    cli_entry,
    mark_folder,
)
from tensor_viz import options as defaults


def _formats(text: str) -> tuple[str, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    return tuple(t.strip() for t in text.split(",") if t.strip())


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = CommandParser(prog=prog, description=description,
                      formatter_class=HelpWithDefaults)
    p.add_argument("--tensor_dir", "--tensor-dir", required=True,
                   help="folder the capture wrote (.pt files, manifest_rank*.jsonl)")
    p.add_argument("--output_dir", "--output-dir", default="./draw", help="where figures and index.html go")
    p.add_argument("--sample-size", type=int, default=4096, help="values kept per file read")
    p.add_argument("--max-files", type=int, default=256,
                   help="files read for value plots when statistics are stored (others: stats only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the reproducible value sampling")
    p.add_argument("--workers", type=int, default=2, help="processes reading files and drawing sections")
    p.add_argument("--worker-timeout", type=float, default=defaults.Options.worker_timeout,
                   metavar="SECONDS",
                   help="a worker still on one file or one section after this long is stopped; "
                        "that file or section is reported missing and the report goes on")
    p.add_argument("--whatif", default=None,
                   help="what-if formats to show beside those capture stored (comma list, or "
                        "'none'); recomputed from saved tensors on the axis capture used, marked "
                        "'recomputed' (default: capture's own what-if formats, or "
                        f"{','.join(defaults.DEFAULT_WHATIF)} when it stored none)")
    p.add_argument("--whatif-files", type=int, default=defaults.Options.whatif_files,
                   help="saved tensors given recomputed what-if numbers (formats capture did not "
                        "store); figures say when fewer than all were")
    p.add_argument("--map-stat", default=",".join(defaults.DEFAULT_MAP_STATS),
                   help=f"statistics for the numerics map, from {', '.join(defaults.MAP_STAT_NAMES)}")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--index-dir", default=None,
                   help="where the columnar index of the manifests goes (default: "
                        "TENSOR_DIR/.tensor_index, or a temporary folder when TENSOR_DIR is read-only)")
    p.add_argument("--force", action="store_true",
                   help="draw into OUTPUT_DIR even when it holds a report of another capture "
                        "(a report of the same capture is refreshed without it)")
    p.add_argument("--max-records", type=int, default=defaults.Options.max_records,
                   help="above this many manifest records, figures drawn per record use a "
                        "selection of ranks and iterations (tables and numerics.csv cover all)")
    return p


def options(args: argparse.Namespace) -> defaults.Options:
    for name in ("sample_size", "max_files", "workers", "whatif_files", "max_records"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if not args.worker_timeout > 0:
        raise UserError(f"--worker-timeout {args.worker_timeout}: must be a positive number of seconds")
    stats = _formats(args.map_stat)
    bad = [s for s in stats if s not in defaults.MAP_STAT_NAMES]
    if bad:
        raise UserError(f"--map-stat {','.join(bad)}: unknown; choose from {', '.join(defaults.MAP_STAT_NAMES)}")
    whatif = None if args.whatif is None else _formats(args.whatif)
    if whatif is not None:
        from quant.vocabulary import FormatNameError, check_format_name

        try:
            whatif = tuple(check_format_name(f, "--whatif", high_precision=False) for f in whatif)
        except FormatNameError as exc:
            raise UserError(str(exc)) from None
    return defaults.Options(sample_size=args.sample_size, max_value_files=args.max_files, seed=args.seed,
                            workers=args.workers, whatif=whatif, whatif_files=args.whatif_files, map_stats=stats,
                            progress=not args.no_progress, index_dir=args.index_dir,
                            max_records=args.max_records, worker_timeout=args.worker_timeout)


#: files that make a folder a report (of quick-visualize or a full report)
REPORT_FILES = ("index.html", "quick_analysis.png", "tensor_stats.txt", ".report_stamp.json")


def claim_output(args: argparse.Namespace) -> None:
    """Refuse, before reading anything, an OUTPUT_DIR that cannot be written or that holds a
    report of another capture (its figures would be replaced by this one's). The
    report of the same capture into the folder it wrote is a refresh of a derived view: it goes
    ahead, and is not even redrawn when nothing new was captured (tensor_viz.report_stamp)."""
    check_writable(args.output_dir, "--output_dir", folder=True)
    claim_folder(args.output_dir, args.tensor_dir, REPORT_FILES, force=args.force,
                 what="a report", elsewhere="give another --output_dir")


def run(argv: list[str] | None, prog: str, sections: tuple[str, ...], quick: bool, report: bool,
        description: str) -> int:
    """Parse, build, print the summary; a UserError is one line and exit 2, Ctrl-C exits 130."""
    return cli_entry(prog)(_run)(argv, prog, sections, quick, report, description)


def _run(argv: list[str] | None, prog: str, sections: tuple[str, ...], quick: bool, report: bool,
         description: str) -> int:
    args = parser(prog, description).parse_args(argv)
    from tensor_viz import pipeline  # heavy (torch, matplotlib): only once the arguments parse

    opts = options(args)
    claim_output(args)
    if not sections:  # the quick view needs neither quantization errors nor maps
        opts.whatif, opts.max_pairs = (), 0
    result = pipeline.build(args.tensor_dir, args.output_dir, sections, opts, quick=quick, report=report)
    mark_folder(args.output_dir, args.tensor_dir)
    cat = result.catalog
    if result.reused is not None:
        from tensor_viz.report_stamp import STAMP_FILE

        print(f"{prog}: nothing new in {cat.directory} since the report in {args.output_dir} "
              f"({result.reused.get('records', 0):,} records, {result.drawn} figures): it is "
              f"current (delete {args.output_dir}/{STAMP_FILE} to draw it again)")
        for line in result.reused.get("diagnosis") or []:
            print(f"{prog}: {line}")
        return result.exit_code
    print(f"{prog}: {len(cat.entries)} tensors in {cat.directory}; read values from {result.files_read} files; "
          f"{result.drawn} figures drawn into {args.output_dir}")
    if result.diagnosis is not None:       # the findings, the cause first (tensor_viz.diagnose)
        for line in result.diagnosis.lines(limit=10):
            print(f"{prog}: {line}")
    counts = cat.problem_counts()
    if counts:
        print(f"{prog}: skipped or flagged {sum(counts.values())} inputs ("
              + ", ".join(f"{k}: {n}" for k, n in sorted(counts.items()))
              + f"); details in {args.output_dir}/problems.txt")
    if cat.ignored:
        print(f"{prog}: ignored {cat.ignored} files that are neither .pt tensors nor manifests")
    if result.drawn == 0:     # the folder is the problem (wrong one, or the capture saved nothing)
        raise UserError(f"nothing could be drawn: no readable captured tensors in {cat.directory}; "
                        "give the folder the run's TENSOR_SAVE_DIR names")
    if report:
        print(f"{prog}: open {args.output_dir}/index.html in a browser")
    return 0
