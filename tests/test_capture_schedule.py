"""Iteration and sample numbers from megatron-core's own schedule (no saver call in the loop).

A patched megatron-core 0.16.1 copy; ``get_forward_backward_func()`` (the no-pipelining
schedule) runs 3 iterations x 2 micro-batches of a tiny Llama GPTModel per scenario.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from capture_runtime_helpers import run_worker, schedule_worker

from tensor_capture import schema
from tensor_capture.patcher import prepare_patched_megatron


@pytest.fixture(scope="module")
def sched(tmp_path_factory):
    patched = str(prepare_patched_megatron(tmp_path_factory.mktemp("patched")))
    out = tmp_path_factory.mktemp("schedule")
    return run_worker(schedule_worker, patched, out, "schedule"), out


def _recs(directory):
    return list(schema.read_manifest(directory))


def test_three_iterations_two_samples_with_no_saver_call(sched):
    r, out = sched
    recs = _recs(out / "auto3")
    assert sorted({rec["iteration"] for rec in recs}) == [0, 1, 2]
    for rec in recs:                          # names and metadata agree
        name = schema.parse_filename(rec["file"])
        assert (name.iteration, name.sample_idx) == (rec["iteration"], rec["sample_idx"])
    per = Counter((rec["iteration"], rec["sample_idx"]) for rec in recs)
    assert set(per) == {(i, s) for i in range(3) for s in (0, 1)}
    # every (iteration, sample) holds the same tensors: forward and backward of one micro-batch,
    # and the evaluation call after iteration 0 captured nothing and consumed no iteration
    assert len(set(per.values())) == 1
    keys = {(rec["module_path"], rec["operation"], rec["phase"], rec["tensor_name"])
            for rec in recs if rec["iteration"] == 1 and rec["sample_idx"] == 0}
    assert ("decoder.layers.0.mlp.linear_fc1", "backward", "post", "grad_weight") in keys
    assert ("decoder.layers.1.self_attention.core_attention", "backward", "post", "grad_query") in keys
    err = r["stderr_auto3"]
    assert "tensor capture: tensors and statistics of" in err and "at most 3 saved iteration" in err
    assert "stopped after iteration 2 (max_iterations=3 reached): 3 iteration(s) saved (0..2)" in err


def test_capture_changes_no_number(sched):
    r, _ = sched
    for a, b in zip(r["train_auto3"], r["train_default"]):
        assert torch.equal(a, b)


def test_only_enabled_is_bounded_by_default(sched):
    r, out = sched
    assert {rec["iteration"] for rec in _recs(out / "default")} == {0}
    err = r["stderr_default"].strip().splitlines()
    start = [ln for ln in err if "tensor capture: tensors" in ln]
    assert len(start) == 1
    assert "at most 1 saved iteration(s) (default: min_iterations)" in start[0]
    assert "of files per rank (default: 50% of" in start[0] and str(out / "default") in start[0]
    stop = [ln for ln in err if "stopped after" in ln]
    assert stop == [ln for ln in err if "stopped after iteration 0 (max_iterations=1 reached)" in ln]
    assert len(stop) == 1


def test_resume_from_megatron_args_and_the_environment_override(sched):
    _, out = sched
    assert sorted({rec["iteration"] for rec in _recs(out / "resume")}) == [5, 6]
    assert sorted({rec["iteration"] for rec in _recs(out / "override")}) == [10, 11]


def test_pre_quantization_warning_once_per_module_operand_and_format_and_no_change(sched):
    r, _ = sched
    err = r["stderr_warn_mxfp4"]
    heads = [ln for ln in err.splitlines() if ln.startswith("tensor capture: iteration ")]

    def parse(head):   # "tensor capture: iteration 1, linear dgrad weight decoder.layers.0...: ..."
        where, said = head[len("tensor capture: "):].split(": ", 1)
        it, rest = where.split(", ", 1)
        words = rest.split()
        level = ("none" if "back within the margin" in said
                 else said.split("severity ")[1].split(",")[0].split(";")[0].lower())
        return int(it.split()[1]), " ".join(words[:-1]), words[-1], level

    said: dict = {}
    for h in heads:                                            # one line each, judged in dB
        it, kind, module, level = parse(h)
        assert module.startswith(("decoder.", "output_layer")) and " dB" in h
        assert said.get((kind, module)) != level               # again only when the level changes
        said[(kind, module)] = level
    assert "tensor capture: iteration" not in r["stderr_quiet_mxfp4"]
    for a, b in zip(r["train_warn_mxfp4"], r["train_quiet_mxfp4"]):
        assert torch.equal(a, b)                               # the warning never changes a result
    assert not torch.equal(r["train_warn_mxfp4"][0], r["train_default"][0])   # mxfp4 is emulated


def test_pipelining_schedule_two_stages(tmp_path_factory, sched):
    """1F1B over 2 pipeline stages (2 processes, gloo isend/irecv): each stage numbers the
    micro-batches it runs, forward and backward alike."""
    from capture_runtime_helpers import run_pipeline

    patched = str(prepare_patched_megatron(tmp_path_factory.mktemp("patched_pp")))
    out = tmp_path_factory.mktemp("pp")
    res = run_pipeline(patched, out)
    assert {r["schedule"] for r in res} == {"forward_backward_pipelining_without_interleaving"}
    recs = list(schema.read_manifest(out / "pp"))
    for stage in (0, 1):
        mine = [r for r in recs if r["pp_rank"] == stage]
        per = Counter((r["iteration"], r["sample_idx"]) for r in mine)
        assert set(per) == {(i, s) for i in range(3) for s in (0, 1)}
        assert len(set(per.values())) == 1
        for phase_op in ("forward", "backward"):
            assert {(r["iteration"], r["sample_idx"]) for r in mine
                    if r["operation"] == phase_op} == set(per)
    paths = {stage: {r["module_path"] for r in recs if r["pp_rank"] == stage} for stage in (0, 1)}
    assert "output_layer" in paths[1] and "output_layer" not in paths[0]
    layers = {stage: {r["layer_idx"] for r in recs if r["pp_rank"] == stage
                      and r["layer_type"] == "attention"} for stage in (0, 1)}
    assert layers == {0: {0}, 1: {1}}                 # global 0-based layer indexes


def test_wrap_schedule_counts_samples_per_model_chunk(tmp_path):
    """Interleaved order (chunk 0 then chunk 1 per micro-batch, backwards later): micro-batch m
    is sample m in every chunk; forward_only calls neither count nor capture."""
    from tensor_capture import numbering
    from tensor_capture import saver as saver_mod
    from tensor_capture.state import STATE

    s = saver_mod.configure(enabled=True, save_dir=str(tmp_path), max_iterations="unlimited")
    try:
        seen = []

        def forward_step(data_iterator, model, checkpoint_activations_microbatch=None):
            seen.append((model, s.sample_idx, s.iteration, STATE.paused))
            return None, None

        def schedule(*, forward_step_func, data_iterator, model, num_microbatches,
                     forward_only=False, **_):
            for m in range(num_microbatches):
                for chunk in model:
                    forward_step_func(data_iterator, chunk)
            return []

        wrapped = numbering.wrap_schedule(schedule)
        assert numbering.wrap_schedule(wrapped) is wrapped           # never wrapped twice
        chunks = ["c0", "c1"]
        for _ in range(2):
            wrapped(forward_step_func=forward_step, data_iterator=None, model=chunks,
                    num_microbatches=3)
            wrapped(forward_step_func=forward_step, data_iterator=None, model=chunks,
                    num_microbatches=1, forward_only=True)
        train = [x for x in seen if not x[3]]
        assert train == [(c, m, it, False) for it in (0, 1) for m in range(3) for c in chunks]
        assert [x[2] for x in seen if x[3]] == [0, 0, 1, 1]          # evaluation: no new iteration
        assert numbering._n().next_iteration == 2 and s.sample_idx is None
    finally:
        saver_mod.reset_tensor_saver()
