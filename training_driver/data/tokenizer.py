"""Tokenizers: a byte-level BPE trained on the corpus with Hugging Face ``tokenizers``, or a local
Hugging Face tokenizer directory.

Why this format: the directory ``preprocess-corpus`` writes (``tokenizer.json`` +
``tokenizer_config.json``) is what ``transformers.AutoTokenizer.from_pretrained(DIR)`` loads,
which is what Megatron-LM's ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``
calls, so our driver and a real ``pretrain_gpt.py`` see the same ids. Our own loop reads
``tokenizer.json`` with the ``tokenizers`` library alone (no ``transformers`` needed).
Byte-level means every string encodes (no unknown token) and decode(encode(s)) == s exactly.

Ids of a trained tokenizer: the special tokens first (``<|endoftext|>`` = 0, ``<|pad|>`` = 1),
then the 256 byte symbols, then one id per learned merge.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Protocol

from lowp_common import atomic_write_text
from lowp_common.cli import UserError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOD_TOKEN, PAD_TOKEN)
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
#: The file our own BPE (before the Hugging Face format) wrote; such a directory is refused.
OLD_FORMAT_FILE = "lowp_bpe_tokenizer.json"
HF_MARKERS = (TOKENIZER_FILE, CONFIG_FILE, "tokenizer.model", "vocab.json")
RERUN = "re-run preprocess-corpus on the corpus (without --tokenizer) to write a new tokenizer and dataset"


class Tokenizer(Protocol):
    """What the driver and the preprocessing need from a tokenizer."""

    vocab_size: int
    eod: int
    pad: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def _require_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise UserError("the 'tokenizers' package is not installed: pip install tokenizers "
                        "(a dependency of megatron-lowp-tools)") from None
    return tokenizers


def _token_content(value) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A ``tokenizer.json`` directory read with ``tokenizers`` (ours, or e.g. model/llama3.2-1b)."""

    def __init__(self, directory: str | os.PathLike[str]):
        tokenizers = _require_tokenizers()
        self.directory = Path(directory)
        path = self.directory / TOKENIZER_FILE
        try:
            self._tok = tokenizers.Tokenizer.from_file(os.fspath(path))
        except Exception as exc:
            raise UserError(f"{path}: cannot load the tokenizer ({str(exc).splitlines()[0]}); "
                            f"{RERUN}") from None
        config = _read_json(self.directory / CONFIG_FILE) or {}
        special = _read_json(self.directory / SPECIAL_TOKENS_FILE) or {}
        eos = _token_content(config.get("eos_token")) or _token_content(special.get("eos_token"))
        eod = self._tok.token_to_id(eos) if eos else None
        if eod is None:
            raise UserError(f"{self.directory}: the tokenizer names no end-of-text token "
                            f"(eos_token in {CONFIG_FILE}); add one or {RERUN}")
        self.eod = int(eod)
        pad_name = _token_content(config.get("pad_token")) or _token_content(special.get("pad_token"))
        pad = self._tok.token_to_id(pad_name) if pad_name else None
        self.pad = int(pad) if pad is not None else self.eod
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.fingerprint = hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class TransformersTokenizer:
    """A Hugging Face directory without ``tokenizer.json`` (e.g. only a sentencepiece model)."""

    def __init__(self, directory: str | os.PathLike[str]):
        try:
            from transformers import AutoTokenizer  # optional dependency
        except ImportError:
            raise UserError(f"{directory} is a Hugging Face tokenizer directory without "
                            f"{TOKENIZER_FILE}, and the 'transformers' package is not installed: "
                            "pip install transformers (or omit the tokenizer to train one on the "
                            "corpus)") from None
        try:
            self._tok = AutoTokenizer.from_pretrained(os.fspath(directory), local_files_only=True)
        except Exception as exc:
            raise UserError(f"{directory}: cannot load the Hugging Face tokenizer "
                            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        eos = self._tok.eos_token_id
        if eos is None:
            raise UserError(f"{directory}: the tokenizer has no end-of-text token (eos_token)")
        self.eod = int(eos)
        pad = self._tok.pad_token_id
        self.pad = int(pad) if pad is not None else self.eod
        self.vocab_size = len(self._tok)
        self.fingerprint = ""

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not readable JSON ({exc}); {RERUN}") from None
    return data if isinstance(data, dict) else None


def train_bpe(texts: Iterable[str], vocab_size: int = 1024, min_frequency: int = 2,
              progress: bool = False):
    """Train a byte-level BPE with Hugging Face ``tokenizers``; returns a ``tokenizers.Tokenizer``.

    No normalizer and a byte-level pre-tokenizer without an added prefix space, so decoding
    gives back the input byte for byte. Save it with :func:`save_tokenizer`.
    """
    if vocab_size < MIN_VOCAB:
        raise UserError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least "
                        f"{MIN_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    tokenizers = _require_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=progress)
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def save_tokenizer(tok, directory: str | os.PathLike[str], max_length: int = 1 << 20) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

    The config names ``PreTrainedTokenizerFast`` and the special tokens, and turns off
    ``clean_up_tokenization_spaces`` so ``AutoTokenizer.decode`` is exact. Each file is written
    atomically; returns the directory.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_text(d / TOKENIZER_FILE, tok.to_str(pretty=False))
    specials = {"eos_token": EOD_TOKEN, "pad_token": PAD_TOKEN}
    atomic_write_text(d / CONFIG_FILE, json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", **specials,
        "clean_up_tokenization_spaces": False, "add_prefix_space": False,
        "model_max_length": max_length, "made_by": "megatron-lowp-tools preprocess-corpus",
    }, indent=2) + "\n")
    atomic_write_text(d / SPECIAL_TOKENS_FILE, json.dumps(specials, indent=2) + "\n")
    stale = d / OLD_FORMAT_FILE
    if stale.is_file():  # an old-format file left in the same folder would confuse readers
        stale.unlink()
    return d


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """A directory holding ``tokenizer.json`` (read with ``tokenizers``), else a local
    Hugging Face directory (read with ``transformers``); our old format is refused."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"tokenizer path {p} does not exist: pass a tokenizer directory, or run "
                        "preprocess-corpus without --tokenizer to train one on the corpus")
    if p.is_file():
        if p.name == OLD_FORMAT_FILE:
            raise old_format_error(p.parent)
        if p.name == TOKENIZER_FILE:
            return HFTokenizer(p.parent)
        raise UserError(f"tokenizer path {p} is a file: pass the directory that holds "
                        f"{TOKENIZER_FILE}")
    if (p / TOKENIZER_FILE).is_file():
        return HFTokenizer(p)
    if (p / OLD_FORMAT_FILE).is_file():
        raise old_format_error(p)
    if any((p / marker).is_file() for marker in HF_MARKERS):
        return TransformersTokenizer(p)
    raise UserError(f"{p}: no tokenizer found (expected a Hugging Face tokenizer directory: one "
                    f"of {', '.join(HF_MARKERS)})")


def old_format_error(directory: Path) -> UserError:
    return UserError(f"{directory} holds an old-format tokenizer ({OLD_FORMAT_FILE}, this "
                     "project's own BPE, which Hugging Face and Megatron-LM cannot load); "
                     f"{RERUN}")


def is_current_tokenizer_dir(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` holds a tokenizer this version writes (for reusing prepared data)."""
    p = Path(path)
    return (p / TOKENIZER_FILE).is_file() and (p / CONFIG_FILE).is_file()


def megatron_tokenizer(tok: Tokenizer, fingerprint: str = ""):
    """Wrap ``tok`` in megatron.core's tokenizer base class, which GPTDatasetConfig expects.

    ``fingerprint`` goes into megatron's dataset cache key, so re-preprocessed data under the
    same prefix never reuses stale sample indices.
    """
    from megatron.core.tokenizers import MegatronTokenizerBase

    class _Adapter(MegatronTokenizerBase):
        def __init__(self) -> None:
            super().__init__(path="", config={})
            self.unique_identifiers = {"class": type(tok).__name__, "vocab_size": tok.vocab_size,
                                       "eod": tok.eod, "data_fingerprint": fingerprint}

        def tokenize(self, text: str) -> list[int]:
            return tok.encode(text)

        def detokenize(self, ids: list[int]) -> str:
            return tok.decode(ids)

        @property
        def vocab(self):  # megatron asks only for sizes and special ids
            return {}

        @property
        def vocab_size(self) -> int:
            return tok.vocab_size

        @property
        def eod(self) -> int:
            return tok.eod

        @property
        def pad(self) -> int:
            return tok.pad

        def apply_chat_template(self, *args, **kwargs):
            raise NotImplementedError("no chat template: pretraining only")

    return _Adapter()
