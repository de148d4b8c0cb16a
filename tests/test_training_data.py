"""Tokenizer, default corpus, preprocessing round trip through megatron's indexed dataset."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from training_helpers import one_error_line, run, small_data  # noqa: F401 - fixture

from lowp_common.cli import UserError
from training_driver.data import preprocess as pp
from training_driver.data.corpus import builtin_documents, write_builtin_corpus
from training_driver.data.tokenizer import (
    EOD_TOKEN,
    OLD_FORMAT_FILE,
    TOKENIZER_FILE,
    HFTokenizer,
    load_tokenizer,
    save_tokenizer,
    train_bpe,
)
from training_driver.optim import lr_at

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3,
         "def f(x):\n    return x ** 2  # square\n\n",
         "naïve café — 東京 123456 🙂", "the the the then there these",
         "  leading and trailing spaces\t\r\n  ", "tabs\tand\u00a0no-break\u2028separators"]


@pytest.fixture(autouse=True)
def _no_rendezvous_env(monkeypatch):
    """llama-train's main (called in-process here) checks a MASTER_PORT it finds; tests that
    ran megatron in this process before may have left one (still bound) in the environment."""
    for var in ("MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_bpe(TEXTS * 5, vocab_size=300), d)
    return str(d)


@pytest.fixture(scope="module")
def tok(tok_dir) -> HFTokenizer:
    loaded = load_tokenizer(tok_dir)
    assert isinstance(loaded, HFTokenizer)
    return loaded


def test_bpe_learns_merges_and_round_trips(tok):
    assert 258 < tok.vocab_size <= 300
    assert (tok.eod, tok.pad) == (0, 1)          # the special tokens come first
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(2 <= i < tok.vocab_size for i in ids)
    # merges shorten frequent text: fewer ids than bytes
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0].encode()) // 2
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_bpe_round_trips_any_text(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_auto_tokenizer_loads_it_with_the_same_ids_and_exact_decode(tok_dir, tok):
    """What Megatron-LM's --tokenizer-type HuggingFaceTokenizer does: AutoTokenizer(DIR)."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(tok_dir)
    assert len(auto) == tok.vocab_size
    assert (auto.eos_token, auto.eos_token_id, auto.pad_token_id) == (EOD_TOKEN, tok.eod, tok.pad)
    for text in TEXTS:
        ids = auto(text)["input_ids"]           # default call, special tokens on: none are added
        assert ids == tok.encode(text)
        assert auto.decode(ids) == text


@settings(max_examples=40, deadline=None)
@given(st.text(max_size=60))
def test_auto_tokenizer_round_trips_any_text(tok_dir, tok, text):
    auto = _auto(tok_dir)
    ids = auto.encode(text)
    assert ids == tok.encode(text) and auto.decode(ids) == text


_AUTO: dict = {}


def _auto(path: str):
    if path not in _AUTO:
        from transformers import AutoTokenizer

        _AUTO[path] = AutoTokenizer.from_pretrained(path)
    return _AUTO[path]


def test_megatron_core_huggingface_tokenizer_reads_it(tok_dir, tok):
    """megatron-core's own HuggingFaceTokenizer wrapper agrees on vocabulary, eod and ids."""
    from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer

    mt = HuggingFaceTokenizer(tok_dir)
    assert (mt.vocab_size, mt.eod) == (tok.vocab_size, tok.eod)
    for text in TEXTS:
        assert mt.text_to_ids(text) == tok.encode(text)


def test_megatron_build_tokenizer_gives_the_dataset_ids(small_data):
    """What pretrain_gpt.py (0.16.1) calls for ``--tokenizer-type HuggingFaceTokenizer
    --tokenizer-model DIR``: megatron-core's build_tokenizer(args), the other tokenizer
    arguments at Megatron-LM 0.16.1's parser defaults. Its ids are those in our .bin."""
    import argparse

    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    args = argparse.Namespace(
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=small_data["tokenizer"],
        tokenizer_metadata=None, tokenizer_special_tokens=None, tokenizer_hf_use_fast=False,
        tokenizer_hf_include_special_tokens=False, trust_remote_code=False, vocab_file=None,
        merge_file=None, vocab_size=None, tiktoken_pattern=None, tiktoken_num_special_tokens=1000,
        tokenizer_sentencepiece_legacy=False)
    mt = build_tokenizer(args)
    ours = load_tokenizer(small_data["tokenizer"])
    assert (mt.vocab_size, mt.eod) == (ours.vocab_size, ours.eod)
    ds = IndexedDataset(small_data["data_path"])
    texts = list(pp.read_documents(small_data["corpus"]))
    assert len(ds) == len(texts) > 10
    for i, text in enumerate(texts):
        ids = ds[i].tolist()
        assert mt.tokenize(text) + [mt.eod] == ids
        assert mt.detokenize(ids[:-1]) == text


def test_bpe_is_deterministic(tmp_path, tok_dir, tok):
    save_tokenizer(train_bpe(TEXTS * 5, vocab_size=300), tmp_path)
    assert (tmp_path / TOKENIZER_FILE).read_bytes() == (Path(tok_dir) / TOKENIZER_FILE).read_bytes()
    assert load_tokenizer(tmp_path / TOKENIZER_FILE).encode(TEXTS[1]) == tok.encode(TEXTS[1])


def test_bpe_vocab_too_small():
    with pytest.raises(UserError, match="vocab-size"):
        train_bpe(TEXTS, vocab_size=100)


def test_tokenizer_path_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(UserError, match="no tokenizer found"):
        load_tokenizer(tmp_path)
    (tmp_path / TOKENIZER_FILE).write_text("{broken")
    with pytest.raises(UserError, match="cannot load the tokenizer.*re-run preprocess-corpus"):
        load_tokenizer(tmp_path)


def _old_format_dir(path: Path) -> Path:
    """What preprocess-corpus wrote before the Hugging Face format: one file of our own."""
    path.mkdir(parents=True, exist_ok=True)
    (path / OLD_FORMAT_FILE).write_text(json.dumps({
        "format": "megatron-lowp-byte-bpe", "version": 1, "merges": [[116, 104]],
        "special_tokens": {"<eod>": 257, "<pad>": 258}}))
    return path


def test_old_format_tokenizer_is_refused(tmp_path):
    old = _old_format_dir(tmp_path / "tokenizer")
    for path in (old, old / OLD_FORMAT_FILE):
        with pytest.raises(UserError, match="old-format tokenizer.*re-run preprocess-corpus"):
            load_tokenizer(path)


def test_old_format_tokenizer_one_line_exit_2(small_data, tmp_path, capsys):
    """preprocess-corpus --tokenizer OLD and llama-train --tokenizer OLD: one line, exit 2."""
    old = str(_old_format_dir(tmp_path / "tokenizer"))
    rc = pp.main(["--input", small_data["corpus"], "--output-prefix", str(tmp_path / "o"),
                  "--tokenizer", old, "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.startswith("preprocess-corpus: error:") and "old-format tokenizer" in err
    assert "re-run preprocess-corpus" in err and not (tmp_path / "o_text_document.bin").exists()
    out = run([sys.executable, "-m", "training_driver.train", "--data-path", small_data["data_path"],
               "--tokenizer", old, "--train-iters", "1"], cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "llama-train: error:" in out.stderr and "old-format tokenizer" in one_error_line(out.stderr)


def test_data_made_with_another_tokenizer_is_refused(small_data, tok_dir, tok):
    from training_driver.data.samples import check_tokenizer_matches

    check_tokenizer_matches(small_data["data_path"], load_tokenizer(small_data["tokenizer"]))
    with pytest.raises(UserError, match="tokenized with another tokenizer"):
        check_tokenizer_matches(small_data["data_path"], tok)


def test_data_beside_an_old_format_tokenizer_is_refused(small_data, tmp_path, capsys):
    """Data an older preprocess-corpus wrote (no .meta.json, the old tokenizer in PREFIX's
    folder/tokenizer) is refused even with a current tokenizer; meta-less data alone (Megatron-LM's
    own tools) is accepted."""
    import shutil

    from training_driver import train
    from training_driver.data.samples import check_tokenizer_matches

    prefix = tmp_path / "data" / "old_text_document"
    prefix.parent.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(small_data["data_path"] + suffix, str(prefix) + suffix)
    current = load_tokenizer(small_data["tokenizer"])
    check_tokenizer_matches(str(prefix), current)                 # no record, nothing beside
    _old_format_dir(prefix.parent / "tokenizer")
    with pytest.raises(UserError, match="old-format tokenizer.*re-run preprocess-corpus"):
        check_tokenizer_matches(str(prefix), current)
    rc = train.main(["--data-path", str(prefix), "--tokenizer", small_data["tokenizer"],
                     "--train-iters", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "old-format tokenizer" in err


def test_hf_directory_without_tokenizer_json_needs_transformers(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)     # import transformers -> ImportError
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(UserError, match="pip install transformers"):
        load_tokenizer(tmp_path)


def test_builtin_corpus_is_real_text_and_deterministic(tmp_path):
    docs = builtin_documents()
    assert len(docs) > 500 and sum(map(len, docs)) > 200_000
    assert builtin_documents() == docs
    words = " ".join(docs[:50]).split()
    common = {"the", "of", "and", "is", "a", "to"}
    assert sum(w.lower() in common for w in words) > 0.05 * len(words)   # English prose
    info = write_builtin_corpus(tmp_path / "c.jsonl", max_chars=5_000)
    lines = (tmp_path / "c.jsonl").read_text().splitlines()
    assert len(lines) == info["documents"] and all("text" in json.loads(l) for l in lines)
    assert 5_000 <= info["characters"] < 5_000 + max(map(len, docs))


def test_preprocess_round_trip(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    jsonl = tmp_path / "wiki.jsonl"
    jsonl.write_text("\n".join(json.dumps({"id": i, "text": t}) for i, t in enumerate(TEXTS)) + "\n\n")
    plain = tmp_path / "notes.txt"
    plain.write_text("first document\nstill first\n\n\nsecond document\n")
    summary = pp.preprocess([str(jsonl), str(plain)], str(tmp_path / "out" / "wiki"),
                            vocab_size=280, progress=False)
    assert summary["data_prefix"].endswith("wiki_text_document")
    tok = load_tokenizer(summary["tokenizer"])
    ds = IndexedDataset(summary["data_prefix"])
    expected = TEXTS + ["first document\nstill first", "second document"]
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(summary["tokenizer"])
    assert len(ds) == len(expected) == summary["documents"]
    for i, text in enumerate(expected):
        ids = ds[i].tolist()
        assert ids == tok.encode(text) + [tok.eod] == auto(text)["input_ids"] + [auto.eos_token_id]
        assert tok.decode(ids[:-1]) == text == auto.decode(ids[:-1])
    assert ds[0].dtype == np.uint16
    # re-using the saved tokenizer gives the same ids
    again = pp.preprocess([str(jsonl)], str(tmp_path / "out2" / "w"), tokenizer=summary["tokenizer"],
                          progress=False)
    # (keep IndexedDatasets referenced: their arrays are views of a memory map closed on delete)
    ds2 = IndexedDataset(again["data_prefix"])
    assert ds2[1].tolist() == ds[1].tolist()


def test_gpt_dataset_reads_the_token_stream(small_data):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from training_driver.data.samples import BatchPlan, build_gpt_dataset

    tok = load_tokenizer(small_data["tokenizer"])
    ds = build_gpt_dataset(small_data["data_path"], tok, seq_length=32, num_samples=40, seed=7)
    indexed = IndexedDataset(small_data["data_path"])
    stream = np.concatenate([np.array(indexed[i]) for i in range(len(indexed))])
    text = stream.tobytes()
    for k in (0, 5, 39):
        s = ds[k]
        assert s["tokens"].shape == (32,) and s["labels"].shape == (32,)
        assert s["tokens"][1:].tolist() == s["labels"][:-1].tolist()
        window = s["tokens"].tolist() + [int(s["labels"][-1])]
        # megatron shuffles documents and packs them: every run between end-of-document
        # tokens is a contiguous piece of one real document
        pieces, cur = [], []
        for t in window:
            cur.append(t)
            if t == tok.eod:
                pieces.append(cur)
                cur = []
        pieces.append(cur)
        for piece in filter(None, pieces):
            assert np.array(piece, dtype=stream.dtype).tobytes() in text
    plan = BatchPlan(micro_batch_size=2, num_micro_batches=3, data_parallel_size=2, data_parallel_rank=1)
    assert plan.global_batch_size == 12
    assert list(plan.sample_indices(1, 2)) == [12 + 2 * 2 * 2 + 2, 12 + 8 + 3]


@pytest.mark.parametrize("content,fix", [
    ('{"text": "ok"}\n{"text": oops}\n', "wiki.jsonl:2: not valid JSON"),
    ('{"body": "no text field"}\n', 'wiki.jsonl:1: no "text" field'),
    ('{"text": 5}\n', 'wiki.jsonl:1: "text" is not a string'),
    ("\n\n", "the corpus is empty"),
])
def test_preprocess_bad_input_messages(tmp_path, capsys, content, fix):
    path = tmp_path / "wiki.jsonl"
    path.write_text(content)
    rc = pp.main(["--input", str(path), "--output-prefix", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.startswith("preprocess-corpus: error:") and fix in err
    assert not (tmp_path / "o_text_document.bin").exists()


def test_preprocess_missing_file(tmp_path, capsys):
    rc = pp.main(["--input", str(tmp_path / "none.jsonl"), "--output-prefix", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "none.jsonl does not exist" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("it,expected", [
    (0, 0.25), (3, 1.0),                     # linear warmup over 4 iterations
    (4, 1.0), (9, 0.55), (14, 0.1), (20, 0.1),  # cosine from 1.0 to 0.1 over 10 iterations
])
def test_lr_schedule(it, expected):
    assert lr_at(it, max_lr=1.0, min_lr=0.1, warmup_iters=4, total_iters=14) == pytest.approx(expected)


def test_default_data_from_an_older_version_is_rebuilt(tmp_path):
    """runs/default/data made with the old tokenizer format is rebuilt, not reused."""
    from training_driver.collector import prepare_default_data

    data = tmp_path / "data"
    _old_format_dir(data / "tokenizer")
    for suffix in (".bin", ".idx"):
        (data / f"python_docs_text_document{suffix}").write_bytes(b"old")
    paths = prepare_default_data(tmp_path, vocab_size=300, max_chars=5_000)
    tok = load_tokenizer(paths["tokenizer"])
    assert isinstance(tok, HFTokenizer) and not (data / "tokenizer" / OLD_FORMAT_FILE).exists()
    assert (data / "python_docs_text_document.bin").read_bytes() != b"old"
    meta = json.loads((data / "python_docs_text_document.meta.json").read_text())
    assert meta["tokenizer_fingerprint"] == tok.fingerprint and meta["vocab_size"] == tok.vocab_size
    again = prepare_default_data(tmp_path, vocab_size=300, max_chars=5_000)   # now reused
    assert again == paths and load_tokenizer(again["tokenizer"]).fingerprint == tok.fingerprint
