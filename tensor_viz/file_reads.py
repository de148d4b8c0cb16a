"""Read tensor values one file at a time, in worker processes, and keep only small results.

A worker returns a reproducible sample of values (fixed seed per file name), a small
2-D slice for heatmaps, whole-tensor statistics when none were stored, and the what-if numerics
capture did not store (:func:`recompute_whatif`: capture's own computation, on the axis capture
used). The full tensor never leaves the worker.
"""
from __future__ import annotations

import os
import sys
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from tensor_capture import schema
from tensor_viz import workers as worker_pool

# Tensor names whose values are attention score / probability maps (drawn as maps).
SCORE_NAMES = ("scores", "attention_scores", "attn_scores", "attention_probs", "attn_probs", "probs")
#: the score tensors that hold softmax probabilities (0..1), drawn on a sequential 0-1 scale
PROBABILITY_NAMES = ("attention_probs", "attn_probs", "probs")
HEAT_SIDE = 128


@dataclass
class FileTask:
    path: str
    sample_size: int = 4096
    seed: int = 0
    need_stats: bool = False
    range_formats: tuple[str, ...] = ()    # quant formats for overflow stats (besides the dtype)
    heat: bool = False
    whatif: tuple[str, ...] = ()           # what-if formats to recompute (those not captured)
    whatif_axis: int | None = None         # the GEMM reduction axis capture used (None: last)


@dataclass
class PairTask:
    hp_path: str
    q_path: str


def file_seed(path: str, seed: int) -> int:
    """Per-file seed: stable across runs and machines (a CRC of the base name)."""
    return (zlib.crc32(os.path.basename(path).encode()) ^ seed) & 0x7FFFFFFF


def whole_tensor_stats(t: torch.Tensor, formats: Iterable[str]) -> dict[str, Any]:
    """The capture's statistics (tensor_capture.stats) for a file saved without them."""
    from tensor_capture import stats as capture_stats

    ranges = {}
    for spec in [capture_stats.dtype_range(t.dtype)] + [capture_stats.format_range(f) for f in formats]:
        if spec is not None:
            ranges.setdefault(spec.name, spec)
    return capture_stats.tensor_stats(t, tuple(ranges.values()))


def _classify(path: str, exc: ValueError) -> tuple[str, str]:
    """'unsafe' for a file whose pickle weights_only refused, else 'unreadable'."""
    if isinstance(exc, schema.UnsafeTensorFileError):
        return "unsafe", f"{path}: refused: its pickle would need code to run (loaded with weights_only)"
    return "unreadable", str(exc)


def _load(path: str) -> tuple[torch.Tensor, dict[str, Any]]:
    tensor, meta = schema.load_tensor_file(path)
    return tensor.detach(), meta


def errors(ref: torch.Tensor, approx: torch.Tensor) -> dict[str, float]:
    """Quantization error of ``approx`` against ``ref`` with quant.metrics."""
    from quant import metrics

    r = ref.reshape(-1).to(torch.float32)
    a = approx.reshape(-1).to(torch.float32)
    return {
        "rmse": float(metrics.rmse(r, a)),
        "relative_error": float(metrics.relative_error(r, a)),
        "sqnr": float(metrics.sqnr(r, a)),
    }


def _heat(t: torch.Tensor, tensor_name: str) -> np.ndarray:
    if t.dim() >= 2 and tensor_name in SCORE_NAMES:
        m = t.reshape(-1, t.shape[-2], t.shape[-1])[0]
    elif t.dim() >= 2:
        m = t.reshape(-1, t.shape[-1])
    else:
        m = t.reshape(1, -1)
    return m[:HEAT_SIDE, :HEAT_SIDE].to(torch.float32).numpy().copy()


def run_file(task: FileTask) -> dict[str, Any]:
    """Everything the plots need from one file; {"error": (kind, reason)} if it cannot be read."""
    try:
        t, meta = _load(task.path)
    except ValueError as exc:
        return {"error": _classify(task.path, exc)}
    if not t.is_floating_point():
        return {"error": ("foreign", f"{task.path}: holds a {t.dtype} tensor, not floating point")}
    out: dict[str, Any] = {"meta": {k: v for k, v in meta.items() if k != schema.META_STATS}}
    out["meta"].setdefault(schema.META_DTYPE, str(t.dtype))
    out["meta"].setdefault(schema.META_SHAPE, list(t.shape))
    stored = meta.get(schema.META_STATS)
    if isinstance(stored, dict):
        out["stats"] = stored
    elif task.need_stats:
        out["stats"] = whole_tensor_stats(t, task.range_formats)
    seed = file_seed(task.path, task.seed)
    flat = t.reshape(-1)
    n = flat.numel()
    if n <= task.sample_size:
        sample = flat
    else:
        idx = torch.randint(0, n, (task.sample_size,), generator=torch.Generator().manual_seed(seed))
        sample = flat[torch.sort(idx).values]
    out["sample"] = sample.to(torch.float32).numpy().copy()
    if task.heat and n:
        out["heat"] = _heat(t, str(meta.get("tensor_name", "")))
    stored = meta.get(schema.META_WHATIF)
    captured = stored.get(schema.WHATIF_FORMATS) if isinstance(stored, dict) else None
    todo = tuple(f for f in task.whatif if not isinstance(captured, dict) or f not in captured)
    if todo and n:
        from tensor_viz.numerics_data import record_axis

        # a file read without its manifest record: the axis its own metadata names
        axis = task.whatif_axis if task.whatif_axis is not None else record_axis(meta)
        out["whatif"] = recompute_whatif(t, todo, axis)
    return out


def recompute_whatif(t: torch.Tensor, formats: tuple[str, ...], axis: int | None
                     ) -> dict[str, Any] | None:
    """The what-if record capture would have stored for ``t`` (tensor_capture.whatif's plan,
    sample and computation: the same axis, the same bound on elements), None when there is
    nothing to compute; a format that fails carries {"error": text}, as at capture."""
    from tensor_capture import whatif
    from tensor_capture.config import WHATIF_MAX_ELEMENTS

    p = whatif.plan(formats, t, schema.VARIANT_HP, axis, WHATIF_MAX_ELEMENTS)
    if p is None:
        return None
    return whatif.compute(whatif.sample(t, p.axis, p.max_elements), p, t.numel())


def run_pair(task: PairTask) -> dict[str, Any]:
    """Measured quantization error: the saved quantized operand against its high-precision twin."""
    try:
        hp, _ = _load(task.hp_path)
        q, _ = _load(task.q_path)
    except ValueError as exc:
        return {"error": _classify(task.hp_path, exc)}
    if hp.shape != q.shape and hp.numel() == q.numel() and hp.dim() > q.dim() == 2 \
            and hp.shape[-1] == q.shape[-1]:
        hp = hp.reshape(q.shape)   # the wgrad GEMM's operand: the same tokens as [s*b, h]
    if hp.shape != q.shape:
        return {"error": ("mismatch", f"{task.q_path}: shape {tuple(q.shape)} differs from "
                                      f"its high-precision file {tuple(hp.shape)}")}
    try:
        return {"errors": errors(hp, q)}
    except Exception as exc:  # quant missing or failing: report it, never crash the report
        return {"error": ("quant-error", f"{task.q_path}: error metrics failed ({type(exc).__name__}: "
                                         f"{str(exc).splitlines()[0][:160] if str(exc) else ''})")}


def _run(task: FileTask | PairTask) -> dict[str, Any]:
    """One task; any unexpected failure becomes a reported problem, not a crash."""
    try:
        return run_pair(task) if isinstance(task, PairTask) else run_file(task)
    except Exception as exc:
        path = task.q_path if isinstance(task, PairTask) else task.path
        return {"error": ("unreadable", f"{path}: {type(exc).__name__}: {str(exc)[:160]}")}


def progress_bar(**kw):
    """A tqdm bar without tqdm's monitor thread (a running thread would rule out forking)."""
    from tqdm import tqdm

    class _Bar(tqdm):
        monitor_interval = 0

    return _Bar(**kw)


def _failed(task: FileTask | PairTask, failure: worker_pool.Failed) -> dict[str, Any]:
    path = task.q_path if isinstance(task, PairTask) else task.path
    return {"error": ("worker", f"{path}: not read: {failure.reason}")}


def run_tasks(tasks: list[FileTask | PairTask], workers: int = 2, desc: str = "reading tensors",
              progress: bool = True, timeout: float | None = worker_pool.DEFAULT_TIMEOUT_S
              ) -> Iterator[dict[str, Any]]:
    """Results in task order; ``workers`` worker processes (tensor_viz.workers: at most
    ``timeout`` seconds per file), inline when 1, for few tasks, or where no worker starts."""
    parallel = workers > 1 and len(tasks) >= 4
    bar = progress_bar(total=len(tasks), desc=desc, unit="file", disable=not progress or not tasks)
    results: dict[int, dict[str, Any]] = {}
    first = 0                                  # tasks before this one were yielded
    try:
        if parallel:
            try:
                for i, res in worker_pool.run_bounded(_run, tasks, workers, timeout):
                    results[i] = _failed(tasks[i], res) if isinstance(res, worker_pool.Failed) else res
                    bar.update()
                    while first in results:
                        yield results.pop(first)
                        first += 1
            except worker_pool.WorkersUnavailable as exc:
                bar.write(f"{exc}; reading the remaining files in this process", file=sys.stderr)
        for i in range(first, len(tasks)):
            if i in results:
                yield results.pop(i)
            else:
                yield _run(tasks[i])
                bar.update()
    finally:
        bar.close()
