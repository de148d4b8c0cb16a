"""Put the capture calls into a Megatron tree: small anchored edits, idempotent, reversible.

Why anchored text edits rather than a diff: each edit names the exact upstream text it
expects; if a Megatron version moved it, the tool stops with the file and the missing text
instead of patching the wrong place. Every edit only adds lines (the original code stays, as
the branch taken when capture is off), so reverting is replacing the added text by the anchor.

Command line: ``megatron-tensor-patch MEGATRON_TREE [--check | --revert]``
(``patches/apply_patches.sh`` wraps it). Library: :func:`apply`, :func:`revert`, :func:`check`,
:func:`prepare_patched_megatron`.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lowp_common import atomic_write_text, cli_entry, fail

MARK = "# tensor_capture patch"
SAVER_REL = "megatron/core/tensor_saver.py"
VERIFIED = "megatron-core 0.16.1"
_IMPORT = f"from megatron.core import tensor_saver as _tensor_saver  {MARK}\n"


class PatchError(RuntimeError):
    """The tree cannot be patched (unknown layout, moved anchor, partial state)."""


@dataclass(frozen=True)
class Edit:
    anchor: str       # exact upstream text, must occur exactly once
    patched: str      # what it becomes (contains the anchor's code unchanged)


@dataclass(frozen=True)
class FilePatch:
    rel: str
    edits: tuple[Edit, ...]
    optional: bool = False   # skipped with a note when the anchors are absent


def _prefix(anchor: str, added: str) -> Edit:
    return Edit(anchor, added + anchor)


def _suffix(anchor: str, added: str) -> Edit:
    return Edit(anchor, anchor + added)


_LIN_FWD = """\
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output
"""
_DGRAD = """\
                total_input = input
        grad_input = grad_output.matmul(weight)
"""
_DGRAD_PATCHED = f"""\
                total_input = input
        if _tensor_saver.STATE.active:  {MARK}
            grad_input = _tensor_saver.linear_dgrad(ctx, grad_output, weight)
        else:
            grad_input = grad_output.matmul(weight)
"""
_WGRAD = "            grad_weight = grad_output.t().matmul(total_input)\n"
_WGRAD_PATCHED = f"""\
            if _tensor_saver.STATE.active:  {MARK}
                grad_weight = _tensor_saver.linear_wgrad(ctx, grad_output, total_input)
            else:
                grad_weight = grad_output.t().matmul(total_input)
"""
_BWD_RETURN = "        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None\n"

_ATTN_DEF = """\
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
"""


def _attn_wrapper(hook: str) -> str:
    return f"""\
    def forward(self, query, key, value, attention_mask, *args, **kwargs):  {MARK}
        \"\"\"Forward; with tensor capture or emulation active, runs through tensor_saver.\"\"\"
        if _tensor_saver.STATE.active:
            return _tensor_saver.{hook}(
                self, self._forward_unpatched, query, key, value, attention_mask, *args, **kwargs
            )
        return self._forward_unpatched(query, key, value, attention_mask, *args, **kwargs)

    def _forward_unpatched(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
"""


PATCHES: tuple[FilePatch, ...] = (
    FilePatch("megatron/core/tensor_parallel/layers.py", (
        _suffix("from .utils import VocabUtility\n", _IMPORT),
        _prefix(_LIN_FWD, f"""\
        if _tensor_saver.STATE.active:  {MARK}
            return _tensor_saver.linear_forward(ctx, total_input, weight, bias)
"""),
        Edit(_DGRAD, _DGRAD_PATCHED),
        Edit(_WGRAD, _WGRAD_PATCHED),
        _prefix(_BWD_RETURN, f"""\
        if _tensor_saver.STATE.active:  {MARK}
            _tensor_saver.linear_backward_post(ctx, grad_input, grad_weight)
"""),
    )),
    FilePatch("megatron/core/transformer/dot_product_attention.py", (
        _suffix("from megatron.core.utils import divide\n", _IMPORT),
        Edit(_ATTN_DEF, _attn_wrapper("attention_forward")),
        _prefix("        context = torch.bmm(attention_probs, value.transpose(0, 1))\n", f"""\
        if _tensor_saver.STATE.emulate_attention:  {MARK}
            attention_probs = _tensor_saver.quantize_probs(attention_probs)
"""),
    )),
    # Transformer Engine attention: capture only (its fused kernel cannot be emulated from
    # Python). The class exists only when TE imports, so the edit is inert without TE.
    FilePatch("megatron/core/extensions/transformer_engine.py", (
        _suffix("from megatron.core.packed_seq_params import PackedSeqParams\n", _IMPORT),
        Edit(_ATTN_DEF, _attn_wrapper("te_attention_forward")),
    ), optional=True),
)


def _facade_source() -> Path:
    here = Path(__file__).resolve().parent.parent / SAVER_REL
    if not here.is_file():
        raise PatchError(f"{here} is missing: install this project editable (pip install -e .) "
                         "so the in-tree tensor_saver.py can be copied")
    return here


def patch_fingerprint() -> str:
    """Changes whenever the edits or the facade change (used to reuse prepared copies)."""
    h = hashlib.sha256()
    for fp in PATCHES:
        h.update(fp.rel.encode())
        for e in fp.edits:
            h.update(e.anchor.encode())
            h.update(e.patched.encode())
    h.update(_facade_source().read_bytes())
    return h.hexdigest()[:16]


def find_tree(path: str | os.PathLike[str]) -> Path:
    """The directory that holds ``megatron/core`` (accepts that directory or megatron/core itself)."""
    p = Path(path).expanduser().resolve()
    candidates = [p]
    if p.name == "core" and p.parent.name == "megatron":
        candidates.append(p.parent.parent)
    if p.name == "megatron":
        candidates.append(p.parent)
    for c in candidates:
        if all((c / fp.rel).is_file() for fp in PATCHES if not fp.optional):
            return c
    if not p.exists():
        raise PatchError(f"{path}: no such directory")
    raise PatchError(f"{path}: not a Megatron tree (expected megatron/core/tensor_parallel/layers.py "
                     "and megatron/core/transformer/dot_product_attention.py under it); give the "
                     "Megatron-LM checkout or the directory containing megatron/core")


def _file_state(text: str, fp: FilePatch) -> str:
    """'patched', 'clean', or 'unknown:<detail>'."""
    patched = [e.patched in text for e in fp.edits]
    if all(patched):
        return "patched"
    if MARK in text:
        return "unknown:partially patched (some tensor_capture edits are missing)"
    missing = [e.anchor.strip().splitlines()[0] for e in fp.edits if text.count(e.anchor) != 1]
    if missing:
        return f"unknown:anchor text not found exactly once: {missing[0]!r}"
    return "clean"


def _write_atomic(path: Path, text: str) -> None:
    atomic_write_text(path, text)  # keeps the file's mode


def check(tree: str | os.PathLike[str]) -> dict[str, str]:
    """State of each file ('patched' / 'clean' / 'absent' / 'unknown:...') and of tensor_saver.py."""
    root = find_tree(tree)
    out: dict[str, str] = {}
    for fp in PATCHES:
        f = root / fp.rel
        if not f.is_file():
            out[fp.rel] = "absent"
            continue
        text = f.read_text(encoding="utf-8")
        state = _file_state(text, fp)
        if fp.optional and state.startswith("unknown") and MARK not in text:
            state = f"skipped ({state[8:]})"
        out[fp.rel] = state
    saver = root / SAVER_REL
    if not saver.is_file():
        out[SAVER_REL] = "absent"
    else:
        out[SAVER_REL] = "patched" if saver.read_bytes() == _facade_source().read_bytes() else "outdated"
    return out


def _plan(root: Path) -> dict[Path, str]:
    """New text of every file to change; raises PatchError before anything is written."""
    plan: dict[Path, str] = {}
    for fp in PATCHES:
        f = root / fp.rel
        if not f.is_file():
            if fp.optional:
                continue
            raise PatchError(f"{f}: missing")
        text = f.read_text(encoding="utf-8")
        state = _file_state(text, fp)
        if state == "patched":
            continue
        if state.startswith("unknown"):
            if fp.optional and MARK not in text:
                print(f"note: {fp.rel}: left unpatched ({state[8:]})", file=sys.stderr)
                continue
            raise PatchError(f"{f}: {state[8:]}; this Megatron version is not supported "
                             f"(verified: {VERIFIED})")
        for e in fp.edits:
            text = text.replace(e.anchor, e.patched, 1)
        plan[f] = text
    return plan


def apply(tree: str | os.PathLike[str]) -> list[str]:
    """Patch the tree (idempotent). Returns the relative paths that changed."""
    root = find_tree(tree)
    plan = _plan(root)
    changed = []
    for f, text in plan.items():
        _write_atomic(f, text)
        changed.append(str(f.relative_to(root)))
    saver = root / SAVER_REL
    src = _facade_source().read_text(encoding="utf-8")
    if not saver.is_file() or saver.read_text(encoding="utf-8") != src:
        _write_atomic(saver, src)
        changed.append(SAVER_REL)
    return changed


def revert(tree: str | os.PathLike[str]) -> list[str]:
    """Undo :func:`apply` (idempotent). Returns the relative paths that changed."""
    root = find_tree(tree)
    changed: list[str] = []
    plans: dict[Path, str] = {}
    for fp in PATCHES:
        f = root / fp.rel
        if not f.is_file():
            continue
        text = f.read_text(encoding="utf-8")
        if MARK not in text:
            continue
        for e in fp.edits:
            if text.count(e.patched) == 1:
                text = text.replace(e.patched, e.anchor, 1)
        if MARK in text:
            raise PatchError(f"{f}: holds tensor_capture edits this tool did not make (edited by "
                             "hand?); restore the file from Megatron and re-apply")
        plans[f] = text
    for f, text in plans.items():
        _write_atomic(f, text)
        changed.append(str(f.relative_to(root)))
    saver = root / SAVER_REL
    if saver.is_file():
        if "tensor_capture" not in saver.read_text(encoding="utf-8", errors="replace"):
            raise PatchError(f"{saver}: not written by this tool; left in place")
        saver.unlink()
        changed.append(SAVER_REL)
    return changed


def installed_megatron_core() -> Path:
    """The installed megatron/core directory, found without importing megatron.core."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("megatron-core is not installed (pip install megatron-core)")
    for loc in spec.submodule_search_locations:
        core = Path(loc) / "core"
        if (core / "__init__.py").is_file():
            return core
    raise PatchError("megatron-core is not installed: no megatron/core/__init__.py on sys.path")


def prepare_patched_megatron(workdir: str | os.PathLike[str]) -> Path:
    """Copy the installed megatron-core to ``workdir/megatron/core``, patched; reuse if current.

    Prepend the returned directory to sys.path / PYTHONPATH before importing megatron.
    """
    work = Path(workdir).expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    src = installed_megatron_core()
    init = src / "__init__.py"
    stamp_text = f"{src}|{init.stat().st_mtime_ns}|{patch_fingerprint()}\n"
    stamp = work / ".tensor_capture_stamp"
    target = work / "megatron" / "core"
    if stamp.is_file() and stamp.read_text() == stamp_text and target.is_dir():
        states = check(work)
        if all(v == "patched" or v == "absent" or v.startswith("skipped")
               for v in states.values()) and states[SAVER_REL] == "patched":
            return work
    staging = Path(tempfile.mkdtemp(prefix=".megatron-staging-", dir=work))
    try:
        shutil.copytree(src, staging / "megatron" / "core",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        apply(staging)
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / "megatron" / "core", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _write_atomic(stamp, stamp_text)
    return work


@cli_entry("megatron-tensor-patch", user_errors=(PatchError,))
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="megatron-tensor-patch",
        description="Insert tensor capture / CUSTOM_QUANT_TYPE emulation calls into a Megatron "
                    f"tree (verified on {VERIFIED}). Idempotent; --revert undoes it.")
    ap.add_argument("tree", help="Megatron-LM checkout, or a directory containing megatron/core")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="report the state; exit 0 if patched, 1 if not patched, 2 on a problem")
    mode.add_argument("--revert", action="store_true", help="remove the edits and tensor_saver.py")
    ap.add_argument("--prepare", action="store_true",
                    help="treat TREE as a work directory: copy the installed megatron-core there, "
                         "patched, and print the directory to put on PYTHONPATH")
    args = ap.parse_args(argv)
    try:
        if args.prepare:
            print(prepare_patched_megatron(args.tree))
            return 0
        if args.check:
            states = check(args.tree)
            for rel, st in states.items():
                print(f"{rel}: {st}")
            if any(s.startswith("unknown") for s in states.values()):
                return 2
            needed = [s for s in states.values() if s != "absent" and not s.startswith("skipped")]
            return 0 if all(s == "patched" for s in needed) else 1
        changed = revert(args.tree) if args.revert else apply(args.tree)
        verb = "reverted" if args.revert else "patched"
        print(f"{verb}: {', '.join(changed)}" if changed else f"already {verb}: nothing to do")
        return 0
    except OSError as exc:
        return fail(f"{exc.filename or args.tree}: {exc.strerror or exc}", "megatron-tensor-patch")


if __name__ == "__main__":
    sys.exit(main())
