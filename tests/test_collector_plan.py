"""The collector's library steps called directly (no training process): the request from the
command line, the plan before launch, and the exit code of a finished run."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from training_helpers import small_data  # noqa: F401

from lowp_common.cli import UserError
from training_driver.capture import PATCHED_DIR_ENV
from training_driver.collector import (
    Collection,
    CollectionResult,
    CollectRequest,
    build_parser,
    capture_env,
    plan_collection,
    report_collection,
    request_from_args,
)
from training_driver.preflight import CHECKED_ENV
from training_driver.tensor_summary import TensorSummary

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")   # megatron-core without TE/Apex


@pytest.fixture(autouse=True)
def _no_collector_env(monkeypatch):
    for var in ("TENSOR_SAVE_DIR", "CUSTOM_QUANT_TYPE", "TENSOR_SAVER_ITERATION", "MASTER_PORT",
                "TENSOR_SAVE_CONFIG", "TENSOR_SAVE_ENABLED"):
        monkeypatch.delenv(var, raising=False)


def test_request_defaults_are_the_parsers() -> None:
    """CollectRequest's defaults and the command line's are one setting (the library and the
    command run the same collection when given nothing)."""
    assert request_from_args(build_parser().parse_args([]), []) == CollectRequest()
    req = request_from_args(build_parser().parse_args(["--nproc", "2", "--no-visualize"]),
                            ["--lr", "1e-3"])
    assert (req.nproc, req.visualize, req.passthrough) == (2, False, ("--lr", "1e-3"))


def test_capture_env_turns_capture_on_and_keeps_an_explicit_compile() -> None:
    req = CollectRequest(tensor_dir="t", quant_type="mxfp8", saver_iteration="7")
    env = capture_env(req, {"QUANT_COMPILE": "1", "KEEP": "x"})
    assert env == {"QUANT_COMPILE": "1", "KEEP": "x", "TENSOR_SAVE_ENABLED": "true",
                   "TENSOR_SAVE_DIR": "t", "CUSTOM_QUANT_TYPE": "mxfp8",
                   "TENSOR_SAVER_ITERATION": "7"}
    assert capture_env(CollectRequest(), {})["QUANT_COMPILE"] == "0"


def test_plan_collection_builds_the_run_without_launching(small_data, tmp_path) -> None:
    req = CollectRequest(data_path=small_data["data_path"], tokenizer=small_data["tokenizer"],
                         tensor_dir=str(tmp_path / "tensors"), workdir=str(tmp_path / "work"),
                         ignore_resource_check=True, train_iters=3, seq_length=32,
                         passthrough=("--lr", "1e-3"))
    c = plan_collection(req, base_env={PATCHED_DIR_ENV: str(tmp_path / "patched")})
    assert (c.embedded, c.visualize) == (False, False)
    assert c.tensor_dir.is_dir() and not c.progress_file.exists()
    assert c.env["TENSOR_SAVE_ENABLED"] == "true" and c.env[CHECKED_ENV] == "1"
    assert c.env["TENSOR_SAVE_DIR"] == str(tmp_path / "tensors")
    assert "PYTHONPATH" not in c.env          # a patched tree given: not built, not prepended
    assert c.cmd[:3] == [sys.executable, "-m", "training_driver.train"]
    args = c.cmd[3:]
    assert args[args.index("--data-path") + 1] == small_data["data_path"]
    assert args[args.index("--train-iters") + 1] == "3"
    assert args[args.index("--seq-length") + 1] == "32"
    assert args[args.index("--stop-file") + 1] == str(c.stop_file)
    assert args[-2:] == ["--lr", "1e-3"]      # the passthrough last: it overrides


@pytest.mark.parametrize("kw,message", [
    (dict(nproc=0), "at least 1"),
    (dict(timeout=0), "positive"),
    (dict(tokenizer="tok"), "--tokenizer without --data-path"),
    (dict(data_path="data"), "--data-path needs --tokenizer"),
])
def test_plan_collection_refuses_mistakes(kw, message, tmp_path) -> None:
    req = CollectRequest(workdir=str(tmp_path / "work"), tensor_dir=str(tmp_path / "t"), **kw)
    with pytest.raises(UserError, match=message):
        plan_collection(req, base_env={})
    assert not (tmp_path / "t").exists()      # refused before anything was made


def _finished(tmp_path: Path, outcome: str, files: int, returncode: int | None = 0,
              min_files: int = 10) -> int:
    req = CollectRequest(min_files=min_files)
    c = Collection(req, {}, [], tmp_path, tmp_path / "p.json", tmp_path / "stop", False, False)
    return report_collection(c, CollectionResult(outcome, returncode, 1, set(),
                                                 TensorSummary(files=files)))


def test_report_collection_exit_codes(tmp_path, capsys) -> None:
    assert _finished(tmp_path, "collected", files=12) == 0
    assert "tensor summary for" in capsys.readouterr().out
    assert _finished(tmp_path, "interrupted", files=3) == 130
    assert "3 tensor files saved so far are intact" in capsys.readouterr().err
    assert _finished(tmp_path, "failed", files=0, returncode=3) == 3
    assert _finished(tmp_path, "failed", files=0, returncode=None) == 1
    assert _finished(tmp_path, "finished", files=4) == 1
    assert "only 4 tensor files were saved (wanted 10)" in capsys.readouterr().err
