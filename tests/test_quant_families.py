"""The scaling families: one object per ``FormatSpec.scaling``, whose Scales every consumer reads.

Independent references: the quantizer's own output (``quant.quantize``) for "scales, then cast"
laid out by hand; float64 arithmetic for the element rounding (exact for these magnitudes).
"""
import math

import pytest
import torch

from quant import FORMATS, quantize
from quant.elemwise import ElemParams, adder_rounds, round_magnitude_, tapered_mantissa_bits
from quant.families import FAMILIES, family_of
from quant.formats import SCALING_IDENTITY
from quant.layout import to_blocks
from quant.quantizer import Quantizer
from quant.scales import Scales, ScalingFamily, cast_scaled


def _tensor(rows=6, cols=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(
        torch.randint(-20, 20, (rows, cols), generator=g).float())
    x[0, 3], x[2, 40], x[4, 7] = float("nan"), float("inf"), 0.0
    return x


def test_every_scaling_has_one_family_object():
    assert {s.scaling for s in FORMATS.values()} <= set(FAMILIES)
    for scaling, family in FAMILIES.items():
        assert isinstance(family, ScalingFamily) and family.scaling == scaling


@pytest.mark.parametrize("name", [n for n, s in FORMATS.items()
                                  if s.scaling != SCALING_IDENTITY])
def test_scales_then_cast_is_the_quantizer(name):
    """family.scales + cast_scaled on the block layout = quantize (the format's defaults)."""
    spec = FORMATS[name]
    family = family_of(spec)
    x = _tensor()
    xs = x.reshape(x.shape[0], -1, spec.block_size) if family.blocked else x
    s = family.scales(xs, spec)
    got = cast_scaled(xs, s, Quantizer.of(name)).reshape(x.shape)
    want = quantize(x, name, backend="torch")
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    if family.blocked:
        assert s.stored.shape == xs.shape[:-1] + (1,)
        assert torch.equal(s.poisoned.squeeze(-1), ~torch.isfinite(xs).all(-1))


def test_mx_scales_are_the_ocp_exponents():
    spec = FORMATS["mxfp8"]
    xb = torch.tensor([[[448.0] + [0.0] * 31, [449.0] + [1.0] * 31, [2.0 ** -130] + [0.0] * 31]])
    s = family_of(spec).scales(xb, spec, "floor")
    # floor(log2 amax) - emax(E4M3) = 8 - 8, 8 - 8, clamped to E8M0's -127
    assert s.stored.reshape(-1).tolist() == [0, 0, -127]
    s = family_of(spec).scales(xb, spec, "rceil")
    assert s.stored.reshape(-1).tolist()[:2] == [0, 1]      # 449 > 448 * 2^0


def test_nvfp4_scales_use_the_format_constants():
    spec = FORMATS["nvfp4"]
    xb = torch.zeros(1, 2, 16)
    xb[0, 0, 0], xb[0, 1, 0] = 6.0 * 448.0, 6.0
    s = family_of(spec).scales(xb, spec)
    # s_t = amax / (6 * 448) = 1; block scales e4m3(amax_b / 6 / s_t) = 448 and 1
    assert s.stored.reshape(-1).tolist() == [448.0, 1.0]
    assert torch.equal(s.decode.reshape(-1), torch.tensor([448.0, 1.0]))


@pytest.mark.parametrize("name", [n for n, s in FORMATS.items()
                                  if adder_rounds(ElemParams.of(s))])
def test_nearest_even_rounding_matches_float64(name):
    """The element cast's nearest-even rounding against RNE in float64, on random float32 bit
    patterns up to far beyond the format's range (past it: only 'beyond max_normal' counts)."""
    p = ElemParams.of(FORMATS[name])
    bits = torch.randint(0, 0x7F800000, (200_000,), generator=torch.Generator().manual_seed(1),
                         dtype=torch.int32)
    a = bits.view(torch.float32)
    got = round_magnitude_(a.clone(), p, "nearest_even")
    e = torch.floor(torch.log2(a.double())).clamp(p.grid_emin, p.grid_emax)
    e = torch.where(a > 0, e, torch.full_like(e, p.grid_emin))
    step = torch.exp2(e - p.mbits)
    want = torch.round(a.double() / step) * step           # exact in float64, ties to even
    inside = a.double() < 2.0 ** (p.grid_emax + 1)
    assert torch.equal(got.double()[inside], want[inside])
    assert bool((got[~inside] > FORMATS[name].max_normal).all())
    assert math.isinf(float(round_magnitude_(torch.tensor([math.inf]), p, "nearest_even")))


def test_tapered_mantissa_bits_follow_hifp8s_exponent_ranges():
    """3 mantissa bits for |E| <= 3, 2 for 4..7, 1 for 8..15, 0 from 16 (the paper's table),
    on every exponent an int32 column may hold near the grid and far beyond it."""
    e = torch.arange(-400, 401, dtype=torch.int32)
    want = [3 if abs(v) <= 3 else 2 if abs(v) <= 7 else 1 if abs(v) <= 15 else 0
            for v in e.tolist()]
    assert tapered_mantissa_bits(e).tolist() == want
    low = FORMATS["hifp8"].grid_emin   # the bits rounding assumes no mantissa bits down there
    assert tapered_mantissa_bits(torch.tensor([low], dtype=torch.int32)).item() == 0


def test_tapered_ties_away_rounding_matches_float64():
    """HiF8's default rounding (ties away, computed on the float's bits) against float64 on
    random float32 bit patterns, every grid value, its midpoints and their neighbours; past
    2^(grid_emax + 1) only 'beyond max_normal' counts; NaN stays NaN, Inf stays beyond."""
    spec = FORMATS["hifp8"]
    p = ElemParams.of(spec)
    bits = torch.randint(0, 0x7F800000, (200_000,), generator=torch.Generator().manual_seed(2),
                         dtype=torch.int32)
    grid = torch.tensor(spec.value_set(), dtype=torch.float64)
    grid = grid[grid >= 0].unique()
    mids = (grid[1:] + grid[:-1]) / 2                      # exact in float64
    edges = torch.cat([grid, mids]).float()
    edges = torch.cat([edges, torch.nextafter(edges, torch.tensor(0.0)),
                       torch.nextafter(edges, torch.tensor(math.inf))])
    a = torch.cat([bits.view(torch.float32), edges, torch.tensor([2.0 ** (p.grid_emin - 1)])])
    got = round_magnitude_(a.clone(), p, "nearest_away")
    e = torch.floor(torch.log2(a.double())).clamp(p.grid_emin, p.grid_emax)
    e = torch.where(a > 0, e, torch.full_like(e, p.grid_emin))
    step = torch.exp2(e - tapered_mantissa_bits(e.to(torch.int32)).double())
    want = torch.floor(a.double() / step + 0.5) * step     # exact in float64: ties go up
    inside = a.double() < 2.0 ** (p.grid_emax + 1)
    assert torch.equal(got.double()[inside], want[inside])
    assert bool((got[~inside] > spec.max_normal).all())
    special = round_magnitude_(torch.tensor([math.inf, math.nan, 0.0]), p, "nearest_away")
    assert math.isinf(special[0]) and math.isnan(special[1]) and special[2] == 0.0


class _BlockAmaxFamily(ScalingFamily):
    """A family written for the test: one float32 scale per block, max_normal / block amax
    (per-tensor current scaling applied to each block)."""

    scaling = "test_block_amax"
    blocked = True
    stored_kind = "float32_scale"

    def scales_from(self, amax_b, tensor_amax, spec, scale_mode):
        scale = torch.where(amax_b > 0, spec.max_normal / amax_b, torch.ones_like(amax_b))
        scale = torch.where(torch.isfinite(scale), scale, torch.ones_like(scale))
        return Scales(encode=scale, decode=1.0 / scale, poisoned=~torch.isfinite(amax_b),
                      stored=scale)

    def quantize(self, x, q, generator=None):
        xb, restore = to_blocks(x.float(), q.axis, q.block)
        s = self.scales(xb, q.spec)
        return restore(cast_scaled(xb, s, q)).to(x.dtype)

    quantize_triton = quantize


def test_a_new_family_is_one_object_and_format_rows(monkeypatch):
    """docs/architecture.md, *A scaling family*: the family object, its FAMILIES row and its
    format row are all it takes; quantize, the Quantizer and the analysis then run it."""
    import dataclasses

    from quant import analyze_quantization
    from quant.quantizer import Quantizer

    family = _BlockAmaxFamily()
    spec = dataclasses.replace(FORMATS["fp8_e4m3"], name="fp8_e4m3_block8",
                               scaling=family.scaling, block_size=8, element="fp8_e4m3")
    monkeypatch.setitem(FAMILIES, family.scaling, family)
    monkeypatch.setitem(FORMATS, spec.name, spec)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 12, generator=g) * torch.exp2(
        torch.randint(-12, 12, (16, 12), generator=g).float())
    x[4, 7] = 0.0
    got = quantize(x, spec.name, axis=0)
    # reference: each block (8 rows of one column) through the per-tensor format (same rule)
    want = torch.empty_like(x)
    for i in range(0, 16, 8):
        for j in range(x.shape[1]):
            want[i:i + 8, j] = quantize(x[i:i + 8, j].contiguous(), "fp8_e4m3_tensor")
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    q = Quantizer.of(spec.name, axis=0)
    assert q.family is family and q.block == 8
    assert torch.equal(q(x).view(torch.int32), got.view(torch.int32))
    report = analyze_quantization(x, q, quantized=got)
    assert report.block_size == 8 and report.total == x.numel()
