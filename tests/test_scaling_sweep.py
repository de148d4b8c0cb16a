"""The MXFP scale sweep library (quant.scaling_sweep) against quant's own quantizer,
analysis and metrics, level by level, plus the analyses on hand-computed cases."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from error_bounds import gamma, ratio_of_sums_bound, sqnr_db_bound

import quant
from lowp_common import json_dumps
from quant import scaling_sweep as ss
from quant import sweep_verdicts as sv
from quant_tools import scaling_report as report

FORMATS = ss.ELEMENT_FORMATS
METRIC_FUNCS = {"mse": quant.metrics.mse, "rmse": quant.metrics.rmse, "mae": quant.metrics.mae,
                "max_abs_error": quant.metrics.max_abs_error,
                "relative_error": quant.metrics.relative_error,
                "cosine_similarity": quant.metrics.cosine_similarity, "psnr": quant.metrics.psnr}


def _wide_tensor(n: int, seed: int, spread: float = 4.0) -> torch.Tensor:
    """bf16 values over many binades, both signs, some zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * spread)
    x[:: max(n // 7, 1)] = 0.0
    return x.to(torch.bfloat16)


def _tie_probe(fmt: str) -> torch.Tensor:
    """Every representable value, the midpoints between neighbours (RNE ties) and points just
    beyond max_normal: the places where a cast goes wrong first."""
    vals = torch.tensor(sorted(set(quant.get_format(fmt).value_set())), dtype=torch.float64)
    mids = (vals[1:] + vals[:-1]) / 2
    spec = quant.get_format(fmt)
    beyond = torch.tensor([spec.max_normal * k for k in (1.01, 1.05, 1.2, 2.0, 3.0, 100.0)],
                          dtype=torch.float64)
    out = torch.cat([vals, mids, beyond, -beyond, torch.nextafter(mids.float(),
                                                                  torch.tensor(0.0)).double()])
    return out.to(torch.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_batched_cast_is_bit_identical_to_quant_quantize(fmt):
    x = torch.cat([_wide_tensor(2000, 1).float(), _tie_probe(fmt)])
    levels = [-6.0, -2.5, -1.0, 0.0, 0.3, 1.0, 4.0]
    factors = ss.scale_factors(levels)
    grid = ss.get_element_grid(fmt)
    batched = ss.cast_levels(x, factors, grid)
    for i in range(len(levels)):
        f = factors[i]
        ref = quant.quantize(x / f, fmt) * f
        assert torch.equal(batched[i], ref), (fmt, levels[i])
    # at level 0 the probe's representable values come back unchanged
    probe = _tie_probe(fmt)
    assert torch.equal(ss.cast_elements(probe, grid), quant.quantize(probe, fmt))


def _metric_tolerance(key: str, n: int) -> dict:
    """pytest.approx's tolerance for a metric of n elements computed twice with float32 sums in
    other orders (the sweep's chunks, quant.metrics' whole tensor): each side within the bound
    of its sums (tests/error_bounds.py). Quantization keeps signs, so the sums of x q, x^2, q^2,
    (x - q)^2 and |x - q| all have nonnegative terms: relative errors gamma(n + 2) per sum; a
    square root halves it, a ratio adds them (cosine: a dot over two norms)."""
    g = gamma(n + 2)
    if key == "psnr":                      # 10 log10(peak^2 / mse): a dB error, absolute
        return {"abs": 2 * sqnr_db_bound(n)}
    rel = {"mse": 2 * g, "rmse": 2 * g, "mae": 2 * g, "max_abs_error": 0.0,
           "relative_error": 2 * ratio_of_sums_bound(n), "cosine_similarity": 6 * g}[key]
    return {"rel": rel, "abs": 1e-30}


@pytest.mark.parametrize("fmt", FORMATS)
def test_sweep_metrics_and_counts_match_quant_level_by_level(fmt):
    x = _wide_tensor(3001, 2)
    # a small chunk forces many chunks and a partial last one
    res = ss.run_sweep(x, fmt, num_levels=9, chunk=256)
    xf = x.float()
    assert len(res.levels) == 9
    for lv in res.levels:
        f = torch.tensor(lv.scale_factor, dtype=torch.float32)
        q = quant.quantize(xf / f, fmt) * f
        for key, fn in METRIC_FUNCS.items():
            want = fn(xf, q)
            assert lv.metrics[key] == pytest.approx(want, **_metric_tolerance(key, x.numel())), (
                fmt, key)
        a = quant.analyze_quantization(xf / f, fmt)
        assert (lv.overflow_count, lv.underflow_count, lv.flush_to_zero_count) == \
            (a.overflow_count, a.underflow_count, a.flush_to_zero_count), (fmt, lv.scale_exp)
        assert lv.overflow_ratio == pytest.approx(a.overflow_ratio)
        assert lv.overflow_severity == a.overflow_severity.upper()


@pytest.mark.parametrize("chunk,workers", [(300, 1), (300, 3), (100000, 2)])
def test_sweep_result_does_not_depend_on_chunking_or_workers(chunk, workers):
    x = _wide_tensor(5000, 3)
    a = ss.run_sweep(x, "fp6_e3m2", num_levels=5, chunk=1000, workers=1)
    threads = torch.get_num_threads()
    b = ss.run_sweep(x, "fp6_e3m2", num_levels=5, chunk=chunk, workers=workers)
    assert torch.get_num_threads() == threads          # restored after the threaded pass
    for la, lb in zip(a.levels, b.levels):
        assert (la.overflow_count, la.underflow_count, la.flush_to_zero_count) == \
            (lb.overflow_count, lb.underflow_count, lb.flush_to_zero_count)
        assert la.metrics["max_abs_error"] == lb.metrics["max_abs_error"]
        assert la.metrics["mse"] == pytest.approx(lb.metrics["mse"],
                                                  **_metric_tolerance("mse", x.numel()))


def test_overflow_count_stays_exact_with_one_level_and_huge_chunks():
    # int8 has the smallest top step relative to max_normal: the chunk is capped so the
    # float32 row sums behind the overflow count stay exact
    grid = ss.get_element_grid("int8")
    assert grid.max_exact_chunk == 2 ** 23 // 128
    x = torch.full((200_000,), 5.0)
    x[::3] = 0.5
    res = ss.run_sweep(x, "int8", num_levels=1, max_scale_exp=0, min_scale_exp=0,
                       chunk=1 << 20)
    a = quant.analyze_quantization(x, "int8")
    assert res.levels[0].overflow_count == a.overflow_count == 133_333


def test_alignment_exponents_follow_the_formulas():
    grid = ss.get_element_grid("fp8_e4m3")  # max 448, min normal 2^-6
    x = torch.tensor([1000.0, -3.0, 2.0 ** -10, 0.0])
    al = ss.alignment_exponents(x, grid)
    assert al.max_align == math.floor(math.log2(1000 / 448)) == 1
    assert al.min_align == math.ceil(math.log2(2.0 ** -10 / 2.0 ** -6)) == -4
    assert al.amax == 1000.0 and al.amin_nonzero == 2.0 ** -10
    zeros = ss.alignment_exponents(torch.zeros(5), grid)
    assert zeros.max_align is None and zeros.min_align is None


def test_alignment_is_exact_at_powers_of_two():
    grid = ss.get_element_grid("fp8_e4m3")
    for k in (-20, -3, 0, 5):
        at = torch.tensor([448.0 * 2.0 ** k, 0.0])
        below = torch.tensor([float(torch.nextafter(torch.tensor(448.0 * 2.0 ** k),
                                                      torch.tensor(0.0))), 0.0])
        assert ss.alignment_exponents(at, grid).max_align == k
        assert ss.alignment_exponents(below, grid).max_align == k - 1
        small = torch.tensor([2.0 ** (k - 6), 0.0])
        assert ss.alignment_exponents(small, grid).min_align == k
        assert ss.alignment_exponents(small * 1.0001, grid).min_align == k + 1
    assert ss.min_nonzero_abs(torch.tensor([0.0, -0.0, -3e-40, 2.0])) == pytest.approx(3e-40)
    assert ss.min_nonzero_abs(torch.tensor([0.0, -0.0])) is None


def test_levels_are_evenly_spaced_between_min_and_max_alignment():
    grid = ss.get_element_grid("fp8_e4m3")
    x = torch.tensor([2.0 ** 12, 2.0 ** -20, 1.0])
    plan = ss.plan_levels(x, grid, num_levels=5)
    lo = math.ceil(-20 + 6)                           # min alignment -14
    hi = math.floor(12 - math.log2(448))              # max alignment 3
    assert plan.min_exp == lo and plan.max_exp == hi
    assert plan.levels == pytest.approx([lo + i * (hi - lo) / 4 for i in range(5)])
    one = ss.plan_levels(x, grid, num_levels=1)
    assert one.levels == [hi]
    user = ss.plan_levels(x, grid, num_levels=3, max_scale_exp=2.5, min_scale_exp=-1)
    assert user.levels == pytest.approx([-1.0, 0.75, 2.5])


def test_level_plan_edge_cases():
    grid = ss.get_element_grid("fp8_e4m3")
    narrow = torch.tensor([0.5, 1.0])      # range fits inside the format: alignments cross
    plan = ss.plan_levels(narrow, grid, num_levels=3)
    assert plan.min_exp == math.floor(math.log2(1 / 448)) and plan.max_exp == 5
    assert any("above max alignment" in n for n in plan.notes)
    zeros = ss.plan_levels(torch.zeros(4), grid, num_levels=4)
    assert zeros.max_exp == 0 and zeros.min_exp < 0
    assert any("all values are zero" in n for n in zeros.notes)
    clipped = ss.plan_levels(narrow, grid, num_levels=2, max_scale_exp=300, min_scale_exp=-300)
    assert (clipped.min_exp, clipped.max_exp) == (-127, 127)
    assert any("clipped" in n for n in clipped.notes)
    with pytest.raises(ss.SweepInputError, match="--min-scale-exp"):
        ss.plan_levels(narrow, grid, min_scale_exp=9)   # above the automatic max
    with pytest.raises(ss.SweepInputError, match="--num-levels"):
        ss.plan_levels(narrow, grid, num_levels=0)
    with pytest.raises(ss.SweepInputError, match="--scale-bits"):
        ss.plan_levels(narrow, grid, scale_bits=9)


def test_bad_tensors_are_refused_with_a_clear_message():
    with pytest.raises(ss.SweepInputError, match="int32 tensor.*floating-point"):
        ss.prepare_tensor(torch.arange(5, dtype=torch.int32), "a.pt")
    with pytest.raises(ss.SweepInputError, match="empty"):
        ss.prepare_tensor(torch.empty(0, 3), "b.pt")
    with pytest.raises(ss.SweepInputError, match="NaN or Inf"):
        ss.prepare_tensor(torch.tensor([math.nan, math.inf]), "c.pt")
    with pytest.raises(ss.SweepInputError, match="beyond the float32 range"):
        ss.prepare_tensor(torch.tensor([1e300, 1.0], dtype=torch.float64), "e.pt")
    ok = ss.prepare_tensor(torch.tensor([0.5, 1.0], dtype=torch.float64), "f.pt")
    assert ok.values.dtype == torch.float32 and ok.dtype == "float64"
    with pytest.raises(ss.SweepInputError, match="not a tensor"):
        ss.prepare_tensor([1.0, 2.0], "d.pt")


def test_nan_and_inf_are_counted_and_excluded():
    x = torch.tensor([1.0, math.nan, -2.0, math.inf, -math.inf, 0.5], dtype=torch.bfloat16)
    res = ss.run_sweep(x, "fp8_e4m3", num_levels=3)
    t = res.tensor
    assert (t["nan"], t["inf"], t["finite"], t["numel"]) == (1, 2, 3, 6)
    clean = ss.run_sweep(torch.tensor([1.0, -2.0, 0.5]), "fp8_e4m3", num_levels=3)
    assert [lv.metrics for lv in res.levels] == [lv.metrics for lv in clean.levels]
    assert any("Excluded non-finite values: 1 NaN, 2 Inf" in line
               for line in report.format_tensor_info(res))


def test_overflow_example_of_the_seed():
    # 10 of 200 values at 1000: scaled by 2^5 they are 31.25 -> no overflow; at 2^0 they
    # overflow fp8_e4m3 (max 448): 5 %, HIGH; the 190 ones underflow at 2^10 (1/1024 < 2^-6)
    x = torch.cat([torch.full((10,), 1000.0), torch.ones(190)])
    res = ss.run_sweep(x, "fp8_e4m3", num_levels=3, min_scale_exp=0, max_scale_exp=10)
    lv0, lv5, lv10 = res.levels
    assert (lv0.overflow_count, lv0.overflow_ratio, lv0.overflow_severity) == (10, 0.05, "HIGH")
    assert lv5.overflow_count == 0 and lv5.underflow_count == 0
    assert lv10.underflow_count == 190 and lv10.underflow_severity == "HIGH"
    # 2^-10 is half the min subnormal 2^-9: a tie, rounds to even, i.e. to zero
    assert lv10.flush_to_zero_count == 190
    assert lv0.scaled_range == (1.0, 1000.0) and lv0.quantized_range == (1.0, 448.0)
    summary = ss.overflow_summary(res.levels)
    assert summary["worst_overflow"] is lv0 and summary["worst_underflow"] is lv10
    assert summary["clean_levels"] == [lv5]
    text = "\n".join(report.format_overflow_summary(res))
    for needle in ("OVERFLOW/UNDERFLOW ANALYSIS SUMMARY", "🔴 OVERFLOW ISSUES:",
                   "Overflow: 10 (5.00%)", "Severity: HIGH", "🟡 UNDERFLOW ISSUES:",
                   "Worst Overflow: Scale Exp 0.00", "Worst Underflow: Scale Exp 10.00",
                   "💡 Only one level without significant overflow/underflow (< 0.1%): 5.00"):
        assert needle in text, needle
    assert res.recommendation.scale_exp == 5.0


@pytest.mark.parametrize("ratio,expected", [(0.0, "NONE"), (0.001, "NONE"), (0.0011, "MEDIUM"),
                                            (0.01, "MEDIUM"), (0.0101, "HIGH"), (0.5, "HIGH")])
def test_severity_classes(ratio, expected):
    assert ss.severity(ratio) == expected


def test_composite_score_normalization_by_hand():
    metrics = {"mse": [1e-2, 1e-3, 1e-4], "cosine_similarity": [0.90, 0.99, 0.95],
               "psnr": [20.0, 30.0, 40.0], "mae": [1.0, 1.0, 1.0],
               "relative_error": [0.1, 0.01, 0.0]}
    scores = ss.composite_scores(metrics)
    # mse in log10: -2, -3, -4 -> 0, 0.5, 1; cosine linear: 0, 1, 5/9; psnr: 0, 0.5, 1;
    # mae all equal -> 1; relative error: level 2 exact -> 1, others log10 -1, -2 -> 0, 1
    want = [0.3 * 0 + 0.3 * 0 + 0.2 * 0 + 0.1 * 1 + 0.1 * 0,
            0.3 * 0.5 + 0.3 * 1 + 0.2 * 0.5 + 0.1 * 1 + 0.1 * 1,
            0.3 * 1 + 0.3 * (0.05 / 0.09) + 0.2 * 1 + 0.1 * 1 + 0.1 * 1]
    assert scores == pytest.approx(want)
    assert ss.composite_scores({k: [math.nan, 1.0] for k in metrics})[0] == 0.0
    assert sum(ss.COMPOSITE_WEIGHTS.values()) == pytest.approx(1.0)


def _lv(s, mse, cos=0.99, psnr=40.0, over=0.0, under=0.0):
    """A level as the verdicts read it (LevelResult's fields), severities by quant's rule."""
    return SimpleNamespace(scale_exp=float(s), overflow_ratio=over, underflow_ratio=under,
                           overflow_severity=ss.severity(over), underflow_severity=ss.severity(under),
                           metrics={"mse": mse, "rmse": math.sqrt(mse), "mae": mse,
                                    "max_abs_error": mse, "relative_error": mse,
                                    "cosine_similarity": cos, "psnr": psnr})


def _decide(levels, all_zero=False, sparse=""):
    """The verdicts of fake levels, through the same calls run_sweep makes."""
    mets = {k: [lv.metrics[k] for lv in levels] for k in ss.METRIC_NAMES}
    scores = ss.composite_scores(mets)
    return sv.decide(levels, scores, ss.stability_analysis(mets), all_zero, sparse,
                     ss.composite_best(levels, scores))


def _rules(verdicts):
    return {(t, v.rule) for t, vs in verdicts.items() for v in vs}


def test_stability_statistics_and_their_rules():
    st = ss.stability_analysis({"mse": [1.0, 11.0], "cosine_similarity": [0.9990, 0.9999],
                                "psnr": [30.0, 35.0], "mae": [1, 2], "relative_error": [1, 2]})
    assert st["mse"]["delta"] == 10.0 and st["mse"]["std"] == pytest.approx(5.0)
    assert st["mse"]["ratio"] == 11.0 and st["mse"]["n"] == 2
    three = [_lv(0, 1.0, 0.9990, 30.0), _lv(1, 11.0, 0.9999, 35.0), _lv(2, 5.0, 0.9995, 33.0)]
    _, v = _decide(three)
    assert v["mse"][0].text.startswith("⚠️  MSE varies significantly with scaling (max/min 11x")
    assert v["cosine"][0].rule == "stable" and v["psnr"][0].rule == "small"
    wide = [_lv(0, 1.0, 0.5, 10.0), _lv(1, 1.5, 0.99, 40.0), _lv(2, 1.2, 0.9, 20.0)]
    _, v = _decide(wide)
    assert [v[t][0].rule for t in ("mse", "cosine", "psnr")] == ["stable", "varies", "large"]
    assert v["mse"][0].text.startswith("✅ MSE is stable across scaling factors (max/min 1.5x")


def test_every_verdict_rule_fires_on_its_case():
    """Each row of sweep_verdicts.RULES is reachable, and only where its conditions hold: a
    new row needs a case here."""
    tradeoff = [_lv(s, mse, cos, psnr, over, under) for s, mse, cos, psnr, over, under in (
        (0, 1e-2, 0.80, 10.0, 0.30, 0.0), (1, 1e-3, 0.95, 25.0, 0.02, 0.0),
        (2, 1e-5, 0.999, 45.0, 0.0, 0.0), (3, 1e-4, 0.99, 35.0, 0.0, 0.005),
        (4, 1e-3, 0.97, 28.0, 0.0, 0.05))]
    rising = [_lv(s, 10.0 ** -s, 0.98 + 0.005 * s, 30.0 + 4 * s) for s in range(4)]
    falling = [_lv(s, 10.0 ** s, 0.995 - 0.005 * s, 45.0 - 4 * s) for s in range(4)]
    flat_mid = [_lv(0, 2e-3), _lv(1, 1e-3), _lv(2, 5e-4, 0.995), _lv(3, 1e-3), _lv(4, 2e-3)]
    scattered = [_lv(0, 1e-3), _lv(1, 2e-3, over=0.005), _lv(2, 1e-3)]
    dirty = [_lv(0, 1e-3, over=0.02), _lv(1, 2e-3, under=0.02), _lv(2, 3e-3, under=0.2)]
    cases = {
        "one level": ([_lv(-16, 1e-8)], False, "--num-levels 1 asked for"),
        "all zero": ([_lv(s, 0.0, 1.0, math.inf) for s in range(5)], True, ""),
        "all alike": ([_lv(s, 1e-4) for s in range(3)], False, ""),
        "one exact": ([_lv(0, 0.0, 1.0, math.inf), _lv(1, 1e-3, 0.99, 30.0)], False,
                      "--num-levels 2 asked for"),
        "trade-off": (tradeoff, False, ""), "rising": (rising, False, ""),
        "falling": (falling, False, ""), "flat middle": (flat_mid, False, ""),
        "scattered": (scattered, False, ""), "dirty": (dirty, False, ""),
    }
    fired, by_case = set(), {}
    for name, (levels, zero, sparse) in cases.items():
        _, verdicts = _decide(levels, zero, sparse)
        by_case[name] = verdicts
        fired |= _rules(verdicts)
    assert fired == {(r.topic, r.id) for r in sv.RULES}, \
        {(r.topic, r.id) for r in sv.RULES} - fired
    assert by_case["trade-off"]["position"][0].rule == "balanced"
    assert by_case["rising"]["position"][0].rule == "large_end"
    assert by_case["falling"]["position"][0].rule == "small_end"
    assert by_case["flat middle"]["position"][0].rule == "middle"
    assert by_case["scattered"]["range"][0].text.endswith("0.00, 2.00")
    assert by_case["dirty"]["range"][0].rule == "least_problematic"


@pytest.mark.parametrize("case", ["one level", "all zero", "all alike"])
def test_no_recommendation_where_the_levels_cannot_carry_one(case):
    levels, zero, sparse = {
        "one level": ([_lv(-16, 1e-8, over=0.0012)], False, "--num-levels 1 asked for"),
        "all zero": ([_lv(s, 0.0, 1.0, math.inf) for s in range(5)], True, ""),
        "all alike": ([_lv(s, 1e-4) for s in range(3)], False, "")}[case]
    chosen, verdicts = _decide(levels, zero, sparse)
    assert chosen is None
    said = " ".join(v.text for vs in verdicts.values() for v in vs)
    for claim in ("balanced middle ground", "Recommended scaling range", "Recommended:"):
        assert claim not in said
    assert verdicts["recommendation"][0].text.startswith("No recommendation:")
    if case == "one level":
        assert "is stable" not in said and "cannot be judged from one level" in said


def test_degenerate_alignment_is_widened_by_the_stated_rule():
    """Max and min alignment both -16 swept '1 levels from -16 to -16'
    and still said 'stable' and 'balanced'. Now the range is -16 +- ceil(span / 2)."""
    for fmt in FORMATS:
        grid = ss.get_element_grid(fmt)
        g = torch.Generator().manual_seed(1)
        lo, hi = grid.min_normal * 2.0 ** -16, grid.max_normal * 2.0 ** -16
        x = lo * (hi / lo) ** torch.rand(4000, generator=g, dtype=torch.float64)
        x = x.float().clamp(lo, hi)
        x[0], x[1] = hi, lo           # the tensor spans exactly the format's normal range
        res = ss.run_sweep(x, fmt)
        al = res.plan.alignment
        assert al.max_align == al.min_align == -16, fmt
        half = max(1, math.ceil(math.ceil(math.log2(grid.max_normal / grid.min_normal)) / 2))
        assert (res.plan.min_exp, res.plan.max_exp) == (-16 - half, -16 + half), fmt
        assert len(res.levels) == 21 and any("widened" in n for n in res.plan.notes)
        assert res.recommendation is not None and res.plan.sparse_reason == ""
    # bounds given by the user are kept: one level, no recommendation, the reason said
    one = ss.run_sweep(x, "fp4_e2m1", min_scale_exp=-16, max_scale_exp=-16)
    assert [lv.scale_exp for lv in one.levels] == [-16.0] and one.recommendation is None
    assert one.plan.sparse_reason == "--min-scale-exp and --max-scale-exp are both -16"


def test_one_level_reports_say_why_instead_of_judging():
    x = _wide_tensor(3000, 8, spread=1.0)
    res = ss.run_sweep(x, "fp8_e4m3", num_levels=1)
    assert res.recommendation is None and res.best_by_metric == {}
    text = report.results_text(res, "g.pt")
    for claim in ("is stable", "balanced middle ground", "Recommended scaling range",
                  "🎯 Use scaling factor", "⭐ RECOMMENDED", "Worst Overflow", "🏆 Best MSE"):
        assert claim not in text, claim
    for reason in ("No recommendation: only one exponent was swept", "--num-levels 1 asked for",
                   "MSE stability cannot be judged from one level",
                   "no range of levels to recommend", "Tested 1 scaling level at"):
        assert reason in text, reason
    doc = json.loads(json_dumps(res.to_dict()))
    assert doc["recommendation"] is None and "only one exponent" in doc["no_recommendation"]
    assert doc["verdicts"]["plot_note"][0]["rule"] == "sparse"


def test_recommendation_position_comes_from_the_table():
    x = _wide_tensor(4000, 5, spread=1.0)
    res = ss.run_sweep(x, "fp8_e4m3", num_levels=11)
    rec = res.recommendation
    assert rec.index == max(range(11), key=lambda i: (round(res.scores[i], 12), i))
    assert 0.0 <= rec.position <= 1.0
    (pos,) = res.verdicts["position"]
    row = next(r for r in sv.RULES if (r.topic, r.id) == ("position", pos.rule))
    assert row.phrase.split("{")[0] in pos.text


def test_reports_have_every_section_and_json_is_strict():
    res = ss.run_sweep(_wide_tensor(1500, 6), "fp4_e2m1", num_levels=7)
    text = report.results_text(res, "some.pt")
    for header in ("SCALING FACTOR ANALYSIS & RECOMMENDATIONS", "INDIVIDUAL METRIC OPTIMA:",
                   "🏆 Best MSE", "🎯 Best Cosine Similarity", "📊 Best PSNR",
                   "COMPOSITE RECOMMENDATION:", "⭐ RECOMMENDED Scaling Factor",
                   "PERFORMANCE ANALYSIS:", "MSE Stability (std)", "Cosine Stability (std)",
                   "RECOMMENDATIONS:", "FINAL RECOMMENDATION:", "🎯 Use scaling factor",
                   "OVERFLOW/UNDERFLOW ANALYSIS SUMMARY", "OVERFLOW EXTREMES:",
                   "UNDERFLOW EXTREMES:", "OVERFLOW/UNDERFLOW RECOMMENDATIONS:"):
        assert header in text, header
    table = report.results_table(res)
    assert len(table) == 2 + 7
    first = table[2].split()
    assert float(first[0]) == pytest.approx(res.levels[0].scale_exp, abs=1e-3)
    assert float(first[2]) == pytest.approx(res.levels[0].metrics["mse"], rel=1e-6)
    doc = json.loads(json_dumps(res.to_dict()))  # what the command writes: strict JSON
    assert len(doc["levels"]) == 7
    assert doc["recommendation"]["scale_exp"] == res.recommendation.scale_exp


def test_all_zero_tensor_sweeps_with_defaults():
    res = ss.run_sweep(torch.zeros(64, dtype=torch.bfloat16), "fp8_e5m2", num_levels=4)
    assert res.recommendation is None
    assert res.says("recommendation") == ["No recommendation: all values are zero, so every "
                                          "level is exact"]
    assert all(lv.metrics["mse"] == 0.0 and lv.metrics["psnr"] == math.inf
               for lv in res.levels)
    assert all(lv.metrics["cosine_similarity"] == 1.0 for lv in res.levels)  # quant: both zero -> 1
    assert res.plan.alignment.min_align is None
    json.loads(json_dumps(res.to_dict()))


def test_sweep_of_values_no_level_can_hold_says_so_instead_of_crashing():
    """1e38 overflows fp8 at every exponent an 8-bit scale can reach, so no level has a finite
    MSE; the verdicts must still be given (the spread tests are simply false), not a TypeError."""
    import torch

    from quant.scaling_sweep import run_sweep

    t = torch.full((64, 64), 1e38)
    result = run_sweep(t, "fp8_e4m3", num_levels=5)
    assert result.verdicts
    assert result.to_dict()["levels"]
