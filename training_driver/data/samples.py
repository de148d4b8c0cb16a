"""Training data: megatron.core's GPTDataset over an indexed dataset, addressed by iteration.

Sample ``k`` of the run is the k-th sample of the GPTDataset (shuffled by megatron with the run's
seed). Iteration ``it``, micro-batch ``m`` on data-parallel rank ``r`` reads samples
``it*G + m*B*D + r*B + [0, B)`` (G global batch, B micro batch, D data-parallel size), so a
resumed run reads exactly the samples the uninterrupted run would have, with no iterator state.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lowp_common.cli import UserError

from .tokenizer import OLD_FORMAT_FILE, RERUN, Tokenizer, megatron_tokenizer


def check_data_prefix(prefix: str) -> None:
    missing = [s for s in (".bin", ".idx") if not Path(prefix + s).is_file()]
    if missing:
        raise UserError(f"data path {prefix} has no {' / '.join(prefix + s for s in missing)}: pass "
                        "the prefix written by preprocess-corpus (ending in _text_document)")


def check_tokenizer_matches(prefix: str, tokenizer: Tokenizer) -> None:
    """Refuse data whose ``.meta.json`` (written by preprocess-corpus) names another tokenizer.

    Data without the record (made by Megatron-LM's own tools) is accepted as it is, unless an
    old-format tokenizer sits where an older preprocess-corpus saved it (``PREFIX's
    folder/tokenizer``): its ids are that tokenizer's, which no current tokenizer reproduces.
    """
    import json

    meta_path = Path(prefix + ".meta.json")
    if not meta_path.is_file():
        old = Path(prefix).parent / "tokenizer" / OLD_FORMAT_FILE
        if old.is_file():
            raise UserError(f"data path {prefix} has no {meta_path.name} record and lies beside "
                            f"the old-format tokenizer {old}: an older preprocess-corpus made it "
                            f"with ids no tokenizer of this version reproduces; {RERUN}")
        return
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{meta_path}: not readable JSON ({exc}); re-run preprocess-corpus") from None
    want, have = meta.get("tokenizer_fingerprint"), getattr(tokenizer, "fingerprint", "")
    if (want and have and want != have) or meta.get("vocab_size", tokenizer.vocab_size) != tokenizer.vocab_size:
        raise UserError(f"data path {prefix} was tokenized with another tokenizer "
                        f"({meta.get('tokenizer')}, vocabulary {meta.get('vocab_size')}) than the "
                        f"one given (vocabulary {tokenizer.vocab_size}): pass that tokenizer, or "
                        "re-run preprocess-corpus to make both again")


def _ensure_helpers() -> None:
    """megatron's sample index builder is C++; wheels ship it compiled, source installs may not."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")   # compiled already?
    except ImportError:
        try:
            from megatron.core.datasets.utils import compile_helpers

            compile_helpers()
            importlib.import_module("megatron.core.datasets.helpers_cpp")
        except Exception as exc:
            raise UserError("megatron-core's dataset helpers (helpers_cpp) are not compiled and "
                            f"building them failed ({exc}); install a megatron-core wheel or run "
                            "'make' in megatron/core/datasets") from None


def _fingerprint(prefix: str) -> str:
    """Hash of the index file: changes whenever the data is re-preprocessed."""
    import hashlib

    return hashlib.sha256(Path(prefix + ".idx").read_bytes()).hexdigest()[:16]


@dataclass
class BatchPlan:
    micro_batch_size: int
    num_micro_batches: int
    data_parallel_size: int
    data_parallel_rank: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_micro_batches * self.data_parallel_size

    def sample_indices(self, iteration: int, micro_batch: int) -> range:
        start = (iteration * self.global_batch_size
                 + micro_batch * self.micro_batch_size * self.data_parallel_size
                 + self.data_parallel_rank * self.micro_batch_size)
        return range(start, start + self.micro_batch_size)


def build_gpt_dataset(prefix: str, tokenizer: Tokenizer, seq_length: int, num_samples: int,
                      seed: int, cache_dir: str | None = None):
    """A megatron.core GPTDataset with ``num_samples`` samples of ``seq_length`` tokens.

    Every rank calls this (megatron builds the index on rank 0 first, then the others read it).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    check_data_prefix(prefix)
    check_tokenizer_matches(prefix, tokenizer)
    _ensure_helpers()
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split="100,0,0",
        path_to_cache=cache_dir or os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache"),
        tokenizer=megatron_tokenizer(tokenizer, _fingerprint(prefix)),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_samples, None, None], lambda: True, config
    ).build()
    if train is None or len(train) < num_samples:
        raise UserError(f"data path {prefix}: too little data for {num_samples} samples of "
                        f"{seq_length} tokens")
    return train


def get_micro_batch(dataset, plan: BatchPlan, iteration: int, micro_batch: int,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """tokens, labels, loss_mask of one micro-batch ([b, s] each)."""
    samples = [dataset[i] for i in plan.sample_indices(iteration, micro_batch)]
    return {key: torch.stack([s[key] for s in samples]).to(device)
            for key in ("tokens", "labels", "loss_mask")}
