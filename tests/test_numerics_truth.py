"""One definition of overflow / underflow / flush-to-zero / severity (quant.analysis), every path.

One tensor goes through capture statistics (tensor_capture.stats), the scale sweep at the level
whose factor is 1 (quant.scaling_sweep), the tensor analyzer (training_profiler.tensor_analyzer),
the training monitor's range check (adaptive_monitor, watching a dtype) and
quant.analyze_quantization; every path must report the same counts, ratios and severities.
"""
from __future__ import annotations

import pytest
import torch

import quant
from quant import scaling_sweep as ss
from quant.analysis import cast_limits, severity
from tensor_capture import stats
from training_profiler.monitor import TrainingMonitor
from training_profiler.tensor_analyzer import format_risks


def _probe(fmt: str) -> torch.Tensor:
    """Values on every boundary of ``fmt``'s element cast: the overflow midpoint and its float32
    neighbours, max_normal, min_normal and its neighbours, the flush midpoint and its neighbours,
    zeros, plus a random body; both signs; float32 and finite."""
    lim = cast_limits(fmt)
    edges = []
    for t in (lim.overflow_from, lim.max_normal, lim.min_normal, lim.flush_to, lim.min_subnormal):
        t32 = torch.tensor(t, dtype=torch.float32)
        edges += [t32, torch.nextafter(t32, torch.tensor(0.0)),
                  torch.nextafter(t32, torch.tensor(float("inf")))]
    edges = torch.stack(edges)
    g = torch.Generator().manual_seed(0)
    body = torch.randn(200, generator=g) * torch.exp2(torch.randint(-30, 20, (200,), generator=g).float())
    x = torch.cat([edges, -edges, body, torch.zeros(3)])
    return x[torch.randperm(x.numel(), generator=g)]


def _monitor_ratios(x: torch.Tensor, watch: torch.dtype) -> tuple[float, float]:
    """(overflow ratio, underflow ratio) the monitor records for a layer whose output is x."""

    class Emit(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.one = torch.nn.Parameter(torch.ones(()))

        def forward(self) -> torch.Tensor:
            return x * self.one                                   # exactly x

    m = Emit()
    mon = TrainingMonitor(warmup_steps=2, model=m, sinks=[], sync_every=1, layer_stats_every=1,
                          watch_dtype=watch, sample_size=x.numel())
    out = m()
    mon.step_end(out.detach().abs().mean())
    h = mon.history[-1]
    return h["act_overflow_ratio_max"], h["act_underflow_ratio_max"]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp4_e2m1", "int8"])
def test_every_path_counts_the_same(fmt):
    x = _probe(fmt)
    n = x.numel()
    ref = quant.analyze_quantization(x, fmt)
    assert ref.overflow_count and ref.underflow_count and ref.flush_to_zero_count  # all exercised

    # capture statistics against the format's range (both the host and the device path)
    spec = stats.format_range(fmt)
    for host in (True, False):
        r = stats.decode(stats.compute(x, [spec], host_path=host), [spec])["range"][fmt]
        assert (r["overflow_count"], r["underflow_count"], r["flush_to_zero_count"]) == (
            ref.overflow_count, ref.underflow_count, ref.flush_to_zero_count), host
        assert (r["overflow_ratio"], r["underflow_ratio"], r["flush_to_zero_ratio"]) == (
            ref.overflow_ratio, ref.underflow_ratio, ref.flush_to_zero_ratio)

    # the sweep at the level whose factor is 1: x / 1 cast to the element format
    lv = ss.run_sweep(x, fmt, num_levels=1, max_scale_exp=0, min_scale_exp=0).levels[0]
    assert lv.scale_factor == 1.0
    assert (lv.overflow_count, lv.underflow_count, lv.flush_to_zero_count) == (
        ref.overflow_count, ref.underflow_count, ref.flush_to_zero_count)
    assert (lv.overflow_ratio, lv.underflow_ratio, lv.flush_to_zero_ratio) == (
        ref.overflow_ratio, ref.underflow_ratio, ref.flush_to_zero_ratio)
    assert (lv.overflow_severity, lv.underflow_severity) == (
        ref.overflow_severity.upper(), ref.underflow_severity.upper())

    # the tensor analyzer
    risk = format_risks(x, [fmt])[fmt]
    assert {k: risk[k] for k in ("overflow_ratio", "underflow_ratio", "flush_to_zero_ratio")} == {
        "overflow_ratio": ref.overflow_ratio, "underflow_ratio": ref.underflow_ratio,
        "flush_to_zero_ratio": ref.flush_to_zero_ratio}
    # ... and its verdict's loss is quant.format_loss's, not a copy
    from quant.format_loss import judge

    assert risk["sqnr_db"] == judge(x.float(), fmt, -1).sqnr_db

    # severities are quant.analysis's rule on the matching ratio
    assert ref.overflow_severity == severity(ref.overflow_count / n)
    assert ref.underflow_severity == severity(ref.underflow_count / n)
    assert ref.flush_to_zero_severity == severity(ref.flush_to_zero_count / n)


@pytest.mark.parametrize("dtype, fmt", [(torch.float16, "fp16"), (torch.bfloat16, "bf16")])
def test_monitor_capture_and_analysis_agree_on_a_dtype_range(dtype, fmt):
    x = _probe(fmt)
    ref = quant.analyze_quantization(x, fmt)
    assert ref.overflow_count and ref.underflow_count
    over, under = _monitor_ratios(x, dtype)
    assert (over, under) == (ref.overflow_ratio, ref.underflow_ratio)
    spec = stats.dtype_range(dtype)
    r = stats.decode(stats.compute(x, [spec]), [spec])["range"][spec.name]
    assert (r["overflow_count"], r["underflow_count"], r["flush_to_zero_count"]) == (
        ref.overflow_count, ref.underflow_count, ref.flush_to_zero_count)


def test_inf_is_overflow_everywhere_it_is_counted():
    x = torch.tensor([1.0, float("inf"), -float("inf"), 500.0, 449.0, float("nan")])
    ref = quant.analyze_quantization(x, "fp8_e4m3")
    spec = stats.format_range("fp8_e4m3")
    r = stats.tensor_stats(x, [spec])["range"]["fp8_e4m3"]
    assert ref.overflow_count == r["overflow_count"] == 3          # +-Inf and 500; 449 -> 448
    assert (r["upper_overflow_count"], r["lower_overflow_count"]) == (2, 1)  # +Inf, 500 | -Inf
    assert _monitor_ratios(torch.tensor([1.0, 70000.0, float("inf"), 65519.0]), torch.float16)[0] \
        == quant.analyze_quantization(torch.tensor([1.0, 70000.0, float("inf"), 65519.0]),
                                      "fp16").overflow_ratio == 0.5


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp4_e2m1", "int8", "hifp8",
                                 "bf16", "fp16"])
@pytest.mark.parametrize("rounding", [None, "nearest_even", "nearest_away", "toward_zero"])
def test_cast_limits_are_where_the_quantizer_overflows_and_flushes(fmt, rounding):
    """The thresholds come from the quantizer: just at / below each bound, quantize agrees."""
    lim = cast_limits(fmt, rounding)
    spec = quant.get_format(fmt)
    up = lim.overflow_bound(torch.float32)
    if up != float("inf"):
        below = torch.nextafter(torch.tensor(up), torch.tensor(0.0))
        y = quant.quantize(torch.tensor([up, float(below)]), fmt, rounding=rounding, saturate=False)
        beyond = ~torch.isfinite(y) | (y.abs() > spec.max_normal)
        if spec.has_inf or spec.has_nan:             # overflow visible as Inf / NaN
            assert beyond.tolist() == [True, False]
        else:                                        # clamp-only formats: the bound saturates
            assert float(y[1]) <= spec.max_normal
    fb = lim.flush_bound(torch.float32)
    below = torch.nextafter(torch.tensor(fb), torch.tensor(0.0))
    y = quant.quantize(torch.tensor([fb, float(below)]), fmt, rounding=rounding)
    assert (y != 0).tolist() == [True, False]


def test_underflow_severity_is_the_underflow_ratio_not_the_flush_ratio():
    x = torch.ones(1000)
    x[:20] = 2.0 ** -8        # fp8_e4m3: subnormal (underflow 2 %), not flushed
    r = quant.analyze_quantization(x, "fp8_e4m3")
    assert (r.underflow_ratio, r.flush_to_zero_ratio) == (0.02, 0.0)
    assert (r.underflow_severity, r.flush_to_zero_severity) == ("high", "none")
    assert r.warning_message() is not None


def test_one_metric_name_per_metric():
    res = ss.run_sweep(torch.randn(500), "fp8_e4m3", num_levels=2)
    assert set(res.levels[0].metrics) <= set(quant.metrics.__all__)
    assert "cosine_similarity" in res.levels[0].metrics and "cosine" not in res.levels[0].metrics
