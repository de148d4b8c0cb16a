"""The underflow warning during emulation: seed text via quant, once per kind per iteration,
modules in turn, nothing done while off."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch

import quant
from tensor_capture import emulation, underflow
from tensor_capture.state import STATE


@pytest.fixture(autouse=True)
def _fresh():
    underflow.reset()
    yield
    underflow.reset()
    STATE.warn_underflow = False


def _operand(tiny_fraction: float) -> torch.Tensor:
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    n = int(64 * tiny_fraction)
    x[:, :n] *= 1e-9                  # far below the block scale: flushed to zero by mxfp8
    return x


def _check(x, kind, site, it):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        underflow.check(x, quant.quantize(x, "mxfp8", axis=-1), "mxfp8", -1, kind, site, it)
    return err.getvalue()


def test_warning_is_quants_own_text_when_flush_to_zero_passes_0_1_percent():
    x = _operand(0.25)
    report = quant.analyze_quantization(x, "mxfp8", axis=-1)
    out = _check(x, "linear forward input", "decoder.layers.0.mlp.linear_fc1", 3)
    assert out.startswith("tensor capture: iteration 3, linear forward input "
                          "decoder.layers.0.mlp.linear_fc1:\n")
    assert report.warning_message() in out
    assert _check(_operand(0.0), "linear forward weight", "m", 3) == ""   # nothing flushed


def test_once_per_kind_per_iteration_modules_in_turn():
    x = _operand(0.25)
    warned = [(it, site) for it in range(4) for site in ("a", "b", "c")
              if _check(x, "linear dgrad weight", site, it)]
    assert warned == [(0, "a"), (1, "b"), (2, "c"), (3, "a")]
    # another kind has its own turn in the same iteration
    assert _check(x, "linear wgrad input", "a", 3)


def test_off_does_no_analysis(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("analysed while off")

    monkeypatch.setattr(underflow, "check", boom)
    STATE.warn_underflow = False
    x = _operand(0.25)
    y = emulation.quantize(x, -1, "mxfp8", kind="linear forward input", site="m", iteration=0)
    assert torch.equal(y, quant.quantize(x, "mxfp8", axis=-1))
    STATE.warn_underflow = True
    with pytest.raises(AssertionError, match="analysed while off"):
        emulation.quantize(x, -1, "mxfp8", kind="linear forward input", site="m", iteration=0)
