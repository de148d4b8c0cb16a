"""Tokenizers that work offline: a byte-level BPE trained here on the corpus, or a local HF directory.

Why our own BPE: the default run must train on a fresh machine with nothing downloaded, and
``tokenizers``/``transformers`` are optional. Byte-level means every string encodes (no unknown
token) and decode(encode(s)) == s exactly.

Ids: 0..255 are the raw bytes, then one id per learned merge in the order learned, then the
special tokens ``<eod>`` and ``<pad>``.
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Iterable, Protocol

from lowp_common import atomic_write_text

from .errors import UserError

BPE_FILE_NAME = "lowp_bpe_tokenizer.json"
BPE_FORMAT = "megatron-lowp-byte-bpe"
# Chunks merges never cross: a word with its leading space, a run of up to 3 digits,
# a run of punctuation with its leading space, or whitespace.
_CHUNK = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|\s+(?!\S)|\s+|_+")
HF_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer(Protocol):
    """What the driver and the preprocessing need from a tokenizer."""

    vocab_size: int
    eod: int
    pad: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def _chunks(text: str) -> list[bytes]:
    return [m.group(0).encode("utf-8") for m in _CHUNK.finditer(text)]


class ByteBPETokenizer:
    """Byte-level BPE: ``merges[k] = (a, b)`` makes id ``256 + k`` from ids a and b."""

    def __init__(self, merges: list[tuple[int, int]]):
        self.merges = [(int(a), int(b)) for a, b in merges]
        self.ranks = {pair: k for k, pair in enumerate(self.merges)}
        self.eod = 256 + len(self.merges)
        self.pad = self.eod + 1
        self.vocab_size = self.pad + 1
        self._piece: list[bytes] = [bytes([i]) for i in range(256)]
        for a, b in self.merges:
            self._piece.append(self._piece[a] + self._piece[b])
        self._cache: dict[bytes, list[int]] = {}

    # -- encoding ---------------------------------------------------------------------------
    def _encode_chunk(self, chunk: bytes) -> list[int]:
        cached = self._cache.get(chunk)
        if cached is not None:
            return cached
        ids = list(chunk)
        ranks = self.ranks
        while len(ids) > 1:
            best = min(zip(ids, ids[1:]), key=lambda p: ranks.get(p, 1 << 30))
            rank = ranks.get(best)
            if rank is None:
                break
            ids = _merge(ids, best, 256 + rank)
        if len(self._cache) < 200_000:
            self._cache[chunk] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for chunk in _chunks(text):
            out.extend(self._encode_chunk(chunk))
        return out

    def decode(self, ids: Iterable[int]) -> str:
        pieces = [self._piece[i] for i in ids if 0 <= i < len(self._piece)]
        return b"".join(pieces).decode("utf-8", errors="replace")

    # -- persistence ------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``lowp_bpe_tokenizer.json`` into ``directory`` (atomically); returns its path."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        path = d / BPE_FILE_NAME
        atomic_write_text(path, json.dumps({
            "format": BPE_FORMAT, "version": 1, "merges": self.merges,
            "special_tokens": {"<eod>": self.eod, "<pad>": self.pad},
        }))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "ByteBPETokenizer":
        p = Path(path)
        if p.is_dir():
            p = p / BPE_FILE_NAME
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"{p}: cannot read the tokenizer ({exc}); pass a tokenizer directory "
                            "made by preprocess-corpus or a Hugging Face tokenizer directory")
        if not isinstance(data, dict) or data.get("format") != BPE_FORMAT:
            raise UserError(f"{p}: not a {BPE_FORMAT} tokenizer file")
        return cls([tuple(m) for m in data["merges"]])


def _merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    out: list[int] = []
    i, n = 0, len(ids)
    a, b = pair
    while i < n:
        if i + 1 < n and ids[i] == a and ids[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def train_bpe(texts: Iterable[str], vocab_size: int = 1024, min_frequency: int = 2,
              progress: bool = False) -> ByteBPETokenizer:
    """Learn merges until ``vocab_size`` ids (bytes + merges + 2 specials) or no pair repeats.

    Counts adjacent pairs once per distinct chunk weighted by its frequency, and after each merge
    updates only the chunks that contained the merged pair. Ties break on the smaller pair, so
    the same corpus always gives the same tokenizer.
    """
    if vocab_size < 258:
        raise UserError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least 258")
    counts: Counter[bytes] = Counter()
    for text in texts:
        counts.update(_chunks(text))
    words = [list(w) for w in counts]
    freqs = list(counts.values())
    pair_count: Counter[tuple[int, int]] = Counter()
    where: dict[tuple[int, int], set[int]] = {}
    for wi, w in enumerate(words):
        for p in zip(w, w[1:]):
            pair_count[p] += freqs[wi]
            where.setdefault(p, set()).add(wi)

    n_merges = vocab_size - 258
    merges: list[tuple[int, int]] = []
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=n_merges, desc="training tokenizer", unit="merge", leave=False)
    while len(merges) < n_merges and pair_count:
        best = max(pair_count.items(), key=lambda kv: (kv[1], (-kv[0][0], -kv[0][1])))
        pair, count = best
        if count < min_frequency:
            break
        new_id = 256 + len(merges)
        merges.append(pair)
        for wi in list(where.get(pair, ())):
            w, f = words[wi], freqs[wi]
            for p in zip(w, w[1:]):
                pair_count[p] -= f
                if pair_count[p] <= 0:
                    del pair_count[p]
                s = where.get(p)
                if s is not None:
                    s.discard(wi)
            w = _merge(w, pair, new_id)
            words[wi] = w
            for p in zip(w, w[1:]):
                pair_count[p] += f
                where.setdefault(p, set()).add(wi)
        pair_count.pop(pair, None)
        where.pop(pair, None)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return ByteBPETokenizer(merges)


class HFTokenizer:
    """A local Hugging Face tokenizer directory (e.g. model/llama3.2-1b); never downloads."""

    def __init__(self, directory: str | os.PathLike[str]):
        try:
            from transformers import AutoTokenizer  # optional dependency
        except ImportError:
            raise UserError(f"{directory} is a Hugging Face tokenizer directory, but the "
                            "'transformers' package is not installed: pip install transformers "
                            "(or omit the tokenizer to train one on the corpus)") from None
        try:
            self._tok = AutoTokenizer.from_pretrained(os.fspath(directory), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any load failure is a bad directory
            raise UserError(f"{directory}: cannot load the Hugging Face tokenizer ({exc})") from None
        eos = self._tok.eos_token_id
        if eos is None:
            raise UserError(f"{directory}: the tokenizer has no end-of-text token (eos_token)")
        self.eod = int(eos)
        pad = self._tok.pad_token_id
        self.pad = int(pad) if pad is not None else self.eod
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Our BPE (a directory holding lowp_bpe_tokenizer.json, or that file) or a local HF directory."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"tokenizer path {p} does not exist: pass a tokenizer directory, or run "
                        "preprocess-corpus without --tokenizer to train one on the corpus")
    if p.is_file() or (p / BPE_FILE_NAME).is_file():
        return ByteBPETokenizer.load(p)
    if any((p / marker).is_file() for marker in HF_MARKERS):
        return HFTokenizer(p)
    raise UserError(f"{p}: no tokenizer found (expected {BPE_FILE_NAME} or a Hugging Face "
                    f"tokenizer: one of {', '.join(HF_MARKERS)})")


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
