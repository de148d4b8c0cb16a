"""The Triton kernels give the torch backend's results bit for bit.

On a CPU machine they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before anything imports them); on a GPU machine the same tests run the compiled kernels on CUDA
tensors. Every format x rounding mode x dtype, over shapes with odd lengths, lengths that are
not multiples of the block, other axes and non-contiguous views, and values that hit the edges:
NaN, +-Inf, +-0, huge, float32 subnormals and exact ties of each format's grid.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import quant
from quant import backends
from quant.formats import FORMATS, HIF8_ROUNDING_MODES, ROUNDING_MODES, SCALE_MODES
from quant.optional import OptionalModule

# numpy warns where the interpreter casts an overflowing value (to Inf, as torch does)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

ON_GPU = torch.cuda.is_available() and not backends.triton_interpreting()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
QUANTIZED = [n for n, s in FORMATS.items() if not s.is_identity]


def _values(spec, n: int, seed: int) -> torch.Tensor:
    """Random magnitudes over 2^-40..2^40 with specials and the format's ties mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3e38, -3e38,
                            1e-40, -1e-42, 2.0 ** -126, 1.0, -1.0])
    picks = [special]
    if spec.bits <= 8:
        v = torch.tensor(spec.value_set(), dtype=torch.float32)
        mids = (v[:-1] + v[1:]) / 2                      # exact ties of the element grid
        picks += [mids, -mids, v]
    extra = torch.cat(picks)
    pos = torch.randperm(n, generator=g)[: min(n, extra.numel())]
    x[pos] = extra[: pos.numel()]
    return x


def _shapes(x_flat: torch.Tensor):
    """(tensor, axis) cases: 1-D odd, 2-D both axes, 3-D middle axis, non-contiguous, 0-dim."""
    yield x_flat[:77], -1
    yield x_flat[:3 * 70].reshape(3, 70), -1
    yield x_flat[:70 * 3].reshape(70, 3), 0
    yield x_flat[:2 * 37 * 5].reshape(2, 37, 5), 1
    yield x_flat[:40 * 6].reshape(40, 6).t(), -1          # non-contiguous view
    yield x_flat[0].clone(), -1                              # 0-dim


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    na, nb = torch.isnan(a), torch.isnan(b)
    assert torch.equal(na, nb), f"{what}: NaN positions differ"
    ia = a[~na].view(torch.int16 if a.element_size() == 2 else torch.int32)
    ib = b[~nb].view(ia.dtype)
    bad = (ia != ib).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.numel()} of {ia.numel()} values differ, e.g. "
                              f"{a[~na][bad[0]].tolist()} vs {b[~nb][bad[0]].tolist()}")


def _roundings(name: str):
    return HIF8_ROUNDING_MODES if FORMATS[name].tapered else ROUNDING_MODES


CASES = [(n, r) for n in QUANTIZED for r in _roundings(n)]


@pytest.mark.parametrize("name,rounding", CASES, ids=[f"{n}-{r}" for n, r in CASES])
def test_triton_matches_torch_bit_for_bit(name, rounding):
    spec = FORMATS[name]
    base = _values(spec, 512, seed=len(name) * 31 + len(rounding))
    for dtype in DTYPES:
        for x, axis in _shapes(base.to(dtype)):
            x = x.to(DEVICE)
            kw = dict(axis=axis, rounding=rounding)
            gen = {}
            if rounding in ("stochastic", "hybrid"):
                gen = dict(t=torch.Generator(DEVICE).manual_seed(7),
                           c=torch.Generator(DEVICE).manual_seed(7))
            ref = quant.quantize(x, name, backend="torch", generator=gen.get("c"), **kw)
            got = quant.quantize(x, name, backend="triton", generator=gen.get("t"), **kw)
            _assert_same_bits(got, ref, f"{name} {rounding} {dtype} shape {tuple(x.shape)} "
                                        f"axis {axis}")


BLOCK_OPTIONS = [(n, mode, bs, sat) for n, s in FORMATS.items() if s.is_block
                 for mode in (SCALE_MODES if s.scaling == "mx" else ("floor",))
                 for bs in (None, 7, 16) for sat in (True, False)]


@pytest.mark.parametrize("name,scale_mode,block_size,saturate", BLOCK_OPTIONS)
def test_triton_block_options(name, scale_mode, block_size, saturate):
    """Scale modes, block sizes that are not powers of two, saturate=False, rows whose blocks
    span 2^+-60 (scale clamping), on a 2-D tensor blocked along both axes."""
    g = torch.Generator().manual_seed(3)
    rows = torch.exp2(torch.randint(-60, 60, (45, 1), generator=g).float())
    x = (torch.randn(45, 50, generator=g) * rows)
    x[3, 4] = float("nan")
    x[7, 9] = float("inf")
    x[10] = 0.0
    x = x.to(DEVICE)
    for axis in (-1, 0):
        kw = dict(axis=axis, scale_mode=scale_mode, block_size=block_size, saturate=saturate)
        _assert_same_bits(quant.quantize(x, name, backend="triton", **kw),
                          quant.quantize(x, name, backend="torch", **kw), f"{name} {kw}")


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "hifp8", "fp8_e4m3_tensor",
                                  "fp6_e3m2", "int8"])
def test_triton_unsaturated_overflow_encoding(name):
    x = torch.tensor([1e6, -1e6, 500.0, float("inf"), -float("inf"), 7.0], device=DEVICE)
    _assert_same_bits(quant.quantize(x, name, backend="triton", saturate=False),
                      quant.quantize(x, name, backend="torch", saturate=False), name)


def test_empty_and_identity():
    for name in ("mxfp8", "fp8_e4m3", "fp32", "nvfp4"):
        e = torch.empty(0, 4, device=DEVICE)
        assert quant.quantize(e, name, backend="triton").shape == (0, 4)
    x = torch.randn(5, device=DEVICE)
    assert torch.equal(quant.quantize(x, "fp32", backend="triton"), x)


def test_auto_backend_is_torch_on_cpu_tensors():
    assert backends.resolve_backend("auto", torch.zeros(2)) == "torch"


def test_unknown_backend_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown quantization backend 'cuda'.*auto, torch, "
                                         r"triton"):
        quant.quantize(torch.zeros(3), "mxfp8", backend="cuda")


def test_triton_missing_names_the_fix(monkeypatch):
    def load():        # the import fails as the kernels' does where Triton is absent
        import no_such_triton  # noqa: F401

    monkeypatch.setattr(backends, "TRITON_KERNELS", OptionalModule(load))
    with pytest.raises(RuntimeError, match=r"pip install triton.*backend='torch'"):
        quant.quantize(torch.zeros(3), "mxfp8", backend="triton")
    # auto quietly stays on torch
    assert quant.quantize(torch.ones(3), "mxfp8").tolist() == [1.0, 1.0, 1.0]


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="runs on CUDA tensors.*TRITON_INTERPRET=1"):
        quant.quantize(torch.zeros(3), "mxfp8", backend="triton")


def test_stochastic_seeds_map_between_backends():
    """Same generator state -> same bits on both backends; another seed -> other bits."""
    x = (torch.randn(64, 96, generator=torch.Generator().manual_seed(1)) * 1e-2).to(DEVICE)
    out = {}
    for backend in ("torch", "triton"):
        for seed in (5, 6):
            g = torch.Generator(DEVICE).manual_seed(seed)
            out[backend, seed] = quant.quantize(x, "mxfp4", rounding="stochastic", generator=g,
                                                backend=backend)
    assert torch.equal(out["torch", 5], out["triton", 5])
    assert torch.equal(out["torch", 6], out["triton", 6])
    assert not torch.equal(out["triton", 5], out["triton", 6])
