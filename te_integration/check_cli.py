"""``lowp-te-check CONFIG``: check a debug-API YAML for our features before a run starts.

Why: nvdlfw-inspect reads the YAML inside training (after the model is built, on every rank);
this checks the same options (te_integration.options) up front, in a second, on any machine,
and prints the feature folders to pass (ours and, where TE imports, TE's).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from lowp_common import CommandParser, UserError, cli_entry

from . import inspect_support, options

FEATURE_DIR = Path(__file__).resolve().parent / "debug_features"


def te_feature_dir() -> Optional[Path]:
    """TE's own feature folder when TE imports here (it must be listed beside ours)."""
    try:
        import transformer_engine.debug.features as te_features
    except Exception:
        return None
    return Path(te_features.__file__).resolve().parent


def check(path: str) -> str:
    """Validate ``path``; returns the summary line (UserError on a mistake)."""
    inspect_support.require()
    import yaml

    if not os.path.isfile(path):
        raise UserError(f"{path}: no such file (give the debug-API YAML)")
    try:
        with open(path, encoding="utf-8") as fh:
            raw = yaml.safe_load(fh) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected sections (name: {{enabled, layers, ...}})")
    options.validate(raw, path)
    te = te_feature_dir()
    dirs = [str(FEATURE_DIR)] + ([str(te)] if te else ["<TE's transformer_engine/debug/features>"])
    return f"{path}: ok ({len(raw)} section(s)); feature dirs: {' '.join(dirs)}"


@cli_entry("lowp-te-check")
def main(argv: Optional[Sequence[str]] = None) -> int:
    p = CommandParser(prog="lowp-te-check", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="the debug-API YAML (nvdlfw-inspect config_file)")
    args = p.parse_args(argv)
    print(check(args.config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
