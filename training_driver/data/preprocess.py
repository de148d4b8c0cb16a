"""Turn a corpus (JSON Lines with a text field, or plain text) into Megatron's indexed dataset.

Writes ``{output_prefix}_text_document.bin`` / ``.idx`` through megatron.core.datasets'
IndexedDatasetBuilder (one document per JSON line, or per blank-line-separated block of plain
text, each followed by the end-of-document token), the layout Megatron's GPTDataset reads.
Without ``--tokenizer`` a byte-level BPE is trained on the corpus with Hugging Face
``tokenizers`` and saved beside the data as a directory ``transformers.AutoTokenizer`` loads
(the one Megatron-LM's ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model`` takes).
``{prefix}.meta.json`` records which tokenizer made the ids, so training refuses a mismatch.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Iterator

from lowp_common import CommandParser, atomic_path, atomic_write_json
from lowp_common.cli import UserError, cli_entry

from .tokenizer import Tokenizer, load_tokenizer, save_tokenizer, train_bpe

DOCUMENT_SUFFIX = "_text_document"
META_SUFFIX = ".meta.json"
JSON_SUFFIXES = (".json", ".jsonl", ".ndjson")


def _is_json_lines(path: Path) -> bool:
    if path.suffix.lower() in JSON_SUFFIXES:
        return True
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if line.strip():
                return line.lstrip().startswith("{")
    return False


def read_documents(path: str | os.PathLike[str], json_key: str = "text") -> Iterator[str]:
    """Yield the documents of one corpus file; UserError naming the file and line when malformed."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"corpus file {p} does not exist: pass --input with a JSON Lines file "
                        "(one {\"text\": ...} per line) or a plain text file")
    if _is_json_lines(p):
        with open(p, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{p}:{lineno}: not valid JSON ({exc.msg}); each line must "
                                    "be one JSON object") from None
                if not isinstance(record, dict) or json_key not in record:
                    raise UserError(f"{p}:{lineno}: no \"{json_key}\" field; pick the field with "
                                    "--json-key")
                text = record[json_key]
                if not isinstance(text, str):
                    raise UserError(f"{p}:{lineno}: \"{json_key}\" is not a string")
                if text.strip():
                    yield text
    else:
        with open(p, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        for block in re.split(r"\n\s*\n", text):
            if block.strip():
                yield block.strip()


def _token_dtype(vocab_size: int):
    from megatron.core.datasets.indexed_dataset import DType

    return DType.optimal_dtype(vocab_size)


def write_indexed_dataset(documents: list[list[int]], output_prefix: str | os.PathLike[str],
                          vocab_size: int) -> str:
    """Write tokenized documents as ``{prefix}.bin/.idx`` atomically; returns the prefix."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = os.fspath(output_prefix)
    dtype = _token_dtype(vocab_size)
    with atomic_path(prefix + ".bin", make_parents=True) as tmp_bin, \
            atomic_path(prefix + ".idx") as tmp_idx:
        builder = IndexedDatasetBuilder(os.fspath(tmp_bin), dtype=dtype)
        for doc in documents:
            builder.add_document(np.asarray(doc, dtype=dtype), [len(doc)])
        builder.finalize(os.fspath(tmp_idx))
    return prefix


def preprocess(inputs: list[str], output_prefix: str, tokenizer: str | None = None,
               tokenizer_out: str | None = None, vocab_size: int = 1024, json_key: str = "text",
               progress: bool = True) -> dict:
    """Tokenize ``inputs`` and write the indexed dataset; returns a summary (paths and counts).

    ``output_prefix`` gets ``_text_document`` appended unless it already ends with it.
    """
    from tqdm import tqdm

    texts: list[str] = []
    for path in inputs:
        texts.extend(read_documents(path, json_key))
    if not texts:
        raise UserError(f"no documents in {', '.join(inputs)}: the corpus is empty")
    if tokenizer:
        tokenizer_dir = tokenizer
    else:
        tokenizer_dir = tokenizer_out or str(Path(output_prefix).parent / "tokenizer")
        save_tokenizer(train_bpe(texts, vocab_size=vocab_size, progress=progress), tokenizer_dir)
    tok: Tokenizer = load_tokenizer(tokenizer_dir)  # encode with what is on disk
    docs: list[list[int]] = []
    n_tokens = 0
    bar = tqdm(total=len(texts), desc="tokenizing", unit="doc", disable=not progress, leave=False)
    for start in range(0, len(texts), 256):
        for ids in tok.encode_batch(texts[start:start + 256]):
            ids.append(tok.eod)
            docs.append(ids)
            n_tokens += len(ids)
        bar.update(min(256, len(texts) - start))
    bar.close()
    prefix = output_prefix if output_prefix.endswith(DOCUMENT_SUFFIX) else output_prefix + DOCUMENT_SUFFIX
    meta = Path(prefix + META_SUFFIX)
    meta.unlink(missing_ok=True)  # never leave a record of the previous tokenizer beside new data
    write_indexed_dataset(docs, prefix, tok.vocab_size)
    atomic_write_json(meta, {"tokenizer": os.path.abspath(tokenizer_dir),
                             "tokenizer_fingerprint": getattr(tok, "fingerprint", ""),
                             "vocab_size": tok.vocab_size, "eod": tok.eod,
                             "documents": len(docs), "tokens": n_tokens})
    return {"data_prefix": prefix, "tokenizer": str(tokenizer_dir), "documents": len(docs),
            "tokens": n_tokens, "vocab_size": tok.vocab_size}


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="preprocess-corpus",
        description="Tokenize a corpus (JSON Lines with a text field, e.g. a Wikipedia dump, or "
                    "plain text with blank lines between documents) into Megatron's indexed "
                    "dataset (.bin/.idx). Nothing is downloaded.",
    )
    p.add_argument("--input", action="append", required=True, metavar="FILE",
                   help="corpus file (repeat for several)")
    p.add_argument("--output-prefix", required=True,
                   help="output path prefix; '_text_document.bin/.idx' is appended")
    p.add_argument("--tokenizer", default=None,
                   help="existing tokenizer directory (one preprocess-corpus wrote, or a local "
                        "Hugging Face one); default: train a byte-level BPE on the corpus with "
                        "Hugging Face tokenizers")
    p.add_argument("--tokenizer-out", default=None,
                   help="where to save a trained tokenizer (default: PREFIX's folder/tokenizer); "
                        "transformers.AutoTokenizer.from_pretrained loads it")
    p.add_argument("--vocab-size", type=int, default=1024,
                   help="size of a trained tokenizer (default 1024)")
    p.add_argument("--json-key", default="text", help="JSON field holding the text (default text)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--force", action="store_true",
                   help="replace a dataset (and a trained tokenizer) written earlier at these "
                        "paths; without it such a run refuses")
    p.epilog = ("Example, the corpus the main job builds (text from the documentation Python "
                "ships): preprocess-corpus --input runs/default/corpus/python_docs.jsonl "
                "--output-prefix dataset/mine/mine  (then llama-train --data-path "
                "dataset/mine/mine_text_document --tokenizer dataset/mine/tokenizer). Your own "
                "text: one JSON object per line with a \"text\" field, or plain text with a "
                "blank line between documents.")
    return p


def check_outputs(args: argparse.Namespace) -> None:
    """The dataset, and the tokenizer a run would train, are results other runs are made of:
    one written earlier is replaced only with --force (issue 40), and an output that cannot be
    written is refused before the corpus is read."""
    from lowp_common import check_writable, refuse_overwrite

    from .tokenizer import TOKENIZER_FILE

    prefix = args.output_prefix
    prefix = prefix if prefix.endswith(DOCUMENT_SUFFIX) else prefix + DOCUMENT_SUFFIX
    check_writable(prefix + ".bin", "--output-prefix")
    earlier = [prefix + ".bin", prefix + ".idx"]
    if not args.tokenizer:
        tok_dir = args.tokenizer_out or str(Path(args.output_prefix).parent / "tokenizer")
        check_writable(tok_dir, "--tokenizer-out", folder=True)
        earlier.append(os.path.join(tok_dir, TOKENIZER_FILE))
    refuse_overwrite(earlier, what="a dataset or tokenizer", force=args.force,
                     elsewhere="give another --output-prefix")


@cli_entry("preprocess-corpus")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_outputs(args)
    from ..megatron_env import quiet_megatron_warnings

    quiet_megatron_warnings()
    summary = preprocess(args.input, args.output_prefix, args.tokenizer, args.tokenizer_out,
                         args.vocab_size, args.json_key, progress=not args.quiet)
    print(f"wrote {summary['data_prefix']}.bin/.idx: {summary['documents']} documents, "
          f"{summary['tokens']} tokens, vocabulary {summary['vocab_size']} "
          f"(tokenizer: {summary['tokenizer']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
