"""The torch.compile path gives bit-identical results to the eager kernels.

Compiles a handful of kernels once (static shapes); skipped only where torch.compile cannot work
on this machine (then quantize itself falls back to eager, which the other tests cover).
"""
import numpy as np
import pytest
import torch

import quant
from quant import accel

CASES = [("fp8_e4m3", {}), ("hifp8", {}), ("mxfp8", {"scale_mode": "rceil"}),
         ("nvfp4", {}), ("fp8_e5m2_tensor", {})]


def _inputs():
    g = np.random.default_rng(0)
    bits = g.integers(0, 2 ** 32, size=64 * 1024, dtype=np.uint32).view(np.float32)
    x = torch.from_numpy(bits.copy()).reshape(64, 1024)
    normal = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))
    normal[3, 7] = float("inf")
    normal[5, 100] = float("nan")
    return {"bits": x, "normal": normal * 3}


@pytest.mark.parametrize("name,kw", CASES)
def test_compiled_equals_eager(name, kw, monkeypatch):
    monkeypatch.setenv("QUANT_COMPILE", "0")
    data = _inputs()
    eager = {k: quant.quantize(v, name, **kw) for k, v in data.items()}
    monkeypatch.setenv("QUANT_COMPILE", "1")
    comp = {k: quant.quantize(v, name, **kw) for k, v in data.items()}
    if accel.compile_error() is not None:
        pytest.skip(f"torch.compile unavailable here: {accel.compile_error()!r}")
    for k in data:
        a, b = eager[k], comp[k]
        assert torch.equal(a.isnan(), b.isnan()), k
        m = ~a.isnan()
        assert torch.equal(a[m].view(torch.int32), b[m].view(torch.int32)), k


def test_auto_mode_threshold(monkeypatch):
    monkeypatch.setenv("QUANT_COMPILE", "auto")
    monkeypatch.setenv("QUANT_COMPILE_MIN_NUMEL", "1000")
    if accel.compile_error() is None:
        assert accel.should_compile(1000) and not accel.should_compile(999)
        assert not accel.should_compile(10 ** 9, "cuda")  # auto: CPU only (CUDA unmeasured)
    monkeypatch.setenv("QUANT_COMPILE", "0")
    assert not accel.should_compile(10 ** 9)
