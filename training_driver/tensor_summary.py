"""What a tensor directory holds: files, bytes, and counts per layer type / operation / quant
type / iteration, read from the file names alone (``tensor_capture.schema``), so a summary of
thousands of files opens none of them. The collector prints it after a run.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from lowp_common import human_bytes


@dataclass
class TensorSummary:
    files: int = 0
    bytes: int = 0
    by_layer_type: Counter = field(default_factory=Counter)
    by_operation: Counter = field(default_factory=Counter)
    by_quant_type: Counter = field(default_factory=Counter)
    iterations: Counter = field(default_factory=Counter)


def tensor_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Captured tensor files under ``directory`` (any depth), by name via tensor_capture.schema."""
    from tensor_capture.schema import TENSOR_SUFFIX, is_tensor_filename

    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob(f"*{TENSOR_SUFFIX}")
                  if p.is_file() and is_tensor_filename(p.name))


def summarize(directory: str | os.PathLike[str], only: set[Path] | None = None) -> TensorSummary:
    """Count files, bytes, and files per layer type / operation / quant type / iteration."""
    from tensor_capture.schema import parse_filename

    s = TensorSummary()
    for path in tensor_files(directory):
        if only is not None and path not in only:
            continue
        try:
            name = parse_filename(path.name)
            size = path.stat().st_size
        except (ValueError, OSError):
            continue
        s.files += 1
        s.bytes += size
        s.by_layer_type[name.layer_type] += 1
        s.by_operation[name.operation] += 1
        s.by_quant_type[name.quant_type] += 1
        s.iterations["NA" if name.iteration is None else name.iteration] += 1
    return s


def format_summary(s: TensorSummary, directory: str | os.PathLike[str],
                   finished_iterations: int | None = None) -> str:
    """Readable summary; with ``finished_iterations`` (iterations training completed), captured
    iterations at or past it are marked partial (training stopped inside them)."""
    def table(title: str, counts: Counter) -> list[str]:
        lines = [f"  by {title}:"]
        for key, n in sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0]))):
            lines.append(f"    {str(key):<16} {n:>6}  ({100.0 * n / max(1, s.files):5.1f}%)")
        return lines

    out = [f"tensor summary for {directory}: {s.files} files, {human_bytes(s.bytes)}"]
    if s.files:
        out += table("layer type", s.by_layer_type)
        out += table("operation", s.by_operation)
        out += table("quant type", s.by_quant_type)
        iters = sorted(k for k in s.iterations if k != "NA")
        if iters:
            shown = [f"{i} (partial: training stopped inside it)"
                     if finished_iterations is not None and i >= finished_iterations else str(i)
                     for i in iters[:20]]
            out.append(f"  iterations captured: {len(iters)} (iteration {', '.join(shown)}"
                       + (" ...)" if len(iters) > 20 else ")"))
    return "\n".join(out)
