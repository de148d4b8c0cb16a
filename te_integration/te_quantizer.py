"""Our emulating quantizer in Transformer Engine's custom-quantizer interface (imports TE).

A quantizer whose ``custom`` property is true makes TE route every GEMM over its tensors to the
quantizer's ``qgemm`` (TE's custom_recipes/gemm.py). Ours holds, per layout TE asks for, the
operand fake-quantized by quant.quantize along the axis that layout's GEMM sums over
(te_integration.emulated_gemm: the quant.gemm_plan plan), and runs the GEMM in float32 over
those values: the numbers our emulation of megatron-core linears computes. "hp" leaves a slot
in high precision (still a custom tensor, so its GEMM partner's qgemm can run).

Only te_integration.factory imports this module, after checking TE's version.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Optional

import torch
from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage, Quantizer

from quant.vocabulary import HIGH_PRECISION

from .emulated_gemm import as_2d, hp_gemm, layout_quantizer, usage_values

_ONE = 1.0   # the stored values are already dequantized: every scale is 1


@dataclasses.dataclass
class EmulatedTensor(QuantizedTensorStorage):
    """Both layouts of one fake-quantized operand ([rows, cols] and its transpose)."""

    data: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None
    data_t: Optional[torch.Tensor] = None
    scale_t: Optional[torch.Tensor] = None
    dtype: Optional[torch.dtype] = None
    device: Optional[torch.device] = None
    original_shape: Optional[tuple] = None
    fmt: str = HIGH_PRECISION
    _quantizer: Optional[Quantizer] = None
    #: the weight these layouts were quantized from (weights only: a parameter that lives
    #: anyway), so a layout asked for later can be quantized from it
    _source: Optional[torch.Tensor] = None

    @property
    def custom(self) -> bool:
        """TE sends GEMMs over this tensor to its quantizer's qgemm."""
        return True

    def prepare_for_saving(self):
        """The layouts for autograd's saved tensors; kept here too. TE caches a weight
        workspace across micro-batches (``is_first_microbatch``) and saves that same object in
        every forward: emptying it here would leave the next forward (before this one's
        backward) nothing to multiply (TE's own cached workspaces are torch tensors, which TE
        saves without this call)."""
        return [self.data, self.data_t, self.scale, self.scale_t], self

    def restore_from_saved(self, tensors):
        self.data, self.data_t, self.scale, self.scale_t = tensors[:4]
        return tensors[4:]

    def get_usages(self):
        return {"rowwise": self.data is not None, "columnwise": self.data_t is not None}

    def update_usage(self, rowwise_usage: Optional[bool] = None,
                     columnwise_usage: Optional[bool] = None):
        """Drop a layout no longer needed; quantize a missing one again from the weight it
        came from (a workspace TE built without its columnwise copy, e.g. under no_grad, and
        reuses for training). A missing layout of an activation cannot be rebuilt (its
        blocks run along another axis of a tensor no longer held): an error."""
        for want, name in ((rowwise_usage, "data"), (columnwise_usage, "data_t")):
            if want is None:
                continue
            if want and getattr(self, name) is None:
                self._rebuild(name)
            if not want:
                setattr(self, name, None)
                setattr(self, name.replace("data", "scale"), None)

    def _rebuild(self, name: str) -> None:
        usage = "rowwise" if name == "data" else "columnwise"
        if self._source is None:
            raise RuntimeError(f"{type(self).__name__}: the {usage} layout was not quantized and "
                               "cannot be rebuilt from the other one (different block axis); "
                               "set the quantizer's usage before quantizing")
        setattr(self, name, usage_values(as_2d(self._source.detach()),
                                         self._quantizer.layouts[usage], usage))
        setattr(self, name.replace("data", "scale"),
                torch.full((1,), _ONE, dtype=torch.float32, device=self._source.device))

    def size(self, *args, **kwargs):
        """[rows, cols] of the operand (from whichever layout is held)."""
        shape = (self.data.shape if self.data is not None
                 else torch.Size(tuple(reversed(self.data_t.shape))))
        return shape[args[0]] if args else shape

    def dequantize(self, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The fake-quantized values in the original shape (rowwise layout)."""
        src = self.data if self.data is not None else self.data_t.t()
        out = src.reshape(self.original_shape) if self.original_shape else src
        return out.to(dtype or self.dtype)

    # TE's generic code reads these names
    @property
    def _data(self):
        return self.data

    @property
    def _scale_inv(self):
        return self.scale

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(fmt={self.fmt}, dtype={self.dtype}, "
                f"shape={self.original_shape})")


class EmulatedQuantizer(Quantizer):
    """TE custom quantizer backed by quant.quantize: it holds the two resolved
    quant.quantizer.Quantizer values of its layouts (``layouts``: rowwise and columnwise, each
    blocked along the axis of the GEMM that layout feeds, emulated_gemm.layout_quantizer; None:
    high precision). The two may differ: the transposed layout feeds another GEMM
    (layouts.LAYOUT_GEMM), which a precision plan may give another format. ``fmt`` names the
    rowwise one (repr, EmulatedTensor.fmt)."""

    def __init__(self, fmt: str, tensor_type: str = "", rowwise: bool = True,
                 columnwise: bool = True, fmt_columnwise: Optional[str] = None) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.internal = True
        self.fmt = fmt
        self.layouts = {"rowwise": layout_quantizer(fmt, "rowwise"),
                        "columnwise": layout_quantizer(fmt_columnwise or fmt, "columnwise")}
        self.tensor_type = tensor_type

    @property
    def custom(self) -> bool:
        return True

    @property
    def supports_allgather_fp8(self) -> bool:
        return False     # gather in high precision, then quantize the whole operand

    def is_requantization_safe(self) -> bool:
        return True      # deterministic rounding: quantizing again gives the same values

    def _layouts(self, x2d: torch.Tensor) -> dict[str, Optional[torch.Tensor]]:
        return {"data": (usage_values(x2d, self.layouts["rowwise"], "rowwise")
                         if self.rowwise_usage else None),
                "data_t": (usage_values(x2d, self.layouts["columnwise"], "columnwise")
                           if self.columnwise_usage else None)}

    def _one(self, device) -> torch.Tensor:
        return torch.full((1,), _ONE, dtype=torch.float32, device=device)

    def quantize_impl(self, tensor: torch.Tensor) -> EmulatedTensor:
        x = tensor.detach()
        layouts = self._layouts(as_2d(x))
        one = self._one(x.device)
        return EmulatedTensor(data=layouts["data"], data_t=layouts["data_t"],
                              scale=one if layouts["data"] is not None else None,
                              scale_t=one if layouts["data_t"] is not None else None,
                              dtype=x.dtype, device=x.device, original_shape=tuple(x.shape),
                              fmt=self.fmt, _quantizer=self,
                              _source=tensor if self.tensor_type == "weight" else None)

    def quantize(self, tensor: torch.Tensor, *, out: Any = None, dtype: Any = None,
                 **kwargs: Any) -> EmulatedTensor:
        if out is not None:
            return self.update_quantized(tensor, out)
        return self.quantize_impl(tensor)

    def update_quantized(self, src: torch.Tensor, dst: EmulatedTensor, *,
                         noop_flag: Optional[torch.Tensor] = None) -> EmulatedTensor:
        if noop_flag is not None and float(noop_flag.reshape(-1)[0]) != 0:
            return dst
        fresh = self.quantize_impl(src)
        for f in ("data", "data_t", "scale", "scale_t", "dtype", "device", "original_shape", "fmt",
                  "_source"):
            setattr(dst, f, getattr(fresh, f))
        dst._quantizer = self
        return dst

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32,
                   device: Any = None, requires_grad: bool = False,
                   pin_memory: bool = False) -> EmulatedTensor:
        shape = tuple(shape)
        device = torch.device("cuda") if device is None else torch.device(device)
        rows, cols = math.prod(shape[:-1]), shape[-1]
        one = self._one(device)
        return EmulatedTensor(
            data=torch.empty((rows, cols), dtype=dtype, device=device) if self.rowwise_usage else None,
            data_t=torch.empty((cols, rows), dtype=dtype, device=device) if self.columnwise_usage else None,
            scale=one if self.rowwise_usage else None, scale_t=one if self.columnwise_usage else None,
            dtype=dtype, device=device, original_shape=shape, fmt=self.fmt, _quantizer=self)

    def dequantize(self, tensor: torch.Tensor, scale: torch.Tensor,
                   dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        out = tensor.to(torch.float32) * scale
        return out if dtype is None else out.to(dtype)

    def qgemm(self, qx: torch.Tensor, qw: torch.Tensor, m_params: Any, out_dtype: torch.dtype,
              sx: torch.Tensor, sw: torch.Tensor, bias: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None, accumulate: bool = False,
              gemm_type: Any = None, qresult_x: Any = None, qresult_w: Any = None) -> torch.Tensor:
        """``qx @ qw.T`` in float32 over the fake-quantized layouts (scales are 1)."""
        return hp_gemm(qx, qw, out_dtype, bias, out, accumulate)

    def transpose_qresult(self, qresult: EmulatedTensor) -> EmulatedTensor:
        qresult.update_usage(columnwise_usage=True)
        return qresult

    def _get_compatible_recipe(self):
        from transformer_engine.common.recipe import CustomRecipe

        return CustomRecipe

    def __repr__(self) -> str:
        return f"{type(self).__name__}(fmt={self.fmt}, tensor_type={self.tensor_type!r})"
