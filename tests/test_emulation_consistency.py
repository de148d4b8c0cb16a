"""One GEMM-operand plan: the training emulation and precision-diff compute the same numbers.

The fast tests check quant.gemm_plan on plain torch; the megatron-tier test runs a real
megatron-core ColumnParallelLinear in a patched copy (tests/gemm_plan_helpers.py) through the
training emulation and through precision-diff's, and requires identical outputs and input,
weight and bias gradients for every format.
"""
from __future__ import annotations

import pytest
import torch

import quant
from quant import gemm_plan
from training_profiler.lowp_emulation import emulate_linears

TOKENS, IN, OUT = 128, 64, 96     # distinct sizes: an axis is named by its size below


def _operands(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS // 2, 2, IN, generator=gen) * torch.logspace(-2, 1, IN)
    w = torch.randn(OUT, IN, generator=gen) * 0.05
    b = torch.randn(OUT, generator=gen) * 0.1
    dy = torch.randn(TOKENS // 2, 2, OUT, generator=gen) * torch.logspace(1, -2, OUT) * 1e-2
    return x, w, b, dy


def test_every_planned_axis_is_its_gemms_reduction_dimension():
    x, w, _, dy = _operands()
    g2, x2 = gemm_plan.wgrad_2d(dy, x)
    shapes = {("forward", "input"): (x.shape, IN), ("forward", "weight"): (w.shape, IN),
              ("dgrad", "grad_output"): (dy.shape, OUT), ("dgrad", "weight"): (w.shape, OUT),
              ("wgrad", "grad_output"): (g2.shape, TOKENS), ("wgrad", "input"): (x2.shape, TOKENS)}
    for (gemm, operand), (shape, reduced) in shapes.items():
        assert shape[gemm_plan.axis(gemm, operand)] == reduced, (gemm, operand)
    # attention, Megatron's layouts: q, k [s, b, heads, d], v [sk, b, groups, d], P [b, h, sq, sk]
    q, v, probs = (16, 2, 4, 8), (24, 2, 2, 8), (2, 4, 16, 24)
    assert q[gemm_plan.axis("qk", "query")] == q[gemm_plan.axis("qk", "key")] == 8
    assert v[gemm_plan.axis("pv", "value")] == probs[gemm_plan.axis("pv", "probs")] == 24
    assert [p.operand for p in gemm_plan.GEMM_OPERANDS["wgrad"]] == ["grad_output", "input"]
    with pytest.raises(KeyError, match="known"):
        gemm_plan.axis("wgrad", "weight")


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_emulated_linear_quantizes_each_gemm_along_its_reduction_axis(fmt):
    x, w, b, dy = _operands()
    x, w, b = (t.clone().requires_grad_(True) for t in (x, w, b))
    y = gemm_plan.emulated_linear(x, w, b, fmt)
    y.backward(dy)
    qz = lambda t, axis: quant.quantize(t.detach(), fmt, axis=axis)  # noqa: E731
    g2, x2 = dy.reshape(TOKENS, OUT), x.detach().reshape(TOKENS, IN)
    assert torch.equal(y, torch.matmul(qz(x, -1), qz(w, -1).t()) + b)
    assert torch.equal(x.grad, qz(dy, -1).matmul(qz(w, 0)))
    assert torch.equal(w.grad, qz(g2, 0).t().matmul(qz(x2, 0)))
    assert torch.equal(b.grad, g2.sum(0))
    # what precision-diff used to do (weight and gradient blocked along the last axis, reused
    # by both backward GEMMs) is a different format on these operands
    assert not torch.equal(x.grad, qz(dy, -1).matmul(qz(w, -1)))
    assert not torch.equal(w.grad, qz(g2, -1).t().matmul(qz(x2, -1)))


def test_grad_fmt_fp32_leaves_output_gradients_unquantized():
    x, w, b, dy = _operands(1)
    x, w = x.requires_grad_(True), w.requires_grad_(True)
    gemm_plan.EmulatedLinear.apply(x, w, None, gemm_plan.format_quantizer("mxfp8", "fp32")).backward(dy)
    assert torch.equal(x.grad, dy.matmul(quant.quantize(w.detach(), "mxfp8", axis=0)))


def test_precision_diff_refuses_linears_it_cannot_emulate_like_training():
    class TELinear(torch.nn.Module):   # Transformer Engine's class name: GEMMs inside TE
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4, 4))

    class OwnForward(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    for model, match in ((torch.nn.Sequential(TELinear()), "Transformer Engine"),
                         (torch.nn.Sequential(OwnForward(4, 4)), "overrides nn.Linear.forward")):
        with pytest.raises(ValueError, match=match):
            with emulate_linears(model, "mxfp8"):
                pass
        assert not any("forward" in m.__dict__ for m in model.modules())


# -- training emulation vs precision-diff on a real megatron-core ColumnParallelLinear ------------
@pytest.fixture(scope="module")
def both_paths(tmp_path_factory):
    from gemm_plan_helpers import run_consistency

    from tensor_capture.patcher import prepare_patched_megatron

    patched = str(prepare_patched_megatron(tmp_path_factory.mktemp("patched")))
    return run_consistency(patched, tmp_path_factory.mktemp("consistency"))


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_training_and_precision_diff_emulate_a_megatron_linear_identically(both_paths):
    from gemm_plan_helpers import FORMATS

    r = both_paths
    assert r["patched"], r["layers_file"]           # the training path ran the patched layers.py
    off = r["off"]
    for fmt in FORMATS:
        train, diff, diff_torch = r[f"training_{fmt}"], r[f"diff_megatron_{fmt}"], r[f"diff_torch_{fmt}"]
        assert r[f"diff_megatron_{fmt}_names"] == [""]
        for k in ("out", "dx", "dw", "db"):
            assert torch.equal(train[k], diff[k]), (fmt, k)
            assert torch.equal(train[k], diff_torch[k]), (fmt, k)
        for k in ("out", "dx", "dw"):
            assert not torch.equal(train[k], off[k]), (fmt, k)   # the format really acted
    for k in ("out", "dx", "dw", "db"):   # leaving the block restores the unemulated layers
        assert torch.equal(r["restored"][k], off[k]) and torch.equal(r["restored_torch"][k], off[k])
    assert r["instance_attrs"] == []
