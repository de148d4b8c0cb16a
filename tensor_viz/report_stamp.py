"""Skip redrawing a report when nothing changed: the stamp of what a report was drawn from.

Why: a report of a running cluster job is asked for again and again; when no manifest grew since
the last report into the same folder with the same options, that report is current, and drawing
it again would cost the same minutes for the same figures. The stamp is the columnar index's
per-manifest watermarks (tensor_viz.columnar), the options, the sections and the code's index
version; any difference redraws. Only captures with manifests are stamped.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from lowp_common import atomic_write_json

STAMP_FILE = ".report_stamp.json"


def fingerprint(index_state_file: Path, opts: Any, sections: tuple[str, ...], quick: bool,
                report: bool) -> str:
    """A hash of what a report is drawn from (the index's state file, options, sections)."""
    try:
        state = json.loads(index_state_file.read_text())
    except (OSError, ValueError):
        return ""
    manifests = {k: [v.get("offset"), v.get("inode"), v.get("records"), v.get("bad")]
                 for k, v in (state.get("manifests") or {}).items()}
    what = {"index": state.get("index_version"), "manifests": manifests,
            "options": dataclasses.asdict(opts), "sections": list(sections),
            "quick": quick, "report": report}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def current(out_dir: Path, stamp: str) -> dict[str, Any] | None:
    """The summary stored with the report in ``out_dir`` when it was drawn from ``stamp``."""
    if not stamp:
        return None
    try:
        data = json.loads((out_dir / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    if data.get("stamp") != stamp or not (out_dir / "index.html").is_file():
        return None
    return data.get("summary")


def write(out_dir: Path, stamp: str, summary: dict[str, Any]) -> None:
    if stamp:
        atomic_write_json(out_dir / STAMP_FILE, {"stamp": stamp, "summary": summary})
