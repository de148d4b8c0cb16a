"""Which tensor a debug-API tensor name is, in our capture vocabulary and in quant.gemm_plan.

Why one table: TE calls a linear's tensors ``activation``, ``weight``, ``gradient``, ``output``,
``dgrad`` and ``wgrad``; our ``lowp`` namespace calls attention's ``query``, ``key``, ``value``,
``probs`` and ``context``. Each maps to the naming fields capture writes
(tensor_capture.schema: layer type, operation, phase, component, tensor name) and, for a GEMM
operand, to its quant.gemm_plan entry (the axis its blocks run along: what-if and block-scale
numbers use the same axis our emulation quantizes along). The YAML's valid tensor names per
namespace derive from this table.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from quant import gemm_plan

#: TE's namespace (its Linear / LayerNormLinear / LayerNormMLP / GroupedLinear call the hooks)
TE_NAMESPACE = "transformer_engine"
#: ours: attention tensors, called from our Megatron capture points
LOWP_NAMESPACE = "lowp"


@dataclass(frozen=True)
class Slot:
    """One debug-API tensor in our vocabulary; ``gemm``/``operand``: its quant.gemm_plan entry
    (None: not a GEMM operand, numbers along the last axis)."""

    layer_type: str
    operation: str
    phase: str
    component: str
    tensor_name: str
    gemm: Optional[str] = None
    operand: Optional[str] = None

    @property
    def axis(self) -> Optional[int]:
        """The axis the tensor is blocked along in its GEMM (None: no GEMM)."""
        return None if self.gemm is None else gemm_plan.axis(self.gemm, self.operand)


def _lin(op: str, phase: str, name: str, gemm: Optional[str] = None,
         operand: Optional[str] = None) -> Slot:
    return Slot("linear", op, phase, "linear", name, gemm, operand)


def _att(op: str, phase: str, name: str, gemm: Optional[str] = None) -> Slot:
    return Slot("attention", op, phase, "FA", name, gemm, None if gemm is None else name)


#: (namespace, debug-API tensor name) -> Slot. TE's activation/weight/gradient are the forward
#: and dgrad operands as TE hands them over (before quantization).
SLOTS: dict[tuple[str, str], Slot] = {
    (TE_NAMESPACE, "activation"): _lin("forward", "pre", "input", "fprop", "input"),
    (TE_NAMESPACE, "weight"): _lin("forward", "pre", "weight", "fprop", "weight"),
    (TE_NAMESPACE, "gradient"): _lin("backward", "pre", "grad_output", "dgrad", "grad_output"),
    (TE_NAMESPACE, "output"): _lin("forward", "post", "output"),
    (TE_NAMESPACE, "dgrad"): _lin("backward", "post", "grad_input"),
    (TE_NAMESPACE, "wgrad"): _lin("backward", "post", "grad_weight"),
    (LOWP_NAMESPACE, "query"): _att("forward", "pre", "query", "qk"),
    (LOWP_NAMESPACE, "key"): _att("forward", "pre", "key", "qk"),
    (LOWP_NAMESPACE, "value"): _att("forward", "pre", "value", "pv"),
    (LOWP_NAMESPACE, "probs"): _att("forward", "pre", "probs", "pv"),
    (LOWP_NAMESPACE, "context"): _att("forward", "post", "context"),
}
NAMESPACES = (TE_NAMESPACE, LOWP_NAMESPACE)


def tensor_names(namespace: str) -> tuple[str, ...]:
    """The tensor names a YAML may list under ``namespace``."""
    return tuple(t for ns, t in SLOTS if ns == namespace)


def slot(namespace: str, tensor_name: str) -> Slot:
    """The Slot of a debug-API tensor (KeyError names the valid names)."""
    try:
        return SLOTS[(namespace, tensor_name)]
    except KeyError:
        raise KeyError(f"{namespace} has no tensor {tensor_name!r}; valid: "
                       f"{', '.join(tensor_names(namespace))}") from None


_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
#: nvdlfw-inspect's infer_and_assign_layer_names names every module "model...." and numbers a
#: transformer layer by megatron's 1-based ``layer_number``
_ASSIGNED_PREFIX = "model"


def layer_index(layer_name: str) -> Optional[int]:
    """The 0-based transformer layer index in a layer name (None when it has none).

    ``decoder.layers.3.mlp.linear_fc1`` (a module path) is layer 3;
    ``model.decoder.layers.4.mlp.linear_fc1`` (named by infer_and_assign_layer_names, which
    uses megatron's 1-based layer_number) is layer 3 too.
    """
    m = _LAYER_NUMBER.search(layer_name)
    if m is None:
        return None
    n = int(m.group(1))
    first = layer_name.split(".", 1)[0]
    return n - 1 if first == _ASSIGNED_PREFIX and n >= 1 else n


#: debug-API tensor name -> (namespace, Slot); the namespaces' names are disjoint, so a feature
#: registered in both knows which tensor it got from the name alone
BY_NAME: dict[str, tuple[str, Slot]] = {t: (ns, s) for (ns, t), s in SLOTS.items()}
assert len(BY_NAME) == len(SLOTS), "a tensor name appears in two namespaces"
