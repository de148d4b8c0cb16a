"""The training loop on real megatron-core: learning, resume reproducibility, parallelism, bad input."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.multiprocessing as mp
from training_helpers import clean_env, one_error_line, run, small_data  # noqa: F401

from lowp_common.cli import UserError
from training_driver import checkpoint
from training_driver.megatron_env import free_port
from training_driver.train import TrainConfig, check_config, main, train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _cfg(data, **kw) -> TrainConfig:
    base = dict(data_path=data["data_path"], tokenizer=data["tokenizer"], model="tiny",
                seq_length=32, micro_batch_size=2, train_iters=4, warmup_iters=1, lr=3e-3,
                min_lr=3e-4, seed=11)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(autouse=True)
def _no_capture_env(monkeypatch):
    """No capture settings in, and no rendezvous variables (set by init_distributed) left out."""
    import os

    before = {v: os.environ.get(v) for v in ("MASTER_PORT", "MASTER_ADDR")}
    for var in ("TENSOR_SAVE_ENABLED", "CUSTOM_QUANT_TYPE", "TENSOR_SAVE_DIR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    yield
    for var, value in before.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


def _model_state(ckpt_dir, iteration):
    path = ckpt_dir / f"iter_{iteration:07d}" / "model_tp00_pp00.pt"
    return torch.load(path, map_location="cpu", weights_only=True)


def test_training_learns_and_resume_is_bit_exact(small_data, tmp_path):
    straight = train(_cfg(small_data, train_iters=6, checkpoint_dir=str(tmp_path / "a"),
                          tensorboard_dir=str(tmp_path / "tb"), progress_file=str(tmp_path / "p.json")),
                     master_port=free_port())
    losses = straight["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1        # it learns
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert '"iteration": 6' in (tmp_path / "p.json").read_text()

    first = train(_cfg(small_data, train_iters=6, exit_interval=3, checkpoint_dir=str(tmp_path / "b")),
                  master_port=free_port())
    assert first["losses"] == losses[:3]
    assert checkpoint.latest_iteration(tmp_path / "b") == 3
    resumed = train(_cfg(small_data, train_iters=6, checkpoint_dir=str(tmp_path / "b")),
                    master_port=free_port())
    assert resumed["start_iteration"] == 3
    assert resumed["losses"] == losses[3:]                            # same numbers, bit for bit
    a, b = _model_state(tmp_path / "a", 6), _model_state(tmp_path / "b", 6)
    assert a["model"].keys() == b["model"].keys()
    for key, value in a["model"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b["model"][key]), key


def test_resume_with_another_shape_is_refused(small_data, tmp_path):
    train(_cfg(small_data, train_iters=1, checkpoint_dir=str(tmp_path)), master_port=free_port())
    with pytest.raises(UserError, match="hidden_size"):
        train(_cfg(small_data, train_iters=2, hidden_size=32, checkpoint_dir=str(tmp_path)),
              master_port=free_port())


def test_corrupt_checkpoint_is_a_clear_error(small_data, tmp_path):
    train(_cfg(small_data, train_iters=1, checkpoint_dir=str(tmp_path)), master_port=free_port())
    shard = tmp_path / "iter_0000001" / "model_tp00_pp00.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(UserError, match="cannot be loaded"):
        train(_cfg(small_data, train_iters=2, checkpoint_dir=str(tmp_path)), master_port=free_port())


def test_bf16_trains_with_finite_losses(small_data):
    out = train(_cfg(small_data, train_iters=2, dtype="bf16"), master_port=free_port())
    assert len(out["losses"]) == 2 and all(torch.isfinite(torch.tensor(out["losses"])))


@pytest.mark.parametrize("kw,world,message", [
    (dict(dtype="fp8"), 1, "fp8 needs a CUDA GPU"),
    (dict(pipeline_model_parallel_size=2), 2, "needs CUDA"),
    (dict(tensor_model_parallel_size=2), 3, "cannot be split"),
    (dict(tensor_model_parallel_size=8), 8, "must divide by tensor parallel size 8"),
    (dict(global_batch_size=3), 1, "multiple of micro batch size"),
    (dict(model="gpt5"), 1, "unknown"),
])
def test_config_errors(small_data, kw, world, message):
    if torch.cuda.is_available() and "CUDA" in message:
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError, match=message):
        check_config(_cfg(small_data, **kw), world, cuda=False, capture=False)


def test_cli_bad_paths_give_one_line(small_data, tmp_path, capsys):
    rc = main(["--data-path", str(tmp_path / "missing_text_document"), "--tokenizer",
               small_data["tokenizer"], "--train-iters", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "has no" in err and "preprocess-corpus" in err
    assert len(err.strip().splitlines()) == 1
    rc = main(["--data-path", small_data["data_path"], "--tokenizer", str(tmp_path / "tok")])
    err = capsys.readouterr().err
    assert rc == 2 and "tokenizer path" in err and len(err.strip().splitlines()) == 1


def test_cli_port_in_use(small_data, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = run([sys.executable, "-m", "training_driver.train", "--data-path",
                   small_data["data_path"], "--tokenizer", small_data["tokenizer"]],
                  cwd=tmp_path, timeout=120, MASTER_PORT=str(port))
    assert out.returncode == 2
    assert f"MASTER_PORT={port} is in use" in one_error_line(out.stderr)


def _parallel_worker(rank, world, ports, data, queue):
    results = {}
    for (name, kw), port in zip((("tp2", dict(tensor_model_parallel_size=2,
                                              make_vocab_size_divisible_by=64)),
                                 ("dp2", dict(global_batch_size=4))), ports):
        results[name] = train(_cfg(data, **kw), rank=rank, world_size=world, master_port=port)["losses"]
    queue.put((rank, results))


def test_tensor_and_data_parallel_match_one_process(small_data):
    """TP=2 equals TP=1; DP=2 with micro batch 2 equals one process with 2 micro-batches of 2."""
    # same padded vocabulary (384) at TP=1 and TP=2, or the models differ
    single = train(_cfg(small_data, make_vocab_size_divisible_by=64), master_port=free_port())["losses"]
    accum = train(_cfg(small_data, global_batch_size=4), master_port=free_port())["losses"]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = [free_port()]
    while len(ports) < 2:                      # two distinct ports (the kernel may repeat one)
        p = free_port()
        if p not in ports:
            ports.append(p)
    mp.spawn(_parallel_worker, args=(2, ports, small_data, queue), nprocs=2, join=True)
    results = dict(queue.get() for _ in range(2))
    assert results[0]["tp2"] == pytest.approx(single, rel=1e-5, abs=1e-5)
    assert results[0]["dp2"] == pytest.approx(accum, rel=1e-5, abs=1e-5)
    assert results[1]["dp2"] == results[0]["dp2"]          # every replica logs the same loss


def test_cli_bad_quant_type(small_data, monkeypatch, capsys):
    monkeypatch.setenv("TENSOR_SAVE_ENABLED", "true")
    monkeypatch.setenv("CUSTOM_QUANT_TYPE", "fp7")
    rc = main(["--data-path", small_data["data_path"], "--tokenizer", small_data["tokenizer"]])
    err = capsys.readouterr().err
    assert rc == 2 and "CUSTOM_QUANT_TYPE='fp7' is not a known format" in err
    assert len(err.strip().splitlines()) == 1


def test_divergence_stops_with_a_message(small_data):
    with pytest.raises(UserError, match="no longer finite"):
        train(_cfg(small_data, lr=1e30, min_lr=1e30, warmup_iters=0, clip_grad=0, train_iters=6),
              master_port=free_port())


def test_stop_file_ends_the_run_cleanly_with_a_checkpoint(small_data, tmp_path):
    stop = tmp_path / "stop"
    stop.touch()
    out = train(_cfg(small_data, train_iters=5, stop_file=str(stop), checkpoint_dir=str(tmp_path / "c")),
                master_port=free_port())
    assert len(out["losses"]) == 1
    assert checkpoint.latest_iteration(tmp_path / "c") == 1


@pytest.mark.parametrize("kw", [dict(dtype="fp8"), dict(transformer_impl="te")])
def test_emulation_on_te_linears_runs_the_custom_recipe(small_data, monkeypatch, kw):
    """CUSTOM_QUANT_TYPE never silently does nothing on Transformer Engine linears: it selects
    TE's custom recipe with our quantizer factory, and a TE too old for it is one
    line naming the version needed.

    TE needs CUDA, so its presence and version are stubbed (what this CPU cannot provide)."""
    from te_integration import factory
    from training_driver import train as train_mod
    from training_driver import train_config

    monkeypatch.setattr(train_config, "_te_available", lambda: True)   # where check_config reads it
    monkeypatch.delenv("CUSTOM_QUANT_TYPE", raising=False)
    plain = check_config(_cfg(small_data, **kw), 1, cuda=True, capture=False)
    assert plain["use_te"] and not plain["te_custom_recipe"]
    assert "fp8_recipe" not in train_mod.fp8_overrides(kw.get("dtype", "bf16"), False)
    monkeypatch.setenv("CUSTOM_QUANT_TYPE", "mxfp8")
    monkeypatch.setattr(factory, "installed_te_version", lambda: "2.20.0.dev0")
    derived = check_config(_cfg(small_data, **kw), 1, cuda=True, capture=True)
    assert derived["use_te"] and derived["te_custom_recipe"]
    assert train_mod.fp8_overrides(kw.get("dtype", "bf16"), True) == dict(
        fp8="hybrid", fp8_recipe="custom",
        fp8_quantizer_factory="te_integration.factory.quantizer_factory")
    monkeypatch.setattr(factory, "installed_te_version", lambda: "2.12.0")
    with pytest.raises(UserError, match=r"Transformer Engine 2\.12\.0 is too old .* >= 2\.16"):
        check_config(_cfg(small_data, **kw), 1, cuda=True, capture=True)
    monkeypatch.setenv("CUSTOM_QUANT_TYPE", "fp32")   # the "no emulation" name: TE's own FP8
    assert not check_config(_cfg(small_data, **kw), 1, cuda=True, capture=False)["te_custom_recipe"]
