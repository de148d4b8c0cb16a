"""@watch_training / AdaptiveThreshold: injected spikes, NaN and drift are caught; clean runs stay quiet."""
from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from training_profiler import watch_training
from training_profiler.adaptive_monitor import AdaptiveThreshold, TrainingMonitor, dtype_limits


def _noisy_loss(n: int, seed: int = 0, start: float = 3.0, end: float = 2.0, noise: float = 0.02):
    """A slowly improving loss with multiplicative noise, like a healthy run."""
    rng = np.random.default_rng(seed)
    base = np.linspace(start, end, n)
    return base * (1 + noise * rng.standard_normal(n))


def _run(values, **kw) -> TrainingMonitor:
    @watch_training(sinks=[], **kw)
    def step(v):
        return torch.tensor(v)

    for v in values:
        step(float(v))
    step.monitor.close()
    return step.monitor


def test_threshold_warmup_sigma_and_range() -> None:
    th = AdaptiveThreshold(warmup_steps=4, sigma=3, window=None, rel_floor=0.0)
    for v in (1.0, 1.2, 0.8, 1.0):
        assert not th.update(v).any()  # warm-up never alarms
    assert th.ready and math.isclose(th.baseline["mean"][0], 1.0)
    assert not th.update(1.3)[0]
    assert th.update(1.6)[0]            # (1.6 - 1) / 0.1414 > 3 sigma
    assert not th.update(0.1)[0]        # direction "up": drops are fine
    both = AdaptiveThreshold(warmup_steps=3, window=None, direction="both", rel_floor=0.0)
    for v in (10.0, 10.5, 9.5):
        both.update(v)
    assert both.update(4.0)[0]          # below min/2 and far below the mean


def test_threshold_is_vectorized_and_ignores_nan() -> None:
    th = AdaptiveThreshold(warmup_steps=4, window=5)
    for row in ([1.0, 10.0, np.nan], [1.1, 10.0, np.nan], [0.9, np.nan, np.nan], [1.0, 10.0, np.nan]):
        th.update(row)
    assert th.update([1.0, 100.0, 1.0]).tolist() == [False, True, False]
    # A series first seen after the warm-up is judged once its window holds 3 values.
    assert th.update([1.0, 10.0, 50.0]).tolist() == [False, False, False]   # 2 values: not judged
    th.update([1.0, 10.0, 1.0])
    th.update([1.0, 10.0, 1.1])
    assert th.update([1.0, 10.0, 500.0]).tolist() == [False, False, True]


def test_rolling_window_forgives_a_healthy_trend() -> None:
    values = _noisy_loss(600, start=8.0, end=1.0)
    assert _run(values, warmup_steps=50, alert_window=50, sigma=3).alerts == []


def test_clean_runs_have_no_false_alarms() -> None:
    for seed in range(5):
        mon = _run(_noisy_loss(400, seed=seed), warmup_steps=100, alert_window=50)
        assert mon.alerts == [], (seed, mon.alerts[:2])


def test_injected_spike_is_caught_at_its_step() -> None:
    values = _noisy_loss(300)
    values[200] *= 1.6
    alerts = _run(values, warmup_steps=100).alerts
    assert [(a["step"], a["metric"]) for a in alerts] == [(201, "loss")]
    assert alerts[0]["deviation"] > 3 and "[ALERT] Step 201 | loss: " in alerts[0]["message"]


def test_nan_is_caught_without_baseline() -> None:
    values = _noisy_loss(50)
    values[10] = float("nan")  # still in warm-up
    values[30] = float("inf")
    alerts = _run(values, warmup_steps=100).alerts
    assert [(a["step"], a["metric"]) for a in alerts] == [(11, "loss_nonfinite"), (31, "loss_nonfinite")]


def test_slow_drift_is_caught_by_the_range_check() -> None:
    values = np.concatenate([_noisy_loss(100, start=2.0, end=2.0), np.linspace(2.0, 6.0, 300)])
    alerts = _run(values, warmup_steps=100, alert_window=50).alerts
    assert alerts, "a loss that tripled slowly must alarm"
    first = alerts[0]
    assert first["metric"] == "loss" and first["value"] > 2 * 2.0 * 1.0  # beyond 2x the warm-up max
    assert "above 2x the warm-up max" in first["message"]


def _mlp_step(seed: int = 0, sync_every: int = 10, **kw):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 1, generator=gen)

    @watch_training(warmup_steps=40, alert_window=40, model=model, sinks=[], sync_every=sync_every, **kw)
    def step(inject: str | None = None):
        x = torch.randn(256, 8, generator=gen)
        y = x @ w
        if inject == "nan":
            x[3, 2] = float("nan")
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if inject == "grad_spike":
            (loss * 50).backward()
        else:
            loss.backward()
        if inject != "nan":
            opt.step()
        return loss

    return step, model


def test_model_clean_run_is_quiet_and_syncs_rarely() -> None:
    step, model = _mlp_step()
    for _ in range(150):
        step()
    mon = step.monitor
    assert mon.layers == ["0", "2"]
    assert len(mon.history) == 150 and all(math.isfinite(h["grad_norm"]) for h in mon.history)
    mon.close()
    assert mon.alerts == []
    # Layer statistics are sampled every 10th step by default (steps 10, 20, ...).
    with_stats = [h["step"] for h in mon.history if "act_underflow_ratio_max" in h]
    assert with_stats == list(range(10, 151, 10))


def test_model_grad_spike_and_nan_layer_are_named() -> None:
    step, _ = _mlp_step(layer_stats_every=1)
    for i in range(120):
        step("grad_spike" if i == 80 else "nan" if i == 100 else None)
    step.monitor.close()
    found = {(a["step"], a["metric"], a["layer"]) for a in step.monitor.alerts}
    assert (81, "grad_norm", None) in found
    assert (101, "act_nonfinite", "0") in found       # the first layer that saw the NaN
    assert (101, "loss_nonfinite", None) in found
    assert not any(a["step"] < 81 for a in step.monitor.alerts)


def test_underflow_ratio_against_watch_dtype() -> None:
    """Activations far below float16's smallest normal: the ratio is 1 when watched as float16."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    mon = TrainingMonitor(warmup_steps=2, model=lin, sinks=[], sync_every=1, watch_dtype=torch.float16,
                          layer_stats_every=1)
    scale = {"v": 1.0}
    for i in range(12):
        x = torch.randn(64, 4) * scale["v"]
        lin.zero_grad()
        out = lin(x)
        out.sum().backward()
        if i == 8:
            with torch.no_grad():
                lin.weight.mul_(1e-7)
                lin.bias.zero_()
        mon.step_end(out.detach().abs().mean())
    hist = [h["act_underflow_ratio_max"] for h in mon.history]
    assert hist[2] == 0.0 and hist[10] == 1.0
    assert any(a["metric"] == "act_underflow_ratio" and a["layer"] == "" for a in mon.alerts)
    tiny = dtype_limits(torch.float16)[1]
    assert tiny == torch.finfo(torch.float16).smallest_normal


def test_status_line_and_sinks(tmp_path, caplog) -> None:
    lines: list[str] = []

    class ListSink:
        def emit(self, r):
            if "message" in r:
                lines.append(r["message"])

        def flush(self):
            pass

        def close(self):
            pass

    jsonl = tmp_path / "mon.jsonl"
    tb = tmp_path / "tb"
    values = _noisy_loss(60)
    values[50] = 40.0
    with caplog.at_level(logging.INFO, logger="training_profiler.monitor"):
        @watch_training(warmup_steps=20, log_every=20, sinks=[ListSink(), "logging", f"jsonl:{jsonl}",
                                                               f"tensorboard:{tb}"])
        def step(v):
            return {"loss": torch.tensor(v)}

        for v in values:
            step(float(v))
        step.monitor.close()
    assert any(l.startswith("[Monitor] Step 40 | loss: ") and l.endswith("| Status: OK") for l in lines)
    assert any(l.startswith("[ALERT] Step 51 | loss: 40") and "Deviation:" in l for l in lines)
    assert any("[ALERT] Step 51" in r.message and r.levelno == logging.WARNING for r in caplog.records)
    recs = [json.loads(l) for l in jsonl.read_text().splitlines()]
    assert sum(r["kind"] == "metrics" for r in recs) == 60
    assert [r["step"] for r in recs if r["kind"] == "alert"] == [51]
    assert any(p.name.startswith("events.out.tfevents") for p in tb.iterdir())


def test_bad_arguments_are_clear() -> None:
    with pytest.raises(ValueError, match="unknown monitor sink 'nope'"):
        TrainingMonitor(sinks=["nope"])
    with pytest.raises(ValueError, match="warmup_steps=1"):
        AdaptiveThreshold(warmup_steps=1)


def test_missing_gradients_are_not_alarms() -> None:
    lin = torch.nn.Linear(4, 4)
    mon = TrainingMonitor(warmup_steps=3, model=lin, sinks=[], sync_every=2)
    for _ in range(8):
        lin.zero_grad(set_to_none=True)
        out = lin(torch.randn(8, 4))      # forward only: no backward, no .grad
        mon.step_end(out.detach().abs().mean())
    mon.close()
    assert mon.alerts == [] and all(math.isnan(h["grad_norm"]) for h in mon.history)


def test_grad_norm_every_thins_out_the_norm() -> None:
    step, _ = _mlp_step(grad_norm_every=5)
    for _ in range(20):
        step()
    step.monitor.close()
    measured = [h["step"] for h in step.monitor.history if math.isfinite(h["grad_norm"])]
    assert measured == [5, 10, 15, 20]
