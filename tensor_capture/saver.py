"""TensorSaver: decides what to capture, computes statistics on the device, hands off to the writer.

Usable on its own (no Megatron needed)::

    from tensor_capture.saver import TensorSaver
    saver = TensorSaver(enabled=True, save_dir="/tmp/caps", quant_type="mxfp8")
    saver.set_iteration(0)
    saver.save_tensor(x, "linear", "forward", tensor_name="input", layer_idx=0,
                      phase="pre", component="linear", module_path="decoder.layers.0.mlp.linear_fc1")
    saver.close()

Inside a patched Megatron tree the process-wide instance comes from :func:`get_tensor_saver`
(configured from TENSOR_SAVE_* / CUSTOM_QUANT_TYPE / TENSOR_SAVE_CONFIG).
"""
from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from . import budget, numbering, schema, stats
from .config import CaptureConfig, ConfigError, load_config, with_overrides
from .state import STATE
from .writer import BackgroundWriter, WriteItem

log = logging.getLogger("tensor_capture")

__all__ = ["TensorSaver", "get_tensor_saver", "configure", "save_tensor", "save_attention_tensors",
           "save_linear_tensors", "ConfigError"]


@lru_cache(maxsize=1)
def megatron_core_version() -> str | None:
    """The version of the megatron-core tree actually running (a patched copy or a Megatron-LM
    checkout may differ from the pip-installed distribution), else the installed distribution's."""
    info = sys.modules.get("megatron.core.package_info")   # megatron/core/__init__ imports it
    if isinstance(getattr(info, "__version__", None), str):
        return info.__version__
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:
        return None


def _parallel_ranks() -> dict[str, int | None]:
    """Global/TP/PP/DP ranks and world size, without importing Megatron if it is not loaded."""
    out: dict[str, int | None] = {"rank": 0, "tp_rank": None, "pp_rank": None, "dp_rank": None,
                                  "world_size": 1}
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        out["rank"] = dist.get_rank()
        out["world_size"] = dist.get_world_size()
    else:
        out["rank"] = int(os.environ.get("RANK", 0) or 0)
        out["world_size"] = int(os.environ.get("WORLD_SIZE", 1) or 1)
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None:
        try:
            if ps.model_parallel_is_initialized():
                out["tp_rank"] = ps.get_tensor_model_parallel_rank()
                out["pp_rank"] = ps.get_pipeline_model_parallel_rank()
                out["dp_rank"] = ps.get_data_parallel_rank()
        except Exception:  # partially initialized state: leave them unknown
            pass
    return out


def _short_dtype(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
            torch.float64: "fp64"}.get(dtype, str(dtype).replace("torch.", ""))


class TensorSaver:
    """Captures tensors with metadata and statistics; see the module docstring."""

    #: CPU tensors: compute statistics on the writer thread (False: on the caller's thread).
    host_stats_in_writer: bool = True

    def __init__(self, config: CaptureConfig | None = None, **overrides: Any):
        if config is None:
            config = load_config(**overrides)
        elif overrides:
            config = load_config(env={}, **{**_config_dict(config), **overrides})
        self.config = config
        self.iteration: int = config.iteration
        self.sample_idx: int | None = None
        self._lock = threading.Lock()
        self._counter = 0
        self._bytes = 0
        self._saved_iters: set[int] = set()
        self._warned: set[str] = set()
        self._failed: str | None = None
        self._closed = False
        self._writer: BackgroundWriter | None = None
        self._dir_ready = False
        self._ranks: dict[str, int | None] | None = None
        self._ranges_cache: dict[torch.dtype, tuple[stats.RangeSpec, ...]] = {}
        self._want_cache: dict[tuple, bool] = {}
        self._stats_cache: dict[tuple, torch.Tensor] = {}
        self._ts_sec = -1
        self._ts = ""
        self.budget = budget.ByteBudget(config.byte_budget, config.min_iterations)
        self.directory = Path(config.save_dir)
        if config.enabled:
            self._prepare_dir()

    # -- state the training loop drives --------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.config.enabled and self._failed is None and not self._closed

    @property
    def quant_type(self) -> str | None:
        return self.config.quant_type

    def set_iteration(self, iteration: int) -> None:
        self.iteration = int(iteration)
        self._stats_cache.clear()

    def step(self) -> None:
        """Advance to the next iteration (call once per optimizer step)."""
        self.iteration += 1
        self._stats_cache.clear()

    def set_sample_idx(self, sample_idx: int | None) -> None:
        self.sample_idx = None if sample_idx is None else int(sample_idx)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._closed:
            return
        if self._writer is not None:
            self._writer.close()
        if self.config.enabled and self._failed is None and self.config.min_iterations and (
                len(self._saved_iters) < self.config.min_iterations):
            log.warning("tensor capture: saved %d iteration(s), fewer than min_iterations=%d "
                        "(training stopped early, or the iteration schedule skipped them)",
                        len(self._saved_iters), self.config.min_iterations)
        self._closed = True

    @property
    def saved_iterations(self) -> list[int]:
        return sorted(self._saved_iters)

    @property
    def bytes_saved(self) -> int:
        return self._bytes

    # -- selection -------------------------------------------------------------------------------
    def iteration_selected(self, iteration: int | None = None) -> bool:
        """Whether the schedule (start/end/every, max_iterations) saves this iteration."""
        c = self.config
        it = self.iteration if iteration is None else iteration
        if it < c.iter_start or (c.iter_end is not None and it > c.iter_end):
            return False
        if (it - c.iter_start) % c.iter_every:
            return False
        if c.max_iterations is not None and it not in self._saved_iters and (
                len(self._saved_iters) >= c.max_iterations):
            return False
        return True

    def wants(self, layer_type: str, operation: str, phase: str, tensor_name: str,
              layer_idx: int | None = None, module_path: str | None = None) -> bool:
        """Whether the layer/operation/phase/tensor filters select this tensor (cached)."""
        key = (layer_type, operation, phase, tensor_name, layer_idx, module_path)
        hit = self._want_cache.get(key)
        if hit is not None:
            return hit
        c = self.config
        ok = (layer_type in c.layer_types or layer_type not in ("attention", "linear")) and (
            operation in c.operations or operation not in ("forward", "backward")) and (
            phase in c.phases or phase not in ("pre", "post"))
        if ok and c.tensor_names is not None:
            ok = tensor_name in c.tensor_names
        if ok and c.layers is not None:
            ok = layer_idx in c.layers
        if ok and c.module_regex is not None:
            import re

            ok = module_path is not None and re.search(c.module_regex, module_path) is not None
        self._want_cache[key] = ok
        return ok

    def should_capture(self, layer_type: str, operation: str, phase: str, tensor_name: str,
                       layer_idx: int | None = None, module_path: str | None = None,
                       iteration: int | None = None) -> bool:
        return (self.enabled and self.iteration_selected(iteration)
                and self.wants(layer_type, operation, phase, tensor_name, layer_idx, module_path)
                and self._rank_selected())

    def _rank_selected(self) -> bool:
        if self.config.ranks is None:
            return True
        return self._rank_info()["rank"] in self.config.ranks

    def _rank_info(self) -> dict[str, int | None]:
        if self._ranks is None or (self._ranks["tp_rank"] is None and
                                   "megatron.core.parallel_state" in sys.modules):
            info = _parallel_ranks()
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                self._ranks = info   # stable from now on
            else:
                return info
        return self._ranks

    # -- saving ----------------------------------------------------------------------------------
    def save_tensor(self, tensor: torch.Tensor, layer_type: str, operation: str,
                    quant_type: str | None = None, tensor_name: str = "tensor",
                    layer_idx: int | None = None, phase: str = "unknown",
                    component: str = "unknown", rank: int | None = None,
                    sample_idx: int | None = None, iteration: int | None = None, *,
                    module_path: str | None = None, submodule: str | None = None,
                    variant: str = schema.VARIANT_HP, metadata: dict[str, Any] | None = None,
                    quant_axis: int | None = None) -> str | None:
        """Capture one tensor (the seeds' signature plus keyword extras).

        ``quant_axis``: for a GEMM operand, its reduction axis; then each scaled format in
        play (the emulated one, scaled ``range_formats``) is analysed along it with
        quant.analyze_quantization into metadata["quant_analysis"].
        Returns the file path it will be written to, "" for a stats-only record, or None
        when nothing was captured (disabled, filtered out, or not a tensor).
        """
        if not self.enabled or not isinstance(tensor, torch.Tensor):
            return None
        it = self.iteration if iteration is None else int(iteration)
        if not self.should_capture(layer_type, operation, phase, tensor_name, layer_idx,
                                   module_path, it):
            return None
        try:
            return self._capture(tensor, layer_type, operation, quant_type, tensor_name, layer_idx,
                                 phase, component, rank, sample_idx, it, module_path, submodule,
                                 variant, metadata, quant_axis)
        except ValueError as exc:   # a bad naming field from a caller: say so, keep training
            self._warn_once(f"bad:{exc}", f"tensor capture: skipped a tensor: {exc}")
            return None

    def _capture(self, tensor, layer_type, operation, quant_type, tensor_name, layer_idx, phase,
                 component, rank, sample_idx, it, module_path, submodule, variant, metadata,
                 quant_axis=None):
        info = self._rank_info()
        rank = info["rank"] if rank is None else rank
        sample_idx = self.sample_idx if sample_idx is None else sample_idx
        quant_label = quant_type or self.config.quant_type or _short_dtype(tensor.dtype)
        ranges = self._ranges(tensor.dtype)
        x = full = tensor.detach()
        is_param = tensor.is_leaf and tensor.requires_grad
        # CPU tensors: statistics run on the writer thread over the copy the file needs anyway
        # (torch ops release the GIL, so they overlap the training step on another core).
        defer = self.host_stats_in_writer and not x.is_cuda and not is_param
        stats_vec = None if defer else self._stats(x, ranges, is_param)
        keep_file, sampled_rows, row_stride = not self.config.stats_only, None, None
        if keep_file:
            x, sampled_rows, row_stride = self._sample_rows(x)
            nbytes = x.numel() * x.element_size()
            keep_file = self._budget_allows(nbytes, it)
        with self._lock:
            self._counter += 1
            counter = self._counter
            if keep_file:
                self._bytes += nbytes
            self._saved_iters.add(it)
        name = schema.TensorName(
            layer_type=layer_type, operation=operation, tensor_name=tensor_name,
            quant_type=quant_label, layer_idx=layer_idx, phase=phase, component=component,
            iteration=it, rank=rank, sample_idx=sample_idx, timestamp=self._timestamp(),
            counter=counter,
        )
        filename = schema.build_filename(name) if keep_file else None
        meta = {f: getattr(name, f) for f in schema.NAME_FIELDS}   # asdict() is slow here
        meta.update({
            schema.META_SHAPE: list(tensor.shape), schema.META_DTYPE: str(tensor.dtype),
            schema.META_MODULE_PATH: module_path, schema.META_SUBMODULE: submodule,
            schema.META_VARIANT: variant, schema.META_SAMPLED_ROWS: sampled_rows,
            schema.META_SAMPLED_ROW_STRIDE: row_stride, schema.META_EMULATED_FORMAT: (
                self.config.quant_type if self.config.emulating else None),
            **{k: info[k] for k in schema.META_PARALLEL},
            schema.META_MCORE_VERSION: megatron_core_version(),
        })
        if quant_axis is not None and variant == schema.VARIANT_HP:
            analyses = self._analyses(full, quant_axis)
            if analyses:
                meta[schema.META_QUANT_ANALYSIS] = analyses
        if metadata:
            meta.update(metadata)
        event = None
        if x.is_cuda:
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True) if keep_file else None
            if host is not None:
                host.copy_(x, non_blocking=True)
            svec = torch.empty(stats_vec.shape, dtype=stats_vec.dtype, pin_memory=True)
            svec.copy_(stats_vec, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        elif defer:
            # A copy: the caller may overwrite its buffer (Megatron reuses some) after we return.
            src = full.clone(memory_format=torch.contiguous_format)
            host = None
            if keep_file:
                host = src if sampled_rows is None else x.clone(memory_format=torch.contiguous_format)
            svec = None
        else:
            host = x.clone(memory_format=torch.contiguous_format) if keep_file else None
            svec = stats_vec
        writer = self._get_writer()
        if writer is None:
            return None
        item = WriteItem(self.directory, rank, filename, host, svec, ranges, meta, event,
                         stats_src=src if defer else None)
        if not writer.submit(item):
            return None
        return str(self.directory / filename) if filename else ""

    def save_attention_tensors(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               quant_type: str | None = None, operation: str = "forward",
                               layer_idx: int | None = None, phase: str = "pre",
                               component: str = "FA", rank: int | None = None,
                               sample_idx: int | None = None, iteration: int | None = None,
                               **kw: Any) -> dict[str, str | None]:
        """Save query, key and value of one attention call (seed API)."""
        return {n: self.save_tensor(t, "attention", operation, quant_type, n, layer_idx, phase,
                                    component, rank, sample_idx, iteration, **kw)
                for n, t in (("query", query), ("key", key), ("value", value))}

    def save_linear_tensors(self, input_tensor: torch.Tensor, weight: torch.Tensor,
                            quant_type: str | None = None, operation: str = "forward",
                            layer_idx: int | None = None, phase: str = "pre",
                            component: str = "linear", rank: int | None = None,
                            sample_idx: int | None = None, iteration: int | None = None,
                            **kw: Any) -> dict[str, str | None]:
        """Save the input and weight of one linear call (seed API)."""
        return {n: self.save_tensor(t, "linear", operation, quant_type, n, layer_idx, phase,
                                    component, rank, sample_idx, iteration, **kw)
                for n, t in (("input", input_tensor), ("weight", weight))}

    # -- helpers ---------------------------------------------------------------------------------
    def _ranges(self, dtype: torch.dtype) -> tuple[stats.RangeSpec, ...]:
        hit = self._ranges_cache.get(dtype)
        if hit is not None:
            return hit
        specs: list[stats.RangeSpec] = []
        own = stats.dtype_range(dtype)
        if own is not None:
            specs.append(own)
        names = list(self.config.range_formats)
        if self.config.emulating and self.config.quant_type not in names:
            names.insert(0, self.config.quant_type)
        for n in names:
            spec = stats.format_range(n)
            if spec is not None and spec.name not in {s.name for s in specs}:
                specs.append(spec)
        out = tuple(specs)
        self._ranges_cache[dtype] = out
        return out

    def _stats(self, x: torch.Tensor, ranges: tuple[stats.RangeSpec, ...],
               is_param: bool) -> torch.Tensor:
        """Statistics, reused for an unchanged parameter (a weight is captured in the forward
        and again in the backward of the same step; ``_version`` changes on any update).
        Only parameters: they stay allocated, so their address cannot be reused by another."""
        if not is_param:
            return stats.compute(x, ranges)
        key = (x.data_ptr(), x._version, tuple(x.shape), x.stride(), x.dtype, ranges)
        hit = self._stats_cache.get(key)
        if hit is None:
            if len(self._stats_cache) > 4096:
                self._stats_cache.clear()
            hit = self._stats_cache[key] = stats.compute(x, ranges)
        return hit

    def _analysis_formats(self) -> tuple[str, ...]:
        names = list(self.config.range_formats)
        if self.config.emulating and self.config.quant_type not in names:
            names.insert(0, self.config.quant_type)
        return tuple(n for n in names if stats.is_scaled(n))

    def _analyses(self, x: torch.Tensor, axis: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        names = self._analysis_formats()
        if not names or x.numel() == 0 or not x.is_floating_point():
            return out
        import quant

        for name in names:
            try:
                out[name] = quant.analyze_quantization(x, name, axis=axis).to_dict()
                out[name]["axis"] = axis
            except Exception as exc:  # analysis is advisory; never stop a capture for it
                out[name] = {"error": str(exc).splitlines()[0][:200]}
        return out

    def _sample_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, int | None, int | None]:
        max_rows = self.config.max_rows
        if max_rows is None or x.dim() == 0:
            return x, None, None
        rows = x.numel() // max(x.shape[-1], 1) if x.dim() >= 2 else x.numel()
        if rows <= max_rows:
            return x, None, None
        stride = math.ceil(rows / max_rows)
        flat = x.reshape(rows, -1) if x.dim() >= 2 else x.reshape(rows, 1)
        kept = flat[::stride]
        if x.dim() < 2:
            kept = kept.reshape(-1)
        return kept, kept.shape[0], stride

    def _budget_allows(self, nbytes: int, it: int) -> bool:
        return self.budget.allows(self._bytes, nbytes, it, self._saved_iters, self._warn_once)

    def _timestamp(self) -> str:
        now = int(time.time())
        if now != self._ts_sec:
            self._ts_sec = now
            self._ts = time.strftime("%Y%m%d_%H%M%S", time.localtime(now))
        return self._ts

    def _prepare_dir(self) -> bool:
        if self._dir_ready:
            return True
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".write_probe_{os.getpid()}"
            with open(probe, "wb") as fh:
                fh.write(b"0")
            probe.unlink()
        except OSError as exc:
            self._disable(f"tensor capture: cannot write to {self.directory} "
                          f"({exc.strerror or exc}); saving is disabled, training continues. "
                          "Fix: set TENSOR_SAVE_DIR to a writable directory.")
            return False
        self._dir_ready = True
        return True

    def _get_writer(self) -> BackgroundWriter | None:
        if self._writer is None:
            with self._lock:
                if self._writer is None:
                    if not self._prepare_dir():
                        return None
                    self._writer = BackgroundWriter(self.config.queue_size, on_error=self._disable)
        return self._writer

    def _disable(self, message: str) -> None:
        if self._failed is None:
            self._failed = message
            print(message, file=sys.stderr, flush=True)
            if self is _GLOBAL.get("saver"):
                _refresh_state(self)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)
            print(message, file=sys.stderr, flush=True)


def _config_dict(config: CaptureConfig) -> dict[str, Any]:
    from dataclasses import fields

    return {f.name: getattr(config, f.name) for f in fields(config)}


# -- the process-wide saver ------------------------------------------------------------------------
_GLOBAL: dict[str, TensorSaver] = {}
_GLOBAL_LOCK = threading.Lock()


def _refresh_state(saver: TensorSaver) -> None:
    STATE.quant_type = saver.config.quant_type
    STATE.emulate = saver.config.emulating
    STATE.emulate_attention = STATE.emulate and saver.config.emulate_attention
    STATE.warn_underflow = STATE.emulate and saver.config.underflow_warnings
    STATE.active = saver.enabled or STATE.emulate
    from . import hooks

    if saver.enabled or STATE.warn_underflow:   # module paths for captures and warnings
        hooks.install_discovery()
    else:                      # the global module hook costs every module call: remove it
        hooks.uninstall_discovery()


def get_tensor_saver() -> TensorSaver:
    """The process-wide saver, configured from the environment on first use."""
    saver = _GLOBAL.get("saver")
    if saver is None:
        with _GLOBAL_LOCK:
            saver = _GLOBAL.get("saver")
            if saver is None:
                config, notes = budget.bounded(load_config())
                saver = TensorSaver(config)
                _GLOBAL["saver"] = saver
                _refresh_state(saver)
                if saver.enabled:
                    budget.announce_start(saver.config, notes)
    return saver


def configure(config: CaptureConfig | str | os.PathLike[str] | None = None,
              **overrides: Any) -> TensorSaver:
    """Replace the process-wide saver (a config object, a YAML path, or keyword settings)."""
    with _GLOBAL_LOCK:
        old = _GLOBAL.get("saver")
        if not isinstance(config, CaptureConfig):
            config = load_config(config, **overrides)
        elif overrides:
            config = load_config(env={}, **{**_config_dict(config), **overrides})
        config, notes = budget.bounded(config)
        saver = TensorSaver(config)
        if old is not None:
            old.close()
        _GLOBAL["saver"] = saver
        numbering.reset()
        _refresh_state(saver)
        if saver.enabled:
            budget.announce_start(saver.config, notes)
    return saver


def stop_capture(saver: TensorSaver) -> None:
    """Finish capturing (files flushed, hooks off); emulation, if any, goes on."""
    saver.close()
    if saver is _GLOBAL.get("saver"):
        _refresh_state(saver)


def reset_tensor_saver() -> None:
    """Close and forget the process-wide saver (tests; a new one is built on next use)."""
    with _GLOBAL_LOCK:
        old = _GLOBAL.pop("saver", None)
        if old is not None:
            old.close()
        numbering.reset()
        STATE.active = STATE.emulate = STATE.emulate_attention = False
        STATE.paused = STATE.warn_underflow = False
        STATE.quant_type = None
        STATE.current_linear = None
        from . import hooks

        hooks.uninstall_discovery()


def save_tensor(tensor: torch.Tensor, layer_type: str, operation: str, quant_type: str | None = None,
                tensor_name: str = "tensor", layer_idx: int | None = None, phase: str = "unknown",
                component: str = "unknown", rank: int | None = None,
                sample_idx: int | None = None, iteration: int | None = None,
                **kw: Any) -> str | None:
    """Seed convenience function: save through the process-wide saver."""
    return get_tensor_saver().save_tensor(tensor, layer_type, operation, quant_type, tensor_name,
                                          layer_idx, phase, component, rank, sample_idx,
                                          iteration, **kw)


def save_attention_tensors(query, key, value, quant_type=None, operation="forward",
                           layer_idx=None, phase="pre", component="FA", rank=None,
                           sample_idx=None, iteration=None, **kw):
    return get_tensor_saver().save_attention_tensors(query, key, value, quant_type, operation,
                                                     layer_idx, phase, component, rank,
                                                     sample_idx, iteration, **kw)


def save_linear_tensors(input_tensor, weight, quant_type=None, operation="forward",
                        layer_idx=None, phase="pre", component="linear", rank=None,
                        sample_idx=None, iteration=None, **kw):
    return get_tensor_saver().save_linear_tensors(input_tensor, weight, quant_type, operation,
                                                  layer_idx, phase, component, rank, sample_idx,
                                                  iteration, **kw)
