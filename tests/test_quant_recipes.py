"""quant.recipes: each Transformer Engine recipe against a hand re-derivation of TE's arithmetic.

The derivations below are written element by element with numpy float32 scalars (every
operation rounds once, as a CUDA float op does), torch's own float8 casts (clamped first: the
kernels' casts saturate) and an explicit E2M1 threshold table; none calls quant.role_quantizers.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import quant
from quant import recipes
from quant.gemm_plan import axis as plan_axis

F32 = np.float32
TE_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]   # TE get_wgrad_sign_vector


# ---- independent element casts -------------------------------------------------------------------
def e4m3(v: float) -> float:
    """Saturating RNE cast to E4M3 (NaN stays NaN)."""
    if math.isnan(v):
        return v
    return float(torch.tensor(max(-448.0, min(448.0, v))).to(torch.float8_e4m3fn).float())


def e5m2(v: float) -> float:
    if math.isnan(v):
        return v
    return float(torch.tensor(max(-57344.0, min(57344.0, v))).to(torch.float8_e5m2).float())


_E2M1_UP = [(0.25, 0.0, False), (0.75, 0.5, True), (1.25, 1.0, False), (1.75, 1.5, True),
            (2.5, 2.0, False), (3.5, 3.0, True), (5.0, 4.0, False)]


def e2m1(v: float) -> float:
    """RNE to {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating: the midpoints go to the even code
    (0, 1, 2, 4), i.e. a midpoint belongs to the lower value when that value is even."""
    a = abs(v)
    for mid, below, strict in _E2M1_UP:
        if a < mid or (a == mid and not strict):
            return math.copysign(below, v)
    return math.copysign(6.0, v)


def nan_max_abs(vals) -> float:
    return max([abs(float(v)) for v in vals if not math.isnan(float(v))], default=0.0)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality with NaN == NaN."""
    return bool(torch.equal(torch.isnan(a), torch.isnan(b))
                and torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)))


def as_t(rows) -> torch.Tensor:
    return torch.tensor(np.array(rows, dtype=np.float32))


# ---- per-tensor FP8 (current scaling) -------------------------------------------------------------
def ref_current(x: np.ndarray, fp8_max: float, cast) -> np.ndarray:
    amax = F32(nan_max_abs(x.ravel()))
    if amax == 0 or math.isinf(amax):
        scale = F32(1)
    else:
        scale = F32(F32(fp8_max) / amax)
        if math.isinf(scale):
            scale = F32(np.finfo(np.float32).max)
    inv = F32(F32(1) / scale)
    return np.array([[F32(cast(float(F32(v * scale))) * inv) for v in row] for row in x], F32)


@pytest.mark.parametrize("tensor,gemm,fp8_max,cast", [("input", "fprop", 448.0, e4m3),
                                                      ("weight", "dgrad", 448.0, e4m3),
                                                      ("grad_output", "wgrad", 57344.0, e5m2)])
def test_tensorwise_matches_the_derivation(tensor, gemm, fp8_max, cast):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(8, 32, generator=g) * torch.logspace(-4, 4, 32)).float()
    x[0, 0] = 3 * 2.0 ** 7                  # an exact E4M3 value among the random ones
    x[1, :4] = torch.tensor([0.0, -0.0, float("nan"), 1e-30])
    got = recipes.quantize_operand(x, "te_fp8_tensorwise", tensor, gemm)
    assert same(got, as_t(ref_current(x.numpy(), fp8_max, cast)))


def test_tensorwise_boundaries_amax_448_zeros_inf():
    x = torch.tensor([[448.0 * 4, 1.0, -0.75, 0.0]] * 4)       # amax 448 * 2^2: scale exactly 1/4
    got = recipes.quantize_operand(x, "te_fp8_tensorwise", "input", "fprop")
    assert torch.equal(got, x)                                  # all on the E4M3 grid times 4
    assert torch.equal(recipes.quantize_operand(torch.zeros(4, 4), "te_fp8_tensorwise", "input",
                                                "fprop"), torch.zeros(4, 4))
    y = torch.tensor([[float("inf"), 500.0, 3.3, -1e-3]])
    got = recipes.quantize_operand(y, "te_fp8_tensorwise", "input", "fprop")
    # Inf amax: scale 1 (TE's compute_scale_from_amax); Inf and 500 saturate to 448
    assert got.tolist()[0] == [448.0, 448.0, e4m3(3.3), e4m3(-1e-3)]


# ---- delayed scaling ----------------------------------------------------------------------------
def test_delayed_uses_the_previous_steps_amax_and_needs_state():
    x0 = torch.full((4, 4), 2.0)
    x1 = torch.full((4, 4), 3.0)
    with pytest.raises(ValueError, match="DelayedScalingState"):
        recipes.quantize_operand(x0, "te_fp8_delayed", "input", "fprop")
    st = recipes.DelayedScalingState()
    y0 = recipes.quantize_operand(x0, "te_fp8_delayed", "input", "fprop", state=st, key="fc1")
    assert torch.equal(y0, x0)                        # step 0: scale 1, 2.0 is on the grid
    st.update()
    scale = F32(F32(448) / F32(2.0))                  # from step 0's amax (history 1, most_recent)
    assert float(st.scale(("fc1", "input"))) == scale
    y1 = recipes.quantize_operand(x1, "te_fp8_delayed", "input", "fprop", state=st, key="fc1")
    want = F32(e4m3(float(F32(3.0 * scale))) * F32(F32(1) / scale))
    assert torch.equal(y1, torch.full((4, 4), float(want)))
    # the step-1 amax overflows the step-0 scale: saturation, as TE's delayed scaling does
    big = recipes.quantize_operand(torch.full((1, 4), 5.0), "te_fp8_delayed", "input", "fprop",
                                   state=recipes.DelayedScalingState(), key="a")
    assert torch.equal(big, torch.full((1, 4), 5.0))


def test_delayed_max_history_and_margin():
    st = recipes.DelayedScalingState(history_len=3, algo="max", margin=1)
    for amax in (8.0, 2.0, 1.0):
        recipes.quantize_operand(torch.full((2, 2), amax), "te_fp8_delayed", "grad_output",
                                 "dgrad", state=st, key="k")
        st.update()
    # max over the last 3 amaxes (8) with margin 1: (57344 / 2) / 8
    assert float(st.scale(("k", "grad_output"))) == 57344.0 / 2 / 8
    recipes.quantize_operand(torch.full((2, 2), 0.5), "te_fp8_delayed", "grad_output", "dgrad",
                             state=st, key="k")
    st.update()                                       # 8 has left the 3-entry window
    assert float(st.scale(("k", "grad_output"))) == 57344.0 / 2 / 2


# ---- FP8 block scaling -------------------------------------------------------------------------------
def pow2_scale(amax: float) -> float:
    if amax == 0 or math.isinf(amax):
        return 1.0
    s = F32(F32(448) / F32(amax))
    if math.isinf(s):
        s = np.finfo(np.float32).max
    m, e = math.frexp(float(s))                       # s = m * 2^e, m in [0.5, 1)
    return 2.0 ** (e - 1)


def test_blockwise_1x128_and_128x128_match_the_derivation():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 256, generator=g) * torch.logspace(-6, 3, 4)[:, None]
    x[0, 5] = 448 * 2.0 ** -3                         # amax exactly 448 * 2^k: scale 2^3
    got = recipes.quantize_operand(x, "te_fp8_blockwise", "input", "fprop")
    want = torch.empty_like(x)
    for r in range(4):
        for b in range(2):
            blk = x[r, b * 128:(b + 1) * 128]
            s = pow2_scale(nan_max_abs(blk))
            want[r, b * 128:(b + 1) * 128] = torch.tensor([e4m3(float(v) * s) / s for v in blk])
    assert torch.equal(got, want)
    w = torch.randn(256, 200, generator=g)            # in = 200: a partial tile, zero padded
    w[:128, :128] *= 1e-3
    wf = recipes.quantize_operand(w, "te_fp8_blockwise", "weight", "fprop")
    wd = recipes.quantize_operand(w, "te_fp8_blockwise", "weight", "dgrad")
    assert torch.equal(wf, wd)                        # square tiles: the transpose's numbers
    for r0, c0 in ((0, 0), (128, 128)):
        tile = w[r0:r0 + 128, c0:c0 + 128]
        s = pow2_scale(nan_max_abs(tile.flatten()))
        ref = torch.tensor([[e4m3(float(v) * s) / s for v in row] for row in tile])
        assert torch.equal(wf[r0:r0 + 128, c0:c0 + 128], ref)


# ---- MXFP8 -----------------------------------------------------------------------------------------
def mx_code(amax: float) -> int:
    """TE: the E8M0 code of fl(amax * fl(1/448)), rounded up (biased, saturating)."""
    v = F32(F32(amax) * F32(1.0 / 448.0))
    if math.isinf(v):
        return 254
    if v == 0:
        return 0
    m, e = math.frexp(float(v))                       # v = m 2^e: 2^(e-1) <= v < 2^e
    k = e - 1 if m == 0.5 else e                      # ceil(log2 v)
    return max(0, min(254, k + 127))


def ref_mx_row(row) -> list[float]:
    out = []
    for b in range(0, len(row), 32):
        blk = [float(v) for v in row[b:b + 32]]
        k = mx_code(nan_max_abs(blk)) - 127
        out += [e4m3(v * 2.0 ** -k) * 2.0 ** k for v in blk]
    return out


def test_mxfp8_matches_the_derivation_on_boundaries():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g)
    x[0, :32] *= 0.0                                  # zero block: code 0, all zeros
    x[1, 0] = 448.0 * 2.0 ** 5                        # amax exactly 448 * 2^k: scale 2^5, no round up
    x[2, 0] = 448.0 * 2.0 ** 5 * (1 + 2.0 ** -20)     # just above: 2^6
    x[3, 1] = float("nan")                            # NaN: ignored by the amax, stays NaN
    x[4, 2] = float("-inf")                           # Inf: amax Inf -> code 254
    x[5] *= 2.0 ** -120                               # tiny: code near the bottom of E8M0
    got = recipes.quantize_operand(x, "te_mxfp8", "input", "fprop")
    want = torch.tensor([ref_mx_row(r) for r in x.tolist()])
    assert same(got, want)
    assert mx_code(448.0 * 2 ** 5) == 127 + 5 and mx_code(448.0 * 2 ** 5 * (1 + 2.0 ** -20)) == 133
    assert got[4, 2] == float("-inf") and torch.all(got[4, 3:32] == 0)
    # on ordinary data TE's rule is our MX "rceil" scale mode (and differs from OCP's floor)
    y = torch.randn(64, 128, generator=g) * torch.logspace(-8, 8, 128)
    te = recipes.quantize_operand(y, "te_mxfp8", "weight", "dgrad")
    assert torch.equal(te, quant.quantize(y, "mxfp8", axis=0, scale_mode="rceil"))
    assert not torch.equal(te, quant.quantize(y, "mxfp8", axis=0))


# ---- NVFP4 -------------------------------------------------------------------------------------------
def ref_nvfp4(m: np.ndarray, tile=(1, 16), amax=None) -> np.ndarray:
    """TE's NVFP4 of m [rows, k] (k the reduction axis), element by element."""
    g_amax = F32(nan_max_abs(m.ravel()) if amax is None else amax)
    s_enc = F32(min(F32(2688) / g_amax, np.finfo(np.float32).max)) if g_amax else F32(1)
    if s_enc == 0:
        s_enc = F32(1)
    s_dec = F32(F32(1) / s_enc)
    mult = F32(s_enc * F32(1 / 6))
    out = np.zeros_like(m)
    r, c = tile
    for i in range(0, m.shape[0], r):
        for j in range(0, m.shape[1], c):
            blk = m[i:i + r, j:j + c]
            s_b = F32(e4m3(float(F32(F32(nan_max_abs(blk.ravel())) * mult))))
            enc = F32(min(F32(F32(1) / F32(s_b * s_dec)), np.finfo(np.float32).max)) \
                if s_b else F32(np.finfo(np.float32).max)
            for a in range(blk.shape[0]):
                for b in range(blk.shape[1]):
                    q = e2m1(float(F32(blk[a, b] * enc)))
                    out[i + a, j + b] = F32(F32(q * s_b) * s_dec)
    return out


def test_nvfp4_1x16_matches_the_derivation_and_flushes_underflowed_blocks():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 64, generator=g)
    x[0, 0] = 2688.0                                  # global amax 2688: S_enc = 1
    x[1, :16] = torch.tensor([1e-3] * 16)             # block amax * S_enc/6 < 2^-10: s_b = 0
    x[2, 16:32] = torch.tensor([5.0, 2.5 * 4 / 6 * 6] + [0.1] * 14)
    got = recipes.quantize_operand(x, "te_nvfp4", "input", "fprop")
    want = ref_nvfp4(x.numpy())
    assert torch.equal(got, torch.tensor(want))
    assert torch.all(got[1, :16] == 0)                # flushed, as TE does
    ours = quant.quantize(x, "nvfp4")                 # our format keeps that block (2^-9 floor)
    assert torch.all(ours[1, :16] != 0)


def test_nvfp4_ties_round_to_even():
    # global amax 6 * 448 = 2688 (S_enc 1); a block with amax 6 * 2^-3 -> s_b = 2^-3 exactly,
    # so elements are multiplied by 8: 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4 (ties to even)
    row = [2688.0] + [0.0] * 15 + [6 / 8, 0.25 / 8, 0.75 / 8, 2.5 / 8, 5 / 8, 3.5 / 8] + [0.0] * 10
    x = torch.tensor([row])
    got = recipes.quantize_operand(x, "te_nvfp4", "input", "fprop")
    assert got[0, 16:22].tolist() == [6 / 8, 0.0, 1 / 8, 2 / 8, 4 / 8, 4 / 8]


def test_nvfp4_multiplies_by_the_rounded_reciprocal():
    # amax 50.62566 (one block): d = s_b * S_dec; 21.094025 / d is exactly 2.5 (a tie, -> 2),
    # but TE computes 21.094025 * fl(1 / d) = 2.5000002 (-> 3)
    a, x = F32(50.62566), F32(21.094025)
    s_enc = F32(F32(2688) / a)
    s_b = F32(e4m3(float(F32(a * F32(s_enc * F32(1 / 6))))))
    d = F32(s_b * F32(F32(1) / s_enc))
    assert F32(x / d) == F32(2.5) and F32(x * F32(F32(1) / d)) > F32(2.5)
    row = torch.tensor([[float(a), float(x)] + [0.0] * 14])
    got = recipes.quantize_operand(row, "te_nvfp4", "input", "fprop")
    assert got[0, 1] == float(F32(F32(3 * s_b) * F32(F32(1) / s_enc)))


def test_nvfp4_weights_use_16x16_tiles_the_same_for_fprop_and_dgrad():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 32, generator=g) * torch.logspace(-3, 1, 32)
    wf = recipes.quantize_operand(w, "te_nvfp4", "weight", "fprop")
    wd = recipes.quantize_operand(w, "te_nvfp4", "weight", "dgrad")
    assert torch.equal(wf, wd)
    assert torch.equal(wf, torch.tensor(ref_nvfp4(w.numpy(), (16, 16))))
    x1d = recipes.quantize_operand(w, "te_nvfp4", "input", "fprop")   # 1x16 differs from tiles
    assert not torch.equal(x1d, wf)


def test_rht_is_te_signs_times_sylvester_and_orthogonal():
    from quant import role_quantizers

    m = role_quantizers.hadamard16().double()
    h = np.array([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)])
    assert torch.equal(m, torch.tensor(np.diag(TE_SIGNS) @ h / 4.0))
    assert torch.equal(m @ m.t(), torch.eye(16, dtype=torch.float64))
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(32, 48, generator=g).double(), torch.randn(32, 24, generator=g).double()
    # transforming both wgrad operands along tokens leaves the high-precision GEMM unchanged
    ta = (a.t().reshape(48, 2, 16) @ m).reshape(48, 32)
    tb = (b.t().reshape(24, 2, 16) @ m).reshape(24, 32)
    assert torch.allclose(ta @ tb.t(), a.t() @ b, rtol=0, atol=1e-12)


def test_wgrad_operands_are_quantized_after_the_rht_and_returned_in_the_original_domain():
    from quant import role_quantizers

    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 32, generator=g)              # [tokens, in]
    got = recipes.quantize_operand(x, "te_nvfp4", "input", "wgrad")
    m = role_quantizers.hadamard16()
    xt = x.t().reshape(32, 4, 16) @ m                 # [in, tokens] transformed along tokens
    xt = xt.reshape(32, 64).to(torch.bfloat16).float()   # TE's fused kernel rounds to bf16
    q_rht = torch.tensor(ref_nvfp4(xt.numpy()))       # amax taken after the transform
    back = (q_rht.reshape(32, 4, 16) @ m.t()).reshape(32, 64).t()
    assert torch.equal(got, back)
    # a high-precision wgrad GEMM of two results is the GEMM of the quantized transformed operands
    dy = torch.randn(64, 16, generator=g)
    gq = recipes.quantize_operand(dy, "te_nvfp4", "grad_output", "wgrad",
                                  generator=torch.Generator().manual_seed(0))
    dyt = ((dy.t().reshape(16, 4, 16) @ m).reshape(16, 64)).to(torch.bfloat16).float()
    gq_rht = (gq.t().double().reshape(16, 4, 16) @ m.double()).reshape(16, 64)
    assert torch.allclose(gq.t().double() @ got.double(), gq_rht @ q_rht.double().t(),
                          rtol=1e-5, atol=1e-5)
    assert (gq_rht - dyt.double()).abs().max() < dyt.abs().max()    # sane magnitudes


def test_stochastic_rounding_neighbours_unbiased_reproducible():
    g = torch.Generator().manual_seed(8)
    dy = torch.randn(16, 32, generator=g)
    dy[0, 0] = 2688.0 / 64                            # S_enc fixed by this amax
    draws = torch.stack([recipes.quantize_operand(dy, "te_nvfp4", "grad_output", "dgrad",
                                                  generator=torch.Generator().manual_seed(s))
                         for s in range(400)])
    near = torch.tensor(ref_nvfp4(dy.numpy()))        # the nearest-even result
    lo, hi = draws.amin(0), draws.amax(0)
    assert torch.all((lo == near) | (hi == near))     # one of the two candidates is the RNE one
    n_values = torch.tensor([[len(set(draws[:, i, j].tolist())) for j in range(32)]
                             for i in range(16)])
    assert n_values.max() == 2 and (n_values == 2).sum() > 100
    two = n_values == 2                               # the two grid points around x
    assert torch.all(lo[two] <= dy[two]) and torch.all(hi[two] >= dy[two])
    assert torch.equal(lo[~two], near[~two])          # x (next to) a grid point: that point
    err = draws.double().mean(0) - dy.double()
    spread = (hi - lo).double()
    # unbiased: the mean of 400 draws is within 5 standard deviations (<= spread / 2 each)
    assert torch.all(err[two].abs() <= 5 * 0.5 * spread[two] / math.sqrt(400))
    assert abs(float(err.sum() / spread.sum())) < 0.01
    a = recipes.quantize_operand(dy, "te_nvfp4", "grad_output", "dgrad",
                                 generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, draws[3]) and not torch.equal(draws[3], draws[4])
    fwd = recipes.quantize_operand(dy, "te_nvfp4", "input", "fprop")   # inputs: nearest even
    assert torch.equal(fwd, near)


# ---- trivial recipes, table, bad input ----------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["mxfp8", "hifp8", "nvfp4", "fp8_e4m3_tensor"])
def test_every_format_is_a_trivial_recipe(fmt):
    g = torch.Generator().manual_seed(9)
    ops = {"input": torch.randn(2, 32, 64, generator=g), "weight": torch.randn(32, 64, generator=g),
           "grad_output": torch.randn(64, 32, generator=g)}
    for tensor, gemm in recipes.ROLES:
        x = ops[tensor]
        if gemm == "wgrad":
            x = x.reshape(-1, x.shape[-1])
        want = quant.quantize(x, fmt, axis=plan_axis(gemm, tensor))
        assert torch.equal(recipes.quantize_operand(x, fmt, tensor, gemm), want)
    assert set(quant.FORMATS) <= set(recipes.RECIPES)


def test_three_d_input_keeps_shape_and_dtype():
    x = torch.randn(4, 8, 64).to(torch.bfloat16)
    for gemm in ("fprop", "wgrad"):
        y = recipes.quantize_operand(x, "te_nvfp4", "input", gemm)
        assert y.shape == x.shape and y.dtype == torch.bfloat16
    flat = recipes.quantize_operand(x.reshape(32, 64), "te_nvfp4", "input", "wgrad")
    assert torch.equal(recipes.quantize_operand(x, "te_nvfp4", "input", "wgrad").reshape(32, 64),
                       flat)


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="valid recipes: te_fp8_delayed, .*te_nvfp4.*mxfp8"):
        recipes.quantize_operand(torch.ones(4, 32), "te_nvfp8", "input", "fprop")
    with pytest.raises(ValueError, match="weight/fprop"):
        recipes.quantize_operand(torch.ones(4, 32), "te_nvfp4", "weight", "wgrad")
    with pytest.raises(ValueError, match=r"input of the fprop GEMM has 40 in-features .* "
                                         r"multiple of 32"):
        recipes.quantize_operand(torch.ones(4, 40), "te_mxfp8", "input", "fprop")
    with pytest.raises(ValueError, match=r"grad_output of the wgrad GEMM has 24 tokens .* "
                                         r"multiple of 16"):
        recipes.quantize_operand(torch.ones(24, 32), "te_nvfp4", "grad_output", "wgrad")
    # FP8 blocks are padded as TE pads them: a partial block is quantized over its real values
    x = torch.randn(3, 200)
    got = recipes.quantize_operand(x, "te_fp8_blockwise", "input", "fprop")
    padded = recipes.quantize_operand(torch.nn.functional.pad(x, (0, 56)), "te_fp8_blockwise",
                                      "input", "fprop")
    assert torch.equal(got, padded[:, :200])


def test_megatron_flags_map_to_recipes():
    assert recipes.MEGATRON_EMULATION == {
        "--fp8-recipe": {"delayed": "te_fp8_delayed", "tensorwise": "te_fp8_tensorwise",
                         "blockwise": "te_fp8_blockwise", "mxfp8": "te_mxfp8"},
        "--fp4-recipe": {"nvfp4": "te_nvfp4"}}


def test_equals_transformer_engines_reference_quantizers():
    """Where Transformer Engine imports (a GPU machine with TE): our te_nvfp4 (1x16, 16x16 tiles,
    RHT wgrad operands) and te_fp8_tensorwise equal TE's pure-PyTorch reference quantizers
    (``transformer_engine.pytorch.custom_recipes``) element for element."""
    rn = pytest.importorskip("transformer_engine.pytorch.custom_recipes.reference_nvfp4")
    rc = pytest.importorskip("transformer_engine.pytorch.custom_recipes.reference_current_scaling")
    ru = pytest.importorskip("transformer_engine.pytorch.custom_recipes.reference_utils")
    from quant import role_quantizers

    def dequantized(data, scale, amax):
        q = rn.cast_from_fp4x2(data, torch.float32)
        s = scale.to(torch.float32).repeat_interleave(16, dim=1)[:, :q.shape[1]]
        s_enc = (torch.tensor(2688.0) / amax.float().cpu()).clamp(max=torch.finfo(torch.float32).max)
        s_enc = torch.where(s_enc == 0, torch.ones_like(s_enc), s_enc)
        return (q.cpu() * s.cpu()) * (1.0 / s_enc)

    g = torch.Generator().manual_seed(0)
    for span in (0, 8, 12, 16):
        x = torch.randn(128, 256, generator=g) * torch.exp2(
            torch.empty(128, 1).uniform_(-span, span, generator=g))
        for tile, role in (((1, 16), ("input", "fprop")), ((16, 16), ("weight", "fprop"))):
            ref = rn.NVFP4QuantizerRef(dtype=ru.Fp4Formats.E2M1, quant_tile_shape=tile,
                                       with_rht=False, columnwise=False).quantize(x)
            assert torch.equal(recipes.quantize_operand(x, "te_nvfp4", *role),
                               dequantized(ref.data, ref.scale, ref.global_amax_row))
        xb = x.to(torch.bfloat16)
        ref = rn.NVFP4QuantizerRef(dtype=ru.Fp4Formats.E2M1, quant_tile_shape=(1, 16),
                                   with_rht=True, rowwise=False).quantize(xb)
        back = role_quantizers.rht_inverse(dequantized(ref.data_t, ref.scale_t, ref.global_amax_col)).t()
        assert torch.equal(recipes.quantize_operand(xb.float(), "te_nvfp4", "input", "wgrad"), back)
        for dt, role in ((torch.float8_e4m3fn, ("input", "fprop")),
                         (torch.float8_e5m2, ("grad_output", "dgrad"))):
            ref = rc.CurrentScalingQuantizerRef(dtype=dt, rowwise=True, columnwise=False).quantize(x)
            assert torch.equal(recipes.quantize_operand(x, "te_fp8_tensorwise", *role),
                               ref.data.float().cpu() * ref.scale.cpu())
