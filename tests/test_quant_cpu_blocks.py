"""The C quantizers (quant.cpu_blocks: MX and NVFP4 blocks, element casts) equal the torch
kernels bit for bit, and stand aside without a word where there is no compiler (results the
same, only slower)."""
from __future__ import annotations

import ctypes

import pytest
import torch

import quant
from quant import accel, cbuild, cpu_blocks
from quant.formats import FORMATS, SCALE_MODES, SCALING_MX, SCALING_NONE, SCALING_NVFP4
from quant.quantizer import Quantizer

MX_FORMATS = [n for n, s in FORMATS.items() if s.scaling == SCALING_MX]
CONFIGS = ([(n, m, sat) for n in MX_FORMATS for m in SCALE_MODES for sat in (True, False)]
           + [(n, "floor", sat) for n, s in FORMATS.items() if s.scaling == SCALING_NVFP4
              for sat in (True, False)])

#: element formats (no scale) whose default rounding a C cast takes (cpu_blocks.cast_code)
ELEMENT_FORMATS = [n for n, s in FORMATS.items() if s.scaling == SCALING_NONE
                   and cpu_blocks.cast_code(Quantizer.of(n)) is not None]

pytestmark = pytest.mark.skipif(cbuild.compiler() is None, reason="no C compiler here")


def _inputs() -> dict:
    """Every float32 bit pattern class: random bits (NaN payloads, Inf, subnormals, huge),
    the probe's ties and special blocks, normal data; rows of whole and partial blocks."""
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (48, 256), generator=g, dtype=torch.int64)
    ties = cpu_blocks._probe_tensor(40, 5 * 32 + 9)
    normal = torch.randn(3, 8, 200, generator=g) * 7
    normal[0, 1, :16] = 0.0
    return {"bits": bits.to(torch.int32).view(torch.float32), "ties": ties, "normal": normal,
            "vector": torch.randn(1000, generator=g), "tiny": torch.randn(64, 48, generator=g)
            * 2.0 ** -135}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, NaN included (a poisoned block's NaN is masked_fill's)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("name,mode,saturate", CONFIGS)
def test_c_kernel_equals_the_torch_kernels(name, mode, saturate, monkeypatch):
    monkeypatch.setenv("QUANT_COMPILE", "0")
    data = _inputs()
    want = {k: quant.quantize(x, name, scale_mode=mode, saturate=saturate)
            for k, x in data.items()}
    monkeypatch.setenv("QUANT_COMPILE", "1")
    calls = []
    real = cpu_blocks.kernels_for
    monkeypatch.setattr(cpu_blocks, "kernels_for",
                        lambda x, q: calls.append(1) or real(x, q))
    for k, x in data.items():
        got = quant.quantize(x, name, scale_mode=mode, saturate=saturate)
        assert _same(got, want[k]), (name, mode, saturate, k)
    assert cpu_blocks.CPU_BLOCKS.lib is not None, cpu_blocks.CPU_BLOCKS.error
    assert len(calls) == len(data)


@pytest.mark.parametrize("name", ELEMENT_FORMATS)
@pytest.mark.parametrize("saturate", [True, False])
def test_c_element_casts_equal_the_torch_kernel(name, saturate, monkeypatch):
    assert {"hifp8", "fp8_e4m3", "fp8_e5m2"} <= set(ELEMENT_FORMATS)
    monkeypatch.setenv("QUANT_COMPILE", "0")
    data = _inputs()
    want = {k: quant.quantize(x, name, saturate=saturate) for k, x in data.items()}
    monkeypatch.setenv("QUANT_COMPILE", "1")
    calls = []
    real = cpu_blocks.elem_cast
    monkeypatch.setattr(cpu_blocks, "elem_cast", lambda *a: calls.append(1) or real(*a))
    for k, x in data.items():
        assert _same(quant.quantize(x, name, saturate=saturate), want[k]), (name, saturate, k)
    assert len(calls) == len(data)          # every input went through the C cast


def test_the_probe_finds_a_flipped_bit():
    """The probe that lets the kernels take over fails on one wrong value."""
    x = torch.randn(64, 64)
    quant.quantize(x, "mxfp8")   # built (compile mode auto: at the threshold or not, built on use)
    lib = cpu_blocks.library(lambda lib: cpu_blocks.probe_mismatch(lib, Quantizer))
    if lib is None:
        pytest.skip(f"the kernels are not in use here: {cpu_blocks.CPU_BLOCKS.error!r}")
    assert cpu_blocks.probe_mismatch(lib, Quantizer) == ""

    class OneBitOff:
        lowp_nvfp4_rows = lib.lowp_nvfp4_rows
        lowp_finite_amax = lib.lowp_finite_amax
        lowp_elem = lib.lowp_elem

        @staticmethod
        def lowp_mx_rows(xp, yp, *args):
            lib.lowp_mx_rows(xp, yp, *args)
            first = ctypes.c_int32.from_address(yp + 4 * 40)   # a value of row 0's 2nd block
            first.value ^= 1

    assert cpu_blocks.probe_mismatch(OneBitOff(), Quantizer).startswith("mx")

    class ElementBitOff(OneBitOff):
        lowp_mx_rows = lib.lowp_mx_rows

        @staticmethod
        def lowp_elem(xp, yp, n, code, *args):
            lib.lowp_elem(xp, yp, n, code, *args)
            if code == 1:                      # the tapered ties-away cast (HiF8)
                ctypes.c_int32.from_address(yp + 4 * 7).value ^= 1

    assert cpu_blocks.probe_mismatch(ElementBitOff(), Quantizer).startswith("hifp8")


def test_without_a_compiler_the_torch_path_runs_silently(monkeypatch, capsys):
    monkeypatch.setenv("QUANT_COMPILE", "0")
    x = torch.randn(96, 128)
    want = quant.quantize(x, "nvfp4")
    monkeypatch.setenv("QUANT_COMPILE", "1")
    monkeypatch.setattr(cpu_blocks, "CPU_BLOCKS", cpu_blocks.CpuBlocksState())
    monkeypatch.setattr(cbuild, "compiler", lambda: None)
    monkeypatch.setattr(accel.COMPILE, "broken", RuntimeError("no Inductor in this test"))
    got = quant.quantize(x, "nvfp4")
    assert _same(got, want)
    assert cpu_blocks.CPU_BLOCKS.lib is None and cpu_blocks.CPU_BLOCKS.tried
    assert capsys.readouterr().err == ""


def test_a_probe_that_disagrees_keeps_the_torch_path(monkeypatch, capsys):
    monkeypatch.setenv("QUANT_COMPILE", "1")
    monkeypatch.setattr(cpu_blocks, "CPU_BLOCKS", cpu_blocks.CpuBlocksState())
    monkeypatch.setattr(cpu_blocks, "probe_mismatch", lambda lib, quantizer: "mxfp8, planted")
    monkeypatch.setattr(accel.COMPILE, "broken", RuntimeError("no Inductor in this test"))
    x = torch.randn(32, 64)
    got = quant.quantize(x, "mxfp8")
    monkeypatch.setenv("QUANT_COMPILE", "0")
    assert _same(got, quant.quantize(x, "mxfp8"))
    assert cpu_blocks.CPU_BLOCKS.lib is None
    err = capsys.readouterr().err
    assert "differs from the torch kernels (mxfp8, planted)" in err and err.count("\n") == 1


def test_what_the_c_kernels_do_not_take_goes_to_the_torch_kernels():
    q = Quantizer.of("mxfp8")
    x = torch.randn(64, 64)
    assert cpu_blocks.usable(x, q)
    assert not cpu_blocks.usable(x.bfloat16(), q)
    assert not cpu_blocks.usable(x.t(), q)
    assert not cpu_blocks.usable(x, q.along(0))
    assert not cpu_blocks.usable(x, Quantizer.of("mxfp8", rounding="stochastic"))
    assert not cpu_blocks.usable(torch.empty(0, 64), q) and not cpu_blocks.usable(x[0, 0], q)
    assert not cpu_blocks.usable(x, q.along(3)) and not cpu_blocks.usable(x, q.along(-3))
    hif8 = Quantizer.of("hifp8")
    assert cpu_blocks.usable(x, hif8) and cpu_blocks.usable(x, hif8.along(0))   # no axis
    assert not cpu_blocks.usable(x.t(), hif8) and not cpu_blocks.usable(x.half(), hif8)
    for rounding in ("stochastic", "nearest_even", "hybrid"):
        assert not cpu_blocks.usable(x, Quantizer.of("hifp8", rounding=rounding)), rounding
    assert not cpu_blocks.usable(x, Quantizer.of("fp8_e4m3", rounding="nearest_away"))
    assert not cpu_blocks.usable(x, Quantizer.of("bf16"))     # the adder cannot round it


@pytest.mark.parametrize("axis", [2, -3])
def test_an_axis_out_of_range_is_still_an_error(axis, monkeypatch):
    monkeypatch.setenv("QUANT_COMPILE", "1")
    with pytest.raises(ValueError, match="out of range"):
        quant.quantize(torch.randn(8, 64), "mxfp8", axis=axis)


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_split_across_threads_gives_the_same_bits(name, monkeypatch):
    """torch's intra-op threads share the rows (and NVFP4's amax pass the elements); the
    parts' results are those of one pass."""
    monkeypatch.setenv("QUANT_COMPILE", "0")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3 * 32 + 5, generator=g) * 10
    x[6, 3] = 1e4                 # the tensor amax in the last part: it sets NVFP4's scale
    want = quant.quantize(x, name)
    monkeypatch.setenv("QUANT_COMPILE", "1")
    monkeypatch.setattr(cpu_blocks, "PARALLEL_MIN_NUMEL", 1)
    monkeypatch.setattr(cpu_blocks, "CPU_BLOCKS", cpu_blocks.CpuBlocksState())
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        got = quant.quantize(x, name)
    finally:
        torch.set_num_threads(threads)
    assert cpu_blocks.CPU_BLOCKS.lib is not None and cpu_blocks.CPU_BLOCKS.pool_size == 2
    assert _same(got, want)


def test_a_forked_child_gets_threads_of_its_own(monkeypatch):
    """A pool made before a fork has no threads in the child: the child makes its own (else
    its first split call would wait forever)."""
    import multiprocessing

    monkeypatch.setenv("QUANT_COMPILE", "1")
    monkeypatch.setattr(cpu_blocks, "PARALLEL_MIN_NUMEL", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(8, 64)
        want = quant.quantize(x, "mxfp8")
        assert cpu_blocks.CPU_BLOCKS.pool is not None
        with multiprocessing.get_context("fork").Pool(1) as pool:
            got = pool.apply_async(_quantize_in_child, (x,)).get(timeout=60)
    finally:
        torch.set_num_threads(threads)
    assert _same(got, want)


def _quantize_in_child(x: torch.Tensor) -> torch.Tensor:
    torch.set_num_threads(2)
    return quant.quantize(x, "mxfp8")
