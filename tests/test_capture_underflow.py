"""The pre-quantization warning during emulation: quant.format_loss's judgment in one line, once
per (module, operand, format) and again when its level changes, modules in turn, nothing done
while off."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch

import quant
from quant import format_loss
from tensor_capture import emulation, underflow
from tensor_capture.state import STATE


@pytest.fixture(autouse=True)
def _fresh():
    underflow.reset()
    yield
    underflow.reset()
    STATE.warn_underflow = False


def _operand(scale: float, fmt_seed: int = 0) -> torch.Tensor:
    """A Gaussian operand times ``scale``: tiny scales sit in hifp8's subnormal range and lose bits."""
    return torch.randn(64, 64, generator=torch.Generator().manual_seed(fmt_seed)) * scale


def _check(x, kind, site, it, fmt="hifp8"):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        underflow.check(x, quant.quantize(x, fmt, axis=-1), fmt, -1, kind, site=site,
                        iteration=it)
    return err.getvalue()


def test_the_warning_is_the_format_loss_judgment_in_one_line():
    x = _operand(1e-5)
    loss = format_loss.judge(x, "hifp8", -1)
    assert loss.severity == "high"
    out = _check(x, "linear forward input", "decoder.layers.0.mlp.linear_fc1", 3)
    assert out.startswith("tensor capture: iteration 3, linear forward input "
                          "decoder.layers.0.mlp.linear_fc1: ")
    assert out.count("\n") == 1 and f"loses {loss.deficit_db:.1f} dB" in out
    assert "severity HIGH" in out
    # a Gaussian is what the formats are built for: no warning, whatever sits below min normal
    for fmt in ("mxfp8", "mxfp4", "nvfp4", "fp8_e4m3", "hifp8"):
        underflow.reset()
        assert _check(_operand(1.0), "linear forward weight", "m", 3, fmt) == "", fmt


def test_once_per_module_operand_and_format_and_again_when_the_level_changes():
    x = _operand(1e-5)
    warned = [(it, site) for it in range(6) for site in ("a", "b", "c")
              if _check(x, "linear dgrad weight", site, it)]
    assert warned == [(0, "a"), (1, "b"), (2, "c")]         # modules in turn, each said once
    back = _check(_operand(1.0), "linear dgrad weight", "b", 7)   # b's turn again: recovered
    assert "back within the margin" in back and "was HIGH" in back
    assert _check(x, "linear wgrad input", "a", 7)           # another operand: its own line
    assert "5 pre-quantization warning(s)" in "".join(STATE.stop_notes())


def test_off_does_no_analysis(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("analysed while off")

    monkeypatch.setattr(underflow, "check", boom)
    STATE.warn_underflow = False
    x = _operand(1e-5)
    y = emulation.quantize(x, -1, "mxfp8", kind="linear forward input", site="m", iteration=0)
    assert torch.equal(y, quant.quantize(x, "mxfp8", axis=-1))
    STATE.warn_underflow = True
    with pytest.raises(AssertionError, match="analysed while off"):
        emulation.quantize(x, -1, "mxfp8", kind="linear forward input", site="m", iteration=0)
