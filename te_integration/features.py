"""Our debug-API features: block-scale statistics, what-if quantization, capture.

Each is an nvdlfw-inspect feature (a config mapper with ``inspect_tensor_enabled`` /
``inspect_tensor``) registered by the files of ``te_integration/debug_features/`` in TE's
``transformer_engine`` namespace (TE's linears call them) and in our ``lowp`` namespace (our
attention capture points call them). The numbers are quant.whatif's (one definition: the same
SQNR, relative error, overflow / underflow / flush ratios and block scales capture stores), along
the axis te_integration.names gives the tensor (its GEMM's reduction axis, quant.gemm_plan).
Values go to nvdlfw-inspect's MetricLogger (``{layer}_{tensor}_{format}_{number}``); capture
goes through tensor_capture's saver (its file names, metadata and manifest).

No Transformer Engine import: TE hands over plain tensors (or, with FP8 weights, a quantized
tensor we dequantize through its own method).
"""
from __future__ import annotations

import atexit
import json
import threading
from typing import Any, Mapping, Optional

import torch

from quant import whatif_record as wr
from tensor_capture import schema
from tensor_capture.schema import CaptureSite

from . import inspect_support, names, options

inspect_support.require()
import nvdlfw_inspect.api as debug_api  # noqa: E402
from nvdlfw_inspect.base import BaseConfigAPIMapper  # noqa: E402
from nvdlfw_inspect.logging import MetricLogger  # noqa: E402
from nvdlfw_inspect.registry import api_method  # noqa: E402


def stat_name(layer_name: str, tensor_name: str, fmt: str, number: str) -> str:
    """The MetricLogger name of one number (TE's ``{layer}_{tensor}_{stat}`` pattern)."""
    return f"{layer_name}_{tensor_name}_{fmt}_{number}"


def _high_precision(tensor: Optional[torch.Tensor], rowwise: Any) -> Optional[torch.Tensor]:
    """The high-precision tensor (TE passes None for FP8 weights: dequantize the rowwise one)."""
    if tensor is None and rowwise is not None and hasattr(rowwise, "dequantize"):
        tensor = rowwise.dequantize()
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    return tensor.detach()


class _LowpFeature(BaseConfigAPIMapper):
    """Routing and schedule shared by our features (tensor parsing as nvdlfw-inspect's)."""

    def parse_config_and_api(self, config, **kwargs):
        """(matches, this tensor's config): our features only route by tensor name."""
        if not kwargs.get("tensor_parsing", False):
            return False, None
        cfg = self._process_tensor_config(dict(config), kwargs["tensor_name"])
        if not cfg:
            return False, None
        cfg.pop("enabled", None)
        return True, cfg

    def _schedule(self, config: Mapping[str, Any], iteration: int) -> tuple[bool, Optional[int]]:
        name = type(self).__name__
        return inspect_support.schedule(
            options.option(config, "freq", name), options.option(config, "start_step", name),
            options.option(config, "end_step", name),
            options.option(config, "start_end_list", name), iteration)

    @api_method
    def inspect_tensor_enabled(self, config: dict, layer_name: str, tensor_name: str,
                               iteration: int, **kwargs: Any) -> tuple[bool, Optional[int]]:
        """(run at this iteration, next iteration that runs): the feature's schedule."""
        return self._schedule(config, iteration)

    @api_method
    def inspect_tensor(self, config: dict, layer_name: str, tensor_name: str, iteration: int,
                       tp_group: Any = None, tensor: Optional[torch.Tensor] = None,
                       rowwise_quantized_tensor: Any = None,
                       columnwise_quantized_tensor: Any = None, quantizer: Any = None,
                       tp_size: int = 1, **kwargs: Any) -> None:
        """TE 2.20's hook: look at the high-precision tensor (returns None)."""
        if not self._schedule(config, iteration)[0]:
            return None          # another feature enabled this tensor at this iteration
        x = _high_precision(tensor, rowwise_quantized_tensor)
        if x is None:
            return None
        namespace, slot = names.BY_NAME[tensor_name]
        self._inspect(config, layer_name, tensor_name, namespace, slot, x, iteration)
        return None

    def _inspect(self, config, layer_name, tensor_name, namespace, slot, x, iteration) -> None:
        raise NotImplementedError

    def _formats(self, config: Mapping[str, Any]) -> tuple[str, ...]:
        return options.option(config, "formats", type(self).__name__)

    def _numbers(self, config, slot: names.Slot, x: torch.Tensor) -> tuple[dict, int]:
        """quant.whatif_set of ``x`` along the slot's axis (sampled to max_elements)."""
        from quant.whatif import whatif_set
        from tensor_capture.whatif import sample

        axis = -1 if slot.axis is None else slot.axis
        limit = options.option(config, "max_elements", type(self).__name__)
        part = sample(x, axis, limit)
        return whatif_set(part, self._formats(config), axis), axis


class LowpWhatIf(_LowpFeature):
    """What-if quantization of a tensor to each listed format, at once (FP8 and FP4 alike,
    also while training in BF16): SQNR (dB), relative error, overflow / underflow / flush-to-zero
    ratios, quant.whatif's definitions, along the tensor's GEMM reduction axis.

    YAML (under ``transformer_engine:`` for TE linears, ``lowp:`` for attention)::

        LowpWhatIf:
          enabled: True
          tensors: [activation, weight, gradient]
          formats: [mxfp8, mxfp4, nvfp4, hifp8]   # default: quant.formats.WHATIF_FORMATS
          freq: 10                                # start_step / end_step / start_end_list too
          max_elements: 65536                     # optional: strided rows, whole blocks

    Logged: ``{layer}_{tensor}_{format}_{sqnr_db|rel_error|overflow_ratio|underflow_ratio|
    flush_ratio}``.
    """

    def _inspect(self, config, layer_name, tensor_name, namespace, slot, x, iteration) -> None:
        results, _ = self._numbers(config, slot, x)
        for fmt, r in results.items():
            if "error" in r:
                debug_api.log_message(f"LowpWhatIf {tensor_name} {fmt}: {r['error']}", layer_name)
                continue
            for key in wr.SCALAR_KEYS:
                MetricLogger.log_scalar(stat_name(layer_name, tensor_name, fmt, key), r[key],
                                        iteration)


#: block-scale numbers logged per block format: name -> reader of a quant.whatif result
def _share(hist: list, blocks: int) -> float:
    """Share of blocks with at least one element in the histogram's nonzero bins."""
    return (blocks - (hist[0] if hist else 0)) / blocks if blocks else 0.0


BLOCK_SCALARS = {
    "scale_min": lambda r: r[wr.BLOCK_SCALE]["min"],
    "scale_max": lambda r: r[wr.BLOCK_SCALE]["max"],
    "scale_std": lambda r: r[wr.BLOCK_SCALE]["std"],
    "blocks": lambda r: r[wr.BLOCKS],
    "clipped_block_ratio": lambda r: _share(r[wr.BLOCK_CLIPPED_HIST], r[wr.BLOCKS]),
    "flushed_block_ratio": lambda r: _share(r[wr.BLOCK_FLUSHED_HIST], r[wr.BLOCKS]),
}


class LowpBlockScaleStats(_LowpFeature):
    """Per-block scale statistics of a block format (MX: the E8M0 shared exponent; NVFP4: the
    E4M3 block scale): min / max / std, the share of blocks that clip (hold an element beyond
    the format's range after scaling) or flush (hold a nonzero element that rounds to zero),
    and the scale histogram (MX: per exponent; NVFP4: per binade of the scale).

    YAML::

        LowpBlockScaleStats:
          enabled: True
          tensors: [activation, weight, gradient]
          formats: [mxfp8, mxfp4, nvfp4]          # block formats only; default: these three
          freq: 10

    Logged: ``{layer}_{tensor}_{format}_{scale_min|scale_max|scale_std|blocks|
    clipped_block_ratio|flushed_block_ratio}`` and ``..._scale_hist_{bin}`` (blocks per bin);
    the histogram also goes to nvdlfw-inspect's log as one JSON line.
    """

    def _inspect(self, config, layer_name, tensor_name, namespace, slot, x, iteration) -> None:
        results, axis = self._numbers(config, slot, x)
        for fmt, r in results.items():
            if "error" in r or wr.BLOCK_SCALE not in r:
                debug_api.log_message(f"LowpBlockScaleStats {tensor_name} {fmt}: "
                                      f"{r.get('error', 'no blocks')}", layer_name)
                continue
            for key, read in BLOCK_SCALARS.items():
                value = read(r)
                if value is not None:
                    MetricLogger.log_scalar(stat_name(layer_name, tensor_name, fmt, key),
                                            value, iteration)
            hist = r[wr.BLOCK_SCALE]["hist"]
            for i, count in enumerate(hist["counts"]):
                MetricLogger.log_scalar(stat_name(layer_name, tensor_name, fmt,
                                                  f"scale_hist_{hist['min_bin'] + i}"),
                                        count, iteration)
            debug_api.log_message(
                f"LowpBlockScaleStats iteration={iteration} tensor={tensor_name} format={fmt} "
                f"axis={axis} " + json.dumps({k: r[k] for k in (
                    wr.BLOCK_SCALE, wr.BLOCK_CLIPPED_HIST, wr.BLOCK_FLUSHED_HIST)}),
                layer_name, extra_cachable_args=(tensor_name, fmt, iteration))


class _Savers:
    """One tensor_capture saver per (folder, options), closed at end_debug / exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._savers: dict[tuple, Any] = {}

    def get(self, save_dir: str, stats_only: bool, whatif: tuple[str, ...],
            max_rows: Optional[int]):
        key = (save_dir, stats_only, whatif, max_rows)
        with self._lock:
            saver = self._savers.get(key)
            if saver is None:
                from tensor_capture.saver import TensorSaver

                saver = TensorSaver(enabled=True, save_dir=save_dir, stats_only=stats_only,
                                    whatif_formats=whatif, max_rows=max_rows,
                                    max_iterations="unlimited")
                self._savers[key] = saver
            return saver

    def close(self) -> None:
        with self._lock:
            savers, self._savers = list(self._savers.values()), {}
        for saver in savers:
            saver.close()


SAVERS = _Savers()
atexit.register(SAVERS.close)


class LowpCapture(_LowpFeature):
    """Capture with our file names, metadata and manifest (tensor_capture), so our report,
    ``numerics.csv`` and the catalog read a TE run like one of ours. TE's names map to ours
    (activation -> linear forward input, gradient -> backward grad_output, ...;
    te_integration.names), the layer name is the module path and its ``layers.N`` the layer.

    YAML::

        LowpCapture:
          enabled: True
          tensors: [activation, weight, gradient]
          save_dir: /path/to/tensors               # default: $TENSOR_SAVE_DIR or ./tensor_logs
          whatif_formats: [mxfp8, nvfp4]           # optional what-if numerics in the metadata
          stats_only: False                        # True: manifest records only, no files
          max_rows: 64                             # optional: keep at most this many rows
          freq: 10
    """

    def _inspect(self, config, layer_name, tensor_name, namespace, slot, x, iteration) -> None:
        name = type(self).__name__
        saver = SAVERS.get(options.option(config, "save_dir", name),
                           options.option(config, "stats_only", name),
                           tuple(options.option(config, "whatif_formats", name)),
                           options.option(config, "max_rows", name))
        site = CaptureSite(layer_type=slot.layer_type, operation=slot.operation,
                           phase=slot.phase, tensor_name=slot.tensor_name,
                           component=slot.component, layer_idx=names.layer_index(layer_name),
                           module_path=layer_name, submodule=layer_name.rsplit(".", 1)[-1])
        saver.capture(x, site, iteration=iteration, whatif_axis=slot.axis,
                      metadata={schema.META_DEBUG_API: {"namespace": namespace,
                                                        "tensor": tensor_name}})


FEATURES = (LowpWhatIf, LowpBlockScaleStats, LowpCapture)
assert {f.__name__ for f in FEATURES} == set(options.FEATURE_OPTIONS)
