"""Shared pieces of the training tests: a small real-text dataset built once per session."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUIET = ("ignore:Transformer Engine and Apex are not installed,ignore:Apex is not installed,"
         "ignore:full scope is deprecated")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a child process: no capture variables unless asked, project importable."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TENSOR_SAVE", "TENSOR_SAVER", "CUSTOM_QUANT", "MEGATRON_LOWP",
                                "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONWARNINGS"] = QUIET
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=clean_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def one_error_line(stderr: str) -> str:
    """The stderr lines that are not warnings; a user mistake must give exactly one."""
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    assert "Traceback" not in stderr, stderr
    return lines[-1] if lines else ""


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> dict[str, str]:
    """~60 KB of the default corpus, a 384-token BPE, and the indexed dataset."""
    from training_driver.data.corpus import write_builtin_corpus
    from training_driver.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("training_data")
    corpus = root / "corpus.jsonl"
    write_builtin_corpus(corpus, max_chars=60_000)
    summary = preprocess([str(corpus)], str(root / "data" / "docs"), vocab_size=384, progress=False)
    return {"root": str(root), "corpus": str(corpus), "data_path": summary["data_prefix"],
            "tokenizer": summary["tokenizer"]}
