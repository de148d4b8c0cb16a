"""TensorSaver on its own (no Megatron): files, metadata, manifest, schedule, budget, failures."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tensor_capture import saver as saver_mod
from tensor_capture import schema
from tensor_capture.saver import TensorSaver


def _saver(tmp_path, **kw) -> TensorSaver:
    return TensorSaver(enabled=True, save_dir=str(tmp_path), **kw)


def _pt_files(d):
    return sorted(p for p in os.listdir(d) if p.endswith(".pt"))


def test_standalone_save_writes_parseable_files_and_manifest(tmp_path):
    s = _saver(tmp_path, quant_type="hifp8")
    s.set_iteration(4)
    s.set_sample_idx(2)
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    path = s.save_tensor(x, "linear", "forward", tensor_name="input", layer_idx=1, phase="pre",
                         component="linear", module_path="decoder.layers.1.mlp.linear_fc1",
                         submodule="linear_fc1")
    out = s.save_attention_tensors(x, x, x, layer_idx=0)
    s.step()
    lin = s.save_linear_tensors(x, x.t(), operation="backward", layer_idx=0, phase="pre")
    s.close()
    assert path and os.path.basename(path) in _pt_files(tmp_path)
    assert set(out) == {"query", "key", "value"} and set(lin) == {"input", "weight"}
    t, meta = schema.load_tensor_file(path)
    assert torch.equal(t, x) and t.dtype == torch.bfloat16
    name = schema.parse_filename(path)
    assert (name.iteration, name.sample_idx, name.layer_idx, name.quant_type, name.rank) == (4, 2, 1, "hifp8", 0)
    assert {k: meta[k] for k in name.to_dict()} == name.to_dict()
    assert meta["module_path"] == "decoder.layers.1.mlp.linear_fc1" and meta["shape"] == [6, 8]
    assert meta["stats"]["range"]["hifp8"]["max_normal"] == 32768.0
    assert "bfloat16" in meta["stats"]["range"]
    recs = list(schema.read_manifest(tmp_path))
    assert [r["counter"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert [r["iteration"] for r in recs] == [4, 4, 4, 4, 5, 5]
    assert all(r["file"] in _pt_files(tmp_path) for r in recs)
    assert s.saved_iterations == [4, 5]


def test_quant_label_defaults_to_the_tensor_dtype(tmp_path):
    s = _saver(tmp_path)
    p = s.save_tensor(torch.ones(3, dtype=torch.float16), "linear", "forward", tensor_name="w")
    s.close()
    assert schema.parse_filename(p).quant_type == "fp16"


def test_disabled_saver_does_nothing(tmp_path):
    s = TensorSaver(enabled=False, save_dir=str(tmp_path / "never"))
    assert s.save_tensor(torch.ones(3), "linear", "forward") is None
    s.close()
    assert not (tmp_path / "never").exists()


def test_iteration_schedule_and_max_iterations(tmp_path):
    s = _saver(tmp_path, iter_start=2, iter_end=8, iter_every=3, max_iterations=2)
    saved = []
    for it in range(12):
        s.set_iteration(it)
        if s.save_tensor(torch.ones(2), "linear", "forward", tensor_name="x"):
            saved.append(it)
    s.close()
    assert saved == [2, 5]


def test_captures_answers_per_site_object_follow_the_schedule_and_the_saver(tmp_path):
    """TensorSaver.captures keeps the policy's answer per site object for an iteration (the
    hooks' hot path): the same object is asked again in later iterations, an earlier
    iteration is asked after a later one, a filter leaves another object out, and a closed
    saver captures nothing, as the policy alone answers."""
    s = _saver(tmp_path, iter_every=2, max_iterations=2, layers=[1], stats_only=True)
    kept = schema.CaptureSite(layer_type="linear", operation="forward", phase="pre",
                              tensor_name="input", layer_idx=1)
    other = schema.CaptureSite(layer_type="linear", operation="forward", phase="pre",
                               tensor_name="input", layer_idx=0)
    asked = []
    for it in range(7):
        s.set_iteration(it)
        for _ in range(2):                      # asked twice: the second answer is the kept one
            asked.append((it, s.captures(kept, it), s.captures(other, it)))
        if s.captures(kept, it):
            s.capture(torch.ones(2), kept)      # booked: max_iterations counts it
    assert [it for it, yes, _ in asked if yes] == [0, 0, 2, 2]
    assert not any(no for _, _, no in asked)
    assert s.captures(kept, 2) and not s.captures(kept, 4) and s.captures(kept, 0)
    s.close()
    assert not s.captures(kept, 0)


def test_filters(tmp_path):
    s = _saver(tmp_path, layers=[1], module_regex=r"fc1$", operations=["forward"],
               tensor_names=["input"])
    ok = dict(module_path="decoder.layers.1.mlp.linear_fc1")
    assert s.save_tensor(torch.ones(2), "linear", "forward", tensor_name="input", layer_idx=1, **ok)
    assert s.save_tensor(torch.ones(2), "linear", "forward", tensor_name="input", layer_idx=0, **ok) is None
    assert s.save_tensor(torch.ones(2), "linear", "backward", tensor_name="input", layer_idx=1, **ok) is None
    assert s.save_tensor(torch.ones(2), "linear", "forward", tensor_name="weight", layer_idx=1, **ok) is None
    assert s.save_tensor(torch.ones(2), "linear", "forward", tensor_name="input", layer_idx=1,
                         module_path="decoder.layers.1.mlp.linear_fc2") is None
    s.close()
    other = _saver(tmp_path / "r", ranks=[3])
    assert other.save_tensor(torch.ones(2), "linear", "forward") is None   # this process is rank 0
    other.close()


def test_byte_budget_keeps_min_iterations_then_records_stats_only(tmp_path):
    s = _saver(tmp_path, byte_budget=800, min_iterations=2)   # one tensor is 4*64 = 256 bytes
    x = torch.randn(64)
    files = []
    for it in range(3):
        s.set_iteration(it)
        files.append(s.save_tensor(x, "linear", "forward", tensor_name="t0"))
        if it == 0:
            files += [s.save_tensor(x, "linear", "forward", tensor_name=f"t{i}") for i in (1, 2)]
        s.budget.check()                           # every iteration so far fitted or was allowed
    s.close()
    # iteration 0 fits (768 B); iteration 1 exceeds the budget to complete min_iterations=2;
    # iteration 2 records statistics only
    assert all(files[:4]) and files[4] == ""
    recs = list(schema.read_manifest(tmp_path))
    assert [r["file"] is None for r in recs] == [False] * 4 + [True]
    assert recs[-1]["stats"]["numel"] == 64
    assert len(_pt_files(tmp_path)) == 4


def test_budget_that_cannot_hold_one_iteration_is_one_line_and_exit_2(tmp_path, capsys):
    from tensor_capture.budget import CaptureBudgetError

    s = _saver(tmp_path, byte_budget=300)
    s.set_iteration(0)
    out = [s.save_tensor(torch.randn(64), "linear", "forward", tensor_name=f"t{i}") for i in range(3)]
    assert out[0] and out[1] == "" and out[2] == ""   # files stop at the budget (256 B written)
    capsys.readouterr()
    with pytest.raises(CaptureBudgetError) as err:
        s.budget.check()
    s.close()
    assert err.value.code == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1
    assert "cannot hold one iteration" in line and "iteration 0 needs 768 B" in line
    assert len(_pt_files(tmp_path)) == 1


def test_any_rank_keeps_its_collective_for_the_main_thread_to_release(monkeypatch):
    """A budget stop exits right after the agreement; if the backend's worker thread dropped the
    collective's tensor last, during interpreter shutdown, torch 2.13 would abort the rank
    (status -6). So the work stays referenced here until the next agreement."""
    import torch.distributed as dist

    from tensor_capture import budget
    from tensor_capture.state import STATE

    works = []

    class Work:
        waited = False

        def wait(self):
            self.waited = True

    def all_reduce(tensor, op=None, async_op=False):
        assert async_op            # a synchronous call hands back no work to keep
        tensor.fill_(1)
        works.append(Work())
        return works[-1]

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(STATE, "agreement_work", None)
    assert budget.any_rank(False) is True and works[0].waited
    assert STATE.agreement_work is works[0]
    saver_mod.reset_tensor_saver()                    # a new session keeps it
    assert STATE.agreement_work is works[0]
    budget.any_rank(False)
    assert STATE.agreement_work is works[1]           # the next agreement replaces it


def test_stats_only_and_row_sampling(tmp_path):
    s = _saver(tmp_path / "a", stats_only=True)
    assert s.save_tensor(torch.randn(4, 4), "linear", "forward") == ""
    s.close()
    assert _pt_files(tmp_path / "a") == []
    assert len(list(schema.read_manifest(tmp_path / "a"))) == 1
    s = _saver(tmp_path / "b", max_rows=10)
    x = torch.arange(100 * 3, dtype=torch.float32).reshape(4, 25, 3)
    p = s.save_tensor(x, "linear", "forward", tensor_name="input")
    s.close()
    t, meta = schema.load_tensor_file(p)
    assert t.shape == (10, 3) and meta["sampled_rows"] == 10 and meta["sampled_row_stride"] == 10
    assert torch.equal(t, x.reshape(100, 3)[::10])
    assert meta["shape"] == [4, 25, 3] and meta["stats"]["numel"] == 300   # stats: whole tensor
    assert meta["stats"]["max"] == 299.0


def test_zero_size_noncontiguous_and_nan_tensors(tmp_path):
    s = _saver(tmp_path)
    e = s.save_tensor(torch.empty(0, 5), "linear", "forward", tensor_name="empty")
    base = torch.randn(6, 4)
    view = base.t()
    n = s.save_tensor(view, "linear", "forward", tensor_name="view")
    base.zero_()                                  # the caller reuses its buffer right away
    nanp = s.save_tensor(torch.tensor([1.0, float("nan"), float("inf")]), "linear", "forward",
                         tensor_name="nan")
    s.close()
    t, meta = schema.load_tensor_file(e)
    assert t.shape == (0, 5) and meta["stats"]["numel"] == 0
    t, meta = schema.load_tensor_file(n)
    assert t.shape == (4, 6) and t.abs().sum() > 0 and meta["stats"]["zero_count"] == 0
    t, meta = schema.load_tensor_file(nanp)
    assert meta["stats"]["nan_count"] == 1 and meta["stats"]["inf_count"] == 1
    assert meta["stats"]["max"] == 1.0


def test_unwritable_directory_disables_saving_with_one_message(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    s = _saver(blocker / "sub")
    assert not s.enabled
    assert s.save_tensor(torch.ones(2), "linear", "forward") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write to" in err[0] and "TENSOR_SAVE_DIR" in err[0]


def test_disk_error_while_writing_disables_and_training_continues(tmp_path, capsys, monkeypatch):
    s = _saver(tmp_path)
    assert s.save_tensor(torch.ones(2), "linear", "forward", tensor_name="a")
    s.flush()

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    s.save_tensor(torch.ones(2), "linear", "forward", tensor_name="b")
    s.flush()
    assert not s.enabled
    assert s.save_tensor(torch.ones(2), "linear", "forward", tensor_name="c") is None
    s.close()
    err = capsys.readouterr().err
    assert err.count("No space left on device") == 1 and "saving is now disabled" in err
    assert _pt_files(tmp_path) == [f for f in _pt_files(tmp_path) if "_a.pt" in f]
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_crash_mid_run_leaves_only_whole_files(tmp_path):
    code = textwrap.dedent(f"""
        import os, torch
        from tensor_capture.saver import TensorSaver
        s = TensorSaver(enabled=True, save_dir={str(tmp_path)!r}, queue_size=4)
        for i in range(30):
            s.save_tensor(torch.randn(128, 128), "linear", "forward", tensor_name=f"t{{i}}")
        os._exit(3)   # no flush, no atexit: a hard crash while the writer is busy
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    files = _pt_files(tmp_path)
    assert files
    for f in files:
        t, meta = schema.load_tensor_file(tmp_path / f)
        assert t.shape == (128, 128) and meta["stats"]["numel"] == 128 * 128
    listed = {r["file"] for r in schema.read_manifest(tmp_path)}
    assert listed <= set(files)


def test_exit_flushes_the_queue(tmp_path):
    code = textwrap.dedent(f"""
        import torch
        from tensor_capture.saver import TensorSaver
        s = TensorSaver(enabled=True, save_dir={str(tmp_path)!r})
        for i in range(20):
            s.save_tensor(torch.randn(32, 32), "linear", "forward", tensor_name=f"t{{i}}")
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert len(_pt_files(tmp_path)) == 20 and len(list(schema.read_manifest(tmp_path))) == 20


def test_process_wide_saver_from_environment(tmp_path, monkeypatch):
    from tensor_capture.state import STATE

    monkeypatch.setenv("TENSOR_SAVE_ENABLED", "1")
    monkeypatch.setenv("TENSOR_SAVE_DIR", str(tmp_path))
    monkeypatch.setenv("TENSOR_SAVER_ITERATION", "9")
    monkeypatch.setenv("CUSTOM_QUANT_TYPE", "fp8_e4m3")
    saver_mod.reset_tensor_saver()
    try:
        s = saver_mod.get_tensor_saver()
        assert s is saver_mod.get_tensor_saver() and s.iteration == 9
        assert STATE.active and STATE.emulate and STATE.quant_type == "fp8_e4m3"
        p = saver_mod.save_tensor(torch.ones(3), "linear", "forward", tensor_name="x")
        assert schema.parse_filename(p).quant_type == "fp8_e4m3"
        monkeypatch.setenv("CUSTOM_QUANT_TYPE", "bogus")
        saver_mod.reset_tensor_saver()
        with pytest.raises(saver_mod.ConfigError, match="is not a known format; valid: "):
            saver_mod.get_tensor_saver()
    finally:
        saver_mod.reset_tensor_saver()
        from tensor_capture import sites

        sites.uninstall_discovery()
    assert not STATE.active


def test_synthetic_run_for_readers(tmp_path):
    from tensor_capture.synthetic import write_synthetic_run

    d = write_synthetic_run(tmp_path, quant_types=("bf16", "mxfp4"), iterations=(0,), num_layers=1,
                            ranks=(0, 1), hidden=32, seq=4)
    recs = list(schema.read_manifest(d))
    assert len(recs) == 2 * 2 * (4 * 6 + 6)
    assert (d / "manifest_rank1.jsonl").is_file()
    for r in recs:
        t, meta = schema.load_tensor_file(d / r["file"])
        assert list(t.shape) == meta["shape"] and schema.parse_filename(r["file"]).rank == r["rank"]
    q = next(r for r in recs if r["quant_type"] == "mxfp4" and r["tensor_name"] == "input")
    t, _ = schema.load_tensor_file(d / q["file"])          # blocks of 32 = the last axis here
    a = t.double().abs()
    _, e = torch.frexp(a.amax(-1, keepdim=True))
    v = a / torch.pow(2.0, (e - 1 - 2).double())            # E2M1: emax 2
    assert torch.isin(v, torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)).all()


def test_recipe_emulation_owns_its_random_stream_and_delayed_state(tmp_path):
    """CUSTOM_QUANT_TYPE=te_nvfp4: stochastic rounding of gradients never draws from torch's
    default generator (dropout and init stay the unemulated run's) and is reproducible per
    session; te_fp8_delayed's scale follows the previous iteration's amax; TE recipes leave
    attention unquantized."""
    from quant import recipes
    from tensor_capture import emulation
    from tensor_capture.state import STATE

    dy = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    try:
        saver_mod.configure(enabled=False, save_dir=str(tmp_path), quant_type="te_nvfp4")
        assert STATE.emulate and not STATE.emulate_attention
        before = torch.get_rng_state()
        a = emulation.quantize_operand(dy, "grad_output", "dgrad", iteration=0)
        assert torch.equal(torch.get_rng_state(), before)
        gen = torch.Generator().manual_seed(emulation.STOCHASTIC_SEED)
        assert torch.equal(a, recipes.quantize_operand(dy, "te_nvfp4", "grad_output", "dgrad",
                                                       generator=gen))
        b = emulation.quantize_operand(dy, "grad_output", "dgrad", iteration=0)
        assert not torch.equal(a, b)                      # the stream moves on
        saver_mod.configure(enabled=False, save_dir=str(tmp_path), quant_type="te_nvfp4")
        assert torch.equal(emulation.quantize_operand(dy, "grad_output", "dgrad"), a)

        saver_mod.configure(enabled=False, save_dir=str(tmp_path), quant_type="te_fp8_delayed")
        x = torch.full((4, 16), 3.0)
        y0 = emulation.quantize_operand(x, "input", "forward", site="fc1", iteration=5)
        assert torch.equal(y0, x)                         # first step: scale 1
        emulation.quantize_operand(2 * x, "input", "forward", site="fc1", iteration=5)
        y1 = emulation.quantize_operand(x, "input", "forward", site="fc1", iteration=6)
        st = recipes.DelayedScalingState()
        recipes.quantize_operand(6 * torch.ones(1, 1), "te_fp8_delayed", "input", "fprop",
                                 state=st, key="k")       # iteration 5's amax is 6
        st.update()
        assert torch.equal(y1, recipes.quantize_operand(x, "te_fp8_delayed", "input", "fprop",
                                                        state=st, key="k"))
        assert emulation.quantize(x, -1) is x             # attention: not quantized under te_*
    finally:
        saver_mod.reset_tensor_saver()
