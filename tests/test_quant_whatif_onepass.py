"""quant.whatif_onepass gives exactly quant.whatif's numbers of every format, computed together.

The reference is the per-format path (a quantization plus analyze_quantization per format); the
comparison is of the JSON text, so every float must agree to the last bit (NaN and inf included)
and every histogram, count and key order must match.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from quant.formats import FORMATS
from quant.whatif import DEFAULT_WHATIF_FORMATS, whatif, whatif_set
from quant.whatif_onepass import supports, whatif_onepass
from tensor_capture.whatif import sample

#: every format the one pass computes (the default five and the other narrow formats)
ONEPASS_FORMATS = tuple(n for n, s in FORMATS.items() if supports(s))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _nonfinite() -> torch.Tensor:
    x = torch.randn(16, 70, generator=_gen(1))
    x[2, 5], x[7, 40], x[9, 69], x[15, 0] = float("nan"), float("inf"), -float("inf"), 1e30
    return x


def _random_bits() -> torch.Tensor:
    """Every float32 bit pattern is as likely: NaNs, infinities, subnormals, huge values."""
    bits = np.random.default_rng(3).integers(0, 2 ** 32, size=48 * 80, dtype=np.uint32)
    return torch.from_numpy(bits.view(np.float32).copy()).reshape(48, 80)


def _mixed_scales() -> torch.Tensor:
    """Rows spanning 2^-30 .. 2^20: overflow for hifp8 and the element casts, underflow and
    flush-to-zero for the block formats' small elements beside large ones."""
    x = torch.randn(40, 96, generator=_gen(4))
    return x * torch.pow(2.0, torch.linspace(-30, 20, 40)).unsqueeze(1)


CASES = {
    "gaussian_last_axis": (lambda: torch.randn(8, 4, 512, generator=_gen(0)), -1),
    "gaussian_axis0": (lambda: torch.randn(130, 12, generator=_gen(0)), 0),
    "heavy_tailed": (lambda: torch.distributions.StudentT(1.2).sample((64, 96)), -1),
    "odd_shape_last": (lambda: torch.randn(7, 45, generator=_gen(2)), -1),
    "odd_shape_middle": (lambda: torch.randn(3, 45, 5, generator=_gen(2)), 1),
    "short_axis": (lambda: torch.randn(50, 9, generator=_gen(2)), -1),
    "one_dim": (lambda: torch.randn(1000, generator=_gen(5)), 0),
    "scalar": (lambda: torch.tensor(3.5), -1),
    "zeros": (lambda: torch.zeros(4, 64), -1),
    "fp32_subnormals": (lambda: torch.randn(16, 64, generator=_gen(6)) * 1e-41, -1),
    "mixed_scales": (_mixed_scales, -1),
    "nan_inf": (_nonfinite, -1),
    "nan_inf_axis0": (_nonfinite, 0),
    "random_bits": (_random_bits, 0),
    "strided_sample": (lambda: sample(torch.randn(256, 4, 512, generator=_gen(7)), -1, 1 << 14),
                       -1),
    "bf16": (lambda: (torch.randn(16, 70, generator=_gen(8)) * 1e3).bfloat16(), -1),
    "bf16_nan_inf": (lambda: _nonfinite().bfloat16(), 0),
    "fp16_small": (lambda: (torch.randn(16, 70, generator=_gen(9)) * 1e-4).half(), 0),
}


def _text(numbers: dict) -> str:
    return json.dumps(numbers)          # floats as repr: equal text = equal bits


def _reference(x: torch.Tensor, formats, axis: int) -> dict:
    return {f: whatif(x, f, axis) for f in formats}


@pytest.mark.parametrize("case", sorted(CASES))
def test_onepass_equals_each_format_alone(case):
    make, axis = CASES[case]
    x = make()
    got = whatif_onepass(x, ONEPASS_FORMATS, axis)
    assert list(got) == list(ONEPASS_FORMATS)
    ref = _reference(x, ONEPASS_FORMATS, axis)
    for name in ONEPASS_FORMATS:
        assert _text(got[name]) == _text(ref[name]), (case, name)


def test_default_set_is_computed_in_one_pass():
    assert all(supports(FORMATS[f]) for f in DEFAULT_WHATIF_FORMATS)
    assert not supports(FORMATS["bf16"]) and not supports(FORMATS["fp32"])


def test_whatif_set_mixes_one_pass_and_per_format_results():
    """Formats outside the one pass (bf16, fp32, an unknown name) keep the per-format path and
    its error entries; the order of the result is the order asked for."""
    x = torch.randn(6, 40, generator=_gen(10))
    asked = ["bf16", "mxfp8", "no_such_format", "hifp8", "fp32", "nvfp4"]
    got = whatif_set(x, asked, -1)
    assert list(got) == asked
    assert "error" in got["no_such_format"]
    for name in ("bf16", "mxfp8", "hifp8", "fp32", "nvfp4"):
        assert _text(got[name]) == _text(whatif(x, name, -1)), name
    bad = whatif_set(torch.zeros(0, 4), ["mxfp8"], -1)        # empty: the per-format error
    assert "error" in bad["mxfp8"]
    ints = whatif_set(torch.ones(4, 4, dtype=torch.int32), ["mxfp8"], -1)
    assert "error" in ints["mxfp8"]


def test_large_tensors_are_left_to_the_per_format_path():
    """Above max_elements the one pass declines (the formats one by one are faster there);
    whatif_set's numbers are the per-format ones either way."""
    x = torch.randn(20, 64, generator=_gen(12))
    assert whatif_onepass(x, DEFAULT_WHATIF_FORMATS, -1, max_elements=1000) == {}
    assert whatif_onepass(x, DEFAULT_WHATIF_FORMATS, -1, max_elements=1280) != {}
    big = torch.randn(300, 256, generator=_gen(13))                 # above the default
    assert whatif_onepass(big, ["mxfp8"], -1) == {}
    assert _text(whatif_set(big, ["mxfp8"], -1)) == _text(_reference(big, ["mxfp8"], -1))


@pytest.mark.parametrize("rounding", ["nearest_even", "nearest_away"])
def test_cast_rows_is_the_one_format_cast_bit_for_bit(rounding):
    """elemwise.cast_rows_ (every supported format on its own row, mixed roundings) gives the bits
    of cast_elements (saturating) and its overflow mask, on every kind of float32 value (a NaN's
    payload bits may differ: the adder and the multiplier propagate different payloads)."""
    from quant.elemwise import ElemParams, RowParams, cast_elements, cast_rows_, round_magnitude

    params = [ElemParams.of(FORMATS[n]) for n in ONEPASS_FORMATS]
    other = "nearest_away" if rounding == "nearest_even" else "nearest_even"
    roundings = [rounding if i % 2 else other for i in range(len(params))]
    x = torch.stack([_random_bits() * 2.0 ** (i % 7 - 3) for i in range(len(params))])
    r, over = cast_rows_(x.abs(), x, RowParams.stack(params, roundings, x.dim(), x.device))
    for i, (p, mode) in enumerate(zip(params, roundings)):
        want = cast_elements(x[i].clone(), p, mode, saturate=True)
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(r[i]), nan), ONEPASS_FORMATS[i]
        assert torch.equal(r[i][~nan].view(torch.int32), want[~nan].view(torch.int32)), \
            ONEPASS_FORMATS[i]
        assert torch.equal(over[i], round_magnitude(x[i].abs(), p, mode) > p.max_normal)
