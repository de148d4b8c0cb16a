"""Record building: one selected tensor + its naming fields -> a WriteItem for the writer.

Why its own module: what a record holds (file-name fields, metadata keys from the schema,
statistics on the tensor's device or deferred to the writer thread, quantization analyses
along a GEMM operand's reduction axis) and how the tensor reaches the host (pinned copies
and a CUDA event, or a host clone) are independent of which tensors are selected
(tensor_capture.policy) and of how the writer is run (tensor_capture.sink).
"""
from __future__ import annotations

import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from . import schema, stats
from .config import CaptureConfig
from .state import STATE
from .writer import WriteItem


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


def short_dtype(dtype: torch.dtype) -> str:
    """The quant_type label of an unemulated tensor (its own dtype)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
            torch.float64: "fp64"}.get(dtype, str(dtype).replace("torch.", ""))


class RecordBuilder:
    """Statistics, metadata and host staging of captured tensors for one saver's config."""

    def __init__(self, config: CaptureConfig):
        self.config = config
        self._ranges_cache: dict[torch.dtype, tuple[stats.RangeSpec, ...]] = {}
        self._stats_cache: dict[tuple, torch.Tensor] = {}
        self._ts_sec = -1
        self._ts = ""

    def new_iteration(self) -> None:
        """Forget statistics reused within one step (parameters change at the step)."""
        self._stats_cache.clear()

    # -- statistics ----------------------------------------------------------------------------
    def _formats_in_play(self) -> list[str]:
        names = list(self.config.range_formats)
        if self.config.emulating and self.config.quant_type not in names:
            names.insert(0, self.config.quant_type)
        return names

    def ranges(self, dtype: torch.dtype) -> tuple[stats.RangeSpec, ...]:
        """The tensor's own dtype range, then the emulated format's and range_formats'."""
        hit = self._ranges_cache.get(dtype)
        if hit is not None:
            return hit
        specs: list[stats.RangeSpec] = []
        own = stats.dtype_range(dtype)
        if own is not None:
            specs.append(own)
        for n in self._formats_in_play():
            spec = stats.format_range(n)
            if spec is not None and spec.name not in {s.name for s in specs}:
                specs.append(spec)
        out = tuple(specs)
        self._ranges_cache[dtype] = out
        return out

    def stats(self, x: torch.Tensor, ranges: tuple[stats.RangeSpec, ...],
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

    def analysis_formats(self) -> tuple[str, ...]:
        return tuple(n for n in self._formats_in_play() if stats.is_scaled(n))

    def analyses(self, x: torch.Tensor, axis: int) -> dict[str, Any]:
        """quant.analyze_quantization of each scaled format in play along ``axis``."""
        out: dict[str, Any] = {}
        names = self.analysis_formats()
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

    # -- metadata --------------------------------------------------------------------------------
    def recipe_specs(self, layer_type: str, tensor_name: str, module_path: str | None = None,
                     layer: int | None = None) -> dict[str, Any] | None:
        """{gemm: spec summary} of a linear operand as each GEMM it feeds computed, else None:
        the precision plan's rule for this module (CUSTOM_QUANT_PLAN; {"kind": "hp"} where it
        keeps the GEMM unquantized), else the emulated recipe."""
        role = schema.hp_twin_name(tensor_name)
        if layer_type != "linear" or not self.config.emulating:
            return None
        from quant.recipes import ROLES, get_recipe

        from .emulation import recipe_name

        specs = {}
        for t, g in ROLES:
            if t == role:
                name = recipe_name(module_path, layer, g) if STATE.plan is not None else (
                    self.config.quant_type)
                specs[g] = get_recipe(name).quantizer(t, g).summary() if name else {"kind": "hp",
                                                                              "element": None}
        return specs or None

    def timestamp(self) -> str:
        now = int(time.time())
        if now != self._ts_sec:
            self._ts_sec = now
            self._ts = time.strftime("%Y%m%d_%H%M%S", time.localtime(now))
        return self._ts

    def metadata(self, name: schema.TensorName, site: schema.CaptureSite, tensor: torch.Tensor,
                 info: dict[str, Any], *, sampled_rows: int | None, row_stride: int | None,
                 quant_axis: int | None, extra: dict[str, Any] | None) -> dict[str, Any]:
        """The record's metadata: the name fields (``name``: the site's plus the event's),
        shape/dtype, the site's module and variant, ranks, analyses, extras."""
        variant = site.variant
        meta = {f: getattr(name, f) for f in schema.NAME_FIELDS}   # asdict() is slow here
        meta.update({
            schema.META_SHAPE: list(tensor.shape), schema.META_DTYPE: str(tensor.dtype),
            schema.META_MODULE_PATH: site.module_path, schema.META_SUBMODULE: site.submodule,
            schema.META_VARIANT: variant, schema.META_SAMPLED_ROWS: sampled_rows,
            schema.META_SAMPLED_ROW_STRIDE: row_stride, schema.META_EMULATED_FORMAT: (
                self.config.quant_type if self.config.emulating else None),
            **{k: info[k] for k in schema.META_PARALLEL},
            schema.META_MCORE_VERSION: megatron_core_version(),
        })
        if self.config.emulating:
            meta[schema.META_RECIPE] = self.config.quant_type
            specs = self.recipe_specs(name.layer_type, name.tensor_name, site.module_path,
                                      name.layer_idx)
            if specs:
                meta[schema.META_RECIPE_SPECS] = specs
        if quant_axis is not None and variant == schema.VARIANT_HP:
            analyses = self.analyses(tensor.detach(), quant_axis)
            if analyses:
                meta[schema.META_QUANT_ANALYSIS] = analyses
        if extra:
            meta.update(extra)
        return meta

    # -- the record --------------------------------------------------------------------------------
    def build(self, directory: Path, rank: int | None, filename: str | None,
              full: torch.Tensor, *, kept: torch.Tensor | None, sampled: bool,
              stats_vec: torch.Tensor | None, ranges: tuple[stats.RangeSpec, ...],
              meta: dict[str, Any], whatif_src: torch.Tensor | None = None) -> WriteItem:
        """Stage the tensor (``kept``: the rows for the file, None for stats only) on the host.

        CUDA: pinned non-blocking copies and an event the writer waits on. CPU with
        ``stats_vec`` None: a clone the writer computes the statistics from (the caller may
        overwrite its buffer, as Megatron does, once we return). ``whatif_src``: a tensor (or
        a view of a sample of it) staged the same way for the writer's what-if numerics."""
        event = stats_src = wsrc = None
        if full.is_cuda:
            host = None
            if kept is not None:
                host = torch.empty(kept.shape, dtype=kept.dtype, pin_memory=True)
                host.copy_(kept, non_blocking=True)
            svec = torch.empty(stats_vec.shape, dtype=stats_vec.dtype, pin_memory=True)
            svec.copy_(stats_vec, non_blocking=True)
            if whatif_src is not None:
                wsrc = torch.empty(whatif_src.shape, dtype=whatif_src.dtype, pin_memory=True)
                wsrc.copy_(whatif_src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        elif stats_vec is None:
            stats_src = full.clone(memory_format=torch.contiguous_format)
            host = None
            if kept is not None:
                host = stats_src if not sampled else kept.clone(memory_format=torch.contiguous_format)
            svec = None
        else:
            host = kept.clone(memory_format=torch.contiguous_format) if kept is not None else None
            svec = stats_vec
            if whatif_src is not None:
                wsrc = whatif_src.clone(memory_format=torch.contiguous_format)
        return WriteItem(directory, rank, filename, host, svec, ranges, meta, event,
                         stats_src=stats_src, whatif_src=wsrc)
