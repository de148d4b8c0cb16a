"""@watch_training / AdaptiveThreshold: injected spikes, NaN and drift are caught; clean runs stay quiet."""
from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from training_profiler import watch_training
from training_profiler.monitor import AdaptiveThreshold, TrainingMonitor, dtype_limits


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
        if inject not in ("nan", "no_update"):
            opt.step()
        return loss

    return step, model


def test_model_clean_run_is_quiet_and_syncs_rarely() -> None:
    step, model = _mlp_step()
    for _ in range(150):
        step()
    mon = step.monitor
    assert mon.layers == ["0", "2"]
    mon.close()
    assert mon.alerts == []
    # Layer statistics are sampled every 10th step by default (steps 10, 20, ...), and the
    # global gradient norm (not returned by this step) is measured on those steps only.
    with_stats = [h["step"] for h in mon.history if "act_underflow_ratio_max" in h]
    assert len(mon.history) == 150 and with_stats == list(range(10, 151, 10))
    assert [h["step"] for h in mon.history if math.isfinite(h["grad_norm"])] == with_stats
    # Between statistics steps no hook is installed: the model runs at full speed.
    assert not any(m._forward_hooks for m in model.modules())


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
    with pytest.raises(ValueError, match="sync_every, log_every"):
        TrainingMonitor(sync_every=0)
    with pytest.raises(TypeError, match="warmup_step\\b"):
        TrainingMonitor(warmup_step=5)       # a misspelt setting is refused, not ignored
    with pytest.raises(TypeError):
        TrainingMonitor(5)                   # settings are keywords: no silent positional meaning


def _alerts_and_history(step) -> tuple[list, list]:
    for i in range(120):
        step("grad_spike" if i == 90 else "nan" if i == 105 else None)
    step.monitor.close()
    return step.monitor.alerts, step.monitor.history


def test_setting_groups_equal_the_keywords() -> None:
    """The frozen groups and the flat keywords are one setting: the same run judged either way
    gives the same alerts and history; a keyword overrides its group's field."""
    from training_profiler.monitor import MonitorCadence, MonitorThresholds

    flat = _alerts_and_history(_mlp_step(layer_stats_every=2, sigma=6.0)[0])
    th = MonitorThresholds(warmup_steps=7, alert_window=40, sigma=6.0, cooldown=3)
    grouped = _alerts_and_history(_mlp_step(thresholds=th, cadence=MonitorCadence(
        sync_every=3, layer_stats_every=2))[0])    # _mlp_step's sync_every and warmup win
    assert grouped[0] and json.dumps(flat, default=repr) == json.dumps(grouped, default=repr)
    mon = TrainingMonitor(sinks=[], thresholds=th, sigma=5.0)
    assert mon.threshold_settings == MonitorThresholds(warmup_steps=7, alert_window=40,
                                                       sigma=5.0, cooldown=3)
    assert mon.th_loss.sigma == 5.0 and mon.th_loss.warmup_steps == 7
    assert (mon.sigma, mon.cooldown, mon.sample_size) == (5.0, 3, 4096)   # read as before
    with pytest.raises(AttributeError):
        th.sigma = 1.0                       # frozen: one run's settings cannot drift


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


def test_default_cadence_still_catches_explosions_and_nan() -> None:
    """Defaults (statistics and the global norm every 10th step, no norm from the step): a
    gradient explosion that lasts is caught at the next statistics step, a NaN loss at its own
    step, and persistent non-finite activations are traced to the layer where they start."""
    step, model = _mlp_step()
    assert step.monitor.grad_norm_every == step.monitor.layer_stats_every == 10
    for i in range(130):
        if i == 100:
            with torch.no_grad():
                model[2].weight[0, 0] = float("nan")   # the second layer goes bad and stays bad
        # from step 101 the optimizer is held (as a loop skipping non-finite steps would), so
        # the NaN stays in the second layer instead of spreading through the update
        step("grad_spike" if 80 <= i < 90 else "no_update" if i >= 100 else None)
    step.monitor.close()
    found = {(a["step"], a["metric"], a["layer"]) for a in step.monitor.alerts}
    assert (90, "grad_norm", None) in found           # steps 81-90 exploded; 90 measures it
    assert (101, "loss_nonfinite", None) in found
    named = [a for a in step.monitor.alerts if a["metric"] == "act_nonfinite"]
    assert named and named[0]["layer"] == "2" and named[0]["tensor"] == "forward output"
    assert named[0]["step"] <= 110 and "Layer '2' forward output act_nonfinite" in named[0]["message"]
    assert not any(a["step"] < 90 for a in step.monitor.alerts)


def _clip_step(return_float: bool = False, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 1, generator=gen)
    norms: list[float] = []

    @watch_training(warmup_steps=40, alert_window=40, model=model, sinks=[], **kw)
    def step(spike: bool = False):
        x = torch.randn(256, 8, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), x @ w)
        (loss * 50 if spike else loss).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)   # measures, never clips
        norms.append(float(norm))
        if not spike:   # the spike's update is skipped, so the only thing to see is the norm
            opt.step()
        return {"loss": loss, "grad_norm": float(norm) if return_float else norm}

    return step, norms


@pytest.mark.parametrize("return_float", [False, True])
def test_grad_norm_from_the_step_is_judged_every_step(return_float: bool) -> None:
    """A step that returns the norm its clipping computed: that norm is judged on every step
    (a one-step spike between statistics steps is caught at its step) and is the one recorded."""
    step, norms = _clip_step(return_float)
    for i in range(120):
        step(spike=(i == 83))                           # step 84: not a statistics step
    mon = step.monitor
    mon.close()
    assert [(a["step"], a["metric"]) for a in mon.alerts] == [(84, "grad_norm")]
    assert mon.th_gnorm.warmup_steps == 40               # warmed up on every step's value
    recorded = [h["grad_norm"] for h in mon.history]
    assert np.allclose(recorded, norms, rtol=1e-6)      # the step's values, every step
    # per-layer norms are still taken on statistics steps (they name the layer of a jump)
    assert mon.th_layer_gnorm.step == 12


def test_alerts_name_the_gradient_tensor() -> None:
    """Output gradients pushed below float16's normal range: the alert says which tensor."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    mon = TrainingMonitor(warmup_steps=20, alert_window=20, model=model, sinks=[], sync_every=5,
                          layer_stats_every=1, watch_dtype=torch.float16)
    for i in range(30):
        model.zero_grad()
        out = model(torch.randn(64, 8))
        (out.square().mean() * (1e-12 if i >= 25 else 1.0)).backward()
        mon.step_end(out.detach().square().mean())
    mon.close()
    grad_alerts = [a for a in mon.alerts if a["metric"] == "grad_underflow_ratio"]
    assert grad_alerts and all(a["tensor"] == "output gradient" for a in grad_alerts)
    first = grad_alerts[0]
    assert first["step"] == 26 and first["capture"] is None        # no capture in this process
    assert f"Layer '{first['layer']}' output gradient grad_underflow_ratio: " in first["message"]


class _Block(torch.nn.Module):
    def __init__(self, idx: int) -> None:
        super().__init__()
        self.idx = idx
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tensor_capture.saver import get_tensor_saver

        out = torch.tanh(self.fc(x))
        # a hand-rolled capture, as a loop without the Megatron patches would write it
        saver = get_tensor_saver()
        for op, name, t in (("forward", "input", x), ("forward", "output", out)):
            saver.save_tensor(t.detach(), "linear", op, None, name, self.idx, phase="post",
                              component="linear",
                              module_path=f"layers.{self.idx}.fc", submodule="fc")
        return out


def test_alert_links_to_the_captured_files(tmp_path, monkeypatch) -> None:
    """With capture on, a layer's alert carries the capture directory, the capture iteration
    of its step and a glob that opens exactly that layer's files of that iteration."""
    from tensor_capture import saver as saver_mod
    from tensor_capture import schema

    for var in ("TENSOR_SAVE_ENABLED", "TENSOR_SAVE_CONFIG", "TENSOR_SAVER_ITERATION", "CUSTOM_QUANT_TYPE"):
        monkeypatch.delenv(var, raising=False)
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_Block(i) for i in range(3)])
    model.head = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    first_iteration = 100    # the loop's iterations do not start at the monitor's step 1
    try:
        saver = saver_mod.configure(enabled=True, save_dir=str(tmp_path / "cap"),
                                    iter_start=first_iteration + 29, iter_end=first_iteration + 30)

        @watch_training(warmup_steps=20, alert_window=20, model=model, sinks=[], sync_every=4,
                        layer_stats_every=1, watch_dtype=torch.float16)
        def step(it: int):
            saver.set_iteration(it)           # numbered at the step's start, as Megatron's schedule does
            x = torch.randn(32, 8)
            for block in model.layers:
                x = block(x)
            loss = model.head(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss

        for i in range(36):
            if i == 30:   # layer 1's outputs sink below float16's normal range from step 31
                with torch.no_grad():
                    model.layers[1].fc.weight.mul_(1e-8)
                    model.layers[1].fc.bias.zero_()
            step(first_iteration + i)
        step.monitor.close()
        saver.flush()
        alert = next(a for a in step.monitor.alerts
                     if a["metric"] == "act_underflow_ratio" and a["layer"] == "layers.1.fc")
        assert alert["step"] == 31 and alert["iteration"] == first_iteration + 30
        assert alert["tensor"] == "forward output"
        link = alert["capture"]
        assert link["dir"] == str(saver.directory) and link["iteration"] == first_iteration + 30
        assert link["module_path"] == "layers.1.fc" and link["layer_idx"] == 1
        assert link["glob"] == schema.filename_glob(iteration=first_iteration + 30, layer_idx=1, rank=0)
        assert f"{link['dir']}/{link['glob']}" in alert["message"]
        opened = sorted(p.name for p in saver.directory.glob(link["glob"]))
        written = sorted(r[schema.MANIFEST_FILE] for r in schema.read_manifest(saver.directory)
                         if schema.record_name(r).iteration == first_iteration + 30
                         and r[schema.META_MODULE_PATH] == "layers.1.fc")
        assert opened == written and len(written) == 2
        assert all(schema.parse_filename(n).iteration == first_iteration + 30 for n in opened)
        # an alert at an iteration the capture did not save carries no link
        later = [a for a in step.monitor.alerts if a["iteration"] > first_iteration + 30 and a["layer"]]
        assert all(a["capture"] is None for a in later)
    finally:
        saver_mod.reset_tensor_saver()


def test_filename_glob_matches_only_its_fields() -> None:
    """schema.filename_glob is build_filename's layout with wildcards: it matches a built name
    with the same fields and rejects one that differs in any of them."""
    import fnmatch

    from tensor_capture import schema

    base = dict(layer_type="linear", operation="forward", tensor_name="grad_output", quant_type="mxfp8",
                layer_idx=3, phase="pre", component="linear", iteration=12, rank=0, sample_idx=1,
                timestamp="20250101_120000", counter=7)
    name = schema.build_filename(schema.TensorName(**base))
    pattern = schema.filename_glob(iteration=12, layer_idx=3, rank=0)
    assert fnmatch.fnmatchcase(name, pattern)
    for field, other in (("iteration", 1), ("iteration", 120), ("layer_idx", 13), ("layer_idx", None),
                         ("rank", 1)):
        changed = schema.build_filename(schema.TensorName(**{**base, field: other}))
        assert not fnmatch.fnmatchcase(changed, pattern), (field, other)
    assert fnmatch.fnmatchcase(schema.build_filename(schema.TensorName(**{**base, "layer_idx": None})),
                               schema.filename_glob(layer_idx=None))


@pytest.mark.parametrize("direction", ["up", "down", "both"])
@pytest.mark.parametrize("window", [None, 8])
def test_scalar_path_equals_the_array_path(direction: str, window: int | None) -> None:
    """update(float) after the warm-up takes the Python-float path; it must give the same
    verdicts, z and window state as the array path, bit for bit, through spikes, drops, NaN,
    Inf and a window emptied by a long incident."""
    rng = np.random.default_rng(3)
    values = list(2.0 + 0.1 * rng.standard_normal(300))
    values[40:44] = [9.0, float("nan"), float("inf"), -float("inf")]
    values[60:80] = [50.0] * 20                    # a long incident empties the window
    values[120] = 0.2
    values[200:203] = [0.0, 1e-300, -5.0]
    for range_check in (True, False):
        fast = AdaptiveThreshold(warmup_steps=10, window=window, direction=direction, range_check=range_check)
        ref = AdaptiveThreshold(warmup_steps=10, window=window, direction=direction, range_check=range_check)
        verdicts = []
        for x in values:
            if fast.ready:   # from here on a float must take the scalar path
                fast._update_array = lambda v: pytest.fail("array path taken for a float")
            a = fast.update(float(x))
            b = ref.update(np.array([x]))               # an array: never the scalar path
            assert a.tolist() == b.tolist() and a.dtype == b.dtype == bool
            np.testing.assert_array_equal(fast.last_z, ref.last_z)
            if ref.ready:
                np.testing.assert_array_equal(fast.reference()[0], ref.reference()[0])
                np.testing.assert_array_equal(fast.reference()[1], ref.reference()[1])
            verdicts.append(bool(a[0]))
        assert any(verdicts) and not all(verdicts)
