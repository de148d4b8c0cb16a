"""Put the capture calls into a Megatron tree: whole-line anchored edits, idempotent, reversible.

Why anchored text edits rather than a diff: each edit names the exact upstream lines it expects
(indentation included); if a Megatron version moved them, the tool stops with the file, the
anchor, the detected version and the supported list instead of patching the wrong place. The
edit set is chosen from the version in ``megatron/core/package_info.py`` (table in
:mod:`tensor_capture.patch_edits`). Nothing is written unless every file's new text was
computed and compiles; reverting gives back the upstream bytes.

Command line: ``megatron-tensor-patch MEGATRON_TREE [--check | --revert | --detect]``
(``patches/apply_patches.sh`` wraps it). Library: :func:`apply`, :func:`revert`, :func:`check`,
:func:`detect`, :func:`prepare_patched_megatron`.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lowp_common import CommandParser, atomic_write_text, cli_entry, fail

from .patch_edits import (
    FAMILIES,
    LAYERS,
    MARK,
    PACKAGE_INFO,
    Edit,
    Family,
    FilePatch,
    all_files,
    family_for,
    supported_text,
)

SAVER_REL = "megatron/core/tensor_saver.py"
# Files a tree must hold to be recognised (the rest depend on the version).
_REQUIRED = (PACKAGE_INFO, LAYERS)
# Every file the patch set reads or edits, any version (e.g. to build a small stand-in tree).
TREE_FILES: tuple[str, ...] = all_files()

__all__ = ["MARK", "SAVER_REL", "TREE_FILES", "PatchError", "MegatronVersion", "detect",
           "edit_set", "find_tree", "check", "apply", "revert", "installed_megatron_core",
           "prepare_patched_megatron", "patch_fingerprint", "main", "Edit", "FilePatch", "Family"]


class PatchError(RuntimeError):
    """The tree cannot be patched (unknown layout or version, moved anchor, partial state)."""


@dataclass(frozen=True)
class MegatronVersion:
    major: int
    minor: int
    patch: int
    pre_release: str = ""

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}{self.pre_release}"

    @property
    def family(self) -> Family | None:
        return family_for((self.major, self.minor, self.patch))


# --- locating the tree and its version ---------------------------------------------------------

def find_tree(path: str | os.PathLike[str]) -> Path:
    """The directory that holds ``megatron/core`` (accepts that directory or megatron/core itself)."""
    p = Path(path).expanduser().resolve()
    candidates = [p]
    if p.name == "core" and p.parent.name == "megatron":
        candidates.append(p.parent.parent)
    if p.name == "megatron":
        candidates.append(p.parent)
    for c in candidates:
        if all((c / rel).is_file() for rel in _REQUIRED):
            return c
    if not p.exists():
        raise PatchError(f"{path}: no such directory")
    raise PatchError(f"{path}: not a Megatron tree (expected {' and '.join(_REQUIRED)} under it); "
                     "give the Megatron-LM checkout or the directory containing megatron/core")


def _read_version(info: Path) -> MegatronVersion:
    """MAJOR/MINOR/PATCH/PRE_RELEASE from package_info.py, parsed (never executed)."""
    try:
        tree = ast.parse(info.read_text(encoding="utf-8"), filename=str(info))
    except SyntaxError as exc:
        raise PatchError(f"{info}: cannot parse ({exc.msg}, line {exc.lineno})") from None
    found: dict[str, object] = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Constant)):
            found[node.targets[0].id] = node.value.value
    parts = [found.get(k) for k in ("MAJOR", "MINOR", "PATCH")]
    if not all(isinstance(v, int) for v in parts):
        raise PatchError(f"{info}: no integer MAJOR/MINOR/PATCH assignments; not a megatron-core "
                         "package_info.py this tool knows")
    pre = found.get("PRE_RELEASE", "")
    return MegatronVersion(*parts, pre if isinstance(pre, str) else "")


def detect(tree: str | os.PathLike[str]) -> MegatronVersion:
    """The tree's megatron-core version; PatchError (one line) when it is not supported."""
    root = find_tree(tree)
    version = _read_version(root / PACKAGE_INFO)
    if version.family is None:
        raise PatchError(f"{root / PACKAGE_INFO}: megatron-core {version} is not supported; "
                         f"supported: {supported_text()}")
    return version


def edit_set(tree: str | os.PathLike[str]) -> tuple[Path, MegatronVersion, tuple[FilePatch, ...]]:
    """(root, version, the file patches for that version)."""
    root = find_tree(tree)
    version = detect(root)
    assert version.family is not None
    return root, version, version.family.patches


# --- whole-line matching -----------------------------------------------------------------------

def _line_matches(text: str, block: str) -> list[int]:
    """Offsets where ``block`` (whole lines, ending in a newline) starts at a line start."""
    assert block.endswith("\n"), block
    out, start = [], 0
    while (i := text.find(block, start)) >= 0:
        if i == 0 or text[i - 1] == "\n":
            out.append(i)
        start = i + 1
    return out


def _describe(block: str, name: str) -> str:
    """An anchor in one line: its first (and last) line, the edit's name, its length."""
    lines = [ln.strip() for ln in block.strip("\n").splitlines()]
    shown = repr(lines[0]) if len(lines) == 1 else f"{lines[0]!r} ... {lines[-1]!r}"
    return f"anchor {shown} (edit {name}, {len(lines)} line{'s' * (len(lines) > 1)})"


def _splice(text: str, triples: list[tuple[str, str, str]]) -> tuple[str | None, str | None]:
    """Replace each ``old`` (found exactly once, as whole lines) by ``new``; name is for messages.

    Returns (new text, None) or (None, reason naming the first offending block). All blocks are
    located in the original text, so one edit's new lines can never create another's match.
    """
    spans = []
    for old, new, name in triples:
        hits = _line_matches(text, old)
        if len(hits) != 1:
            what = "not found as whole lines" if not hits else f"found {len(hits)} times"
            return None, f"{_describe(old, name)} {what}"
        spans.append((hits[0], hits[0] + len(old), new))
    spans.sort()
    for (_, end, _), (start, _, _) in zip(spans, spans[1:]):
        if start < end:
            return None, "two anchors overlap"
    out, pos = [], 0
    for start, end, new in spans:
        out += [text[pos:start], new]
        pos = end
    return "".join(out + [text[pos:]]), None


def _patched_text(text: str, fp: FilePatch) -> tuple[str | None, str | None]:
    return _splice(text, [(e.anchor, e.patched, e.name) for e in fp.edits])


def _present(text: str, fp: FilePatch) -> list[Edit]:
    """The edits whose patched lines occur exactly once (all of them in a fully patched file)."""
    return [e for e in fp.edits if len(_line_matches(text, e.patched)) == 1]


def _reverted_text(text: str, fp: FilePatch) -> tuple[str | None, str | None]:
    """Upstream text of a file holding some or all of ``fp``'s edits.

    Verified twice: no tensor_capture line may remain, and re-applying the same edits must give
    back ``text`` byte for byte (so a file patched by an earlier, smaller edit set reverts too).
    """
    present = _present(text, fp)
    if not present:
        return None, "none of this version's edits is there"
    orig, why = _splice(text, [(e.patched, e.anchor, e.name + " (patched text)") for e in present])
    if orig is None:
        return None, why
    if MARK in orig:
        missing = next(e for e in fp.edits if e not in present)
        return None, (f"a tensor_capture line outside this version's edits remains; "
                      f"{_describe(missing.patched, missing.name + ' (patched text)')} "
                      "not found as whole lines")
    again, _ = _splice(orig, [(e.anchor, e.patched, e.name) for e in present])
    if again != text:
        return None, "holds tensor_capture edits this tool did not make"
    return orig, None


def _file_state(text: str, fp: FilePatch) -> str:
    """'patched', 'clean', 'outdated (...)' (an older edit set: re-apply upgrades it) or
    'unknown:<detail>'."""
    if MARK in text:
        orig, why = _reverted_text(text, fp)
        if orig is None:
            return f"unknown:partially patched or edited by hand ({why})"
        n = len(_present(text, fp))
        if n == len(fp.edits):
            return "patched"
        new, why = _patched_text(orig, fp)
        if new is None:
            return f"unknown:patched by an older edit set, and {why}"
        return f"outdated ({n} of {len(fp.edits)} edits; apply upgrades it)"
    new, why = _patched_text(text, fp)
    return "clean" if new is not None else f"unknown:{why}"


def _compile_error(text: str, where: Path) -> str | None:
    try:
        compile(text, str(where), "exec", dont_inherit=True)
    except SyntaxError as exc:
        return f"line {exc.lineno}: {exc.msg}"
    return None


def _refusal(f: Path, detail: str, version: MegatronVersion) -> PatchError:
    fam = version.family
    return PatchError(f"{f}: {detail}; detected megatron-core {version} (edit set "
                      f"{fam.name if fam else '-'}); nothing written; supported: {supported_text()}")


def _write_atomic(path: Path, text: str) -> None:
    atomic_write_text(path, text)  # keeps the file's mode


def _read(f: Path) -> str:
    with open(f, encoding="utf-8", newline="") as fh:   # keep line endings byte-exact
        return fh.read()


# --- the library -------------------------------------------------------------------------------

def _facade_source() -> Path:
    here = Path(__file__).resolve().parent.parent / SAVER_REL
    if not here.is_file():
        raise PatchError(f"{here} is missing: install this project editable (pip install -e .) "
                         "so the in-tree tensor_saver.py can be copied")
    return here


def patch_fingerprint() -> str:
    """Changes whenever any edit or the facade changes (used to reuse prepared copies)."""
    h = hashlib.sha256()
    for fam in FAMILIES:
        for fp in fam.patches:
            h.update(fp.rel.encode())
            for e in fp.edits:
                h.update(e.anchor.encode())
                h.update(e.patched.encode())
    h.update(_facade_source().read_bytes())
    return h.hexdigest()[:16]


def check(tree: str | os.PathLike[str]) -> dict[str, str]:
    """State of each file ('patched' / 'clean' / 'absent' / 'skipped (...)' / 'unknown:...')."""
    root, _, patches = edit_set(tree)
    out: dict[str, str] = {}
    for fp in patches:
        f = root / fp.rel
        if not f.is_file():
            out[fp.rel] = "skipped (absent)" if fp.optional else "absent"
            continue
        text = _read(f)
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


def _plan(root: Path, version: MegatronVersion, patches: tuple[FilePatch, ...]) -> dict[Path, str]:
    """New text of every file to change; raises PatchError before anything is written."""
    plan: dict[Path, str] = {}
    for fp in patches:
        f = root / fp.rel
        if not f.is_file():
            if fp.optional:
                continue
            raise _refusal(f, "missing", version)
        text = _read(f)
        state = _file_state(text, fp)
        if state == "patched":
            continue
        if state.startswith("unknown"):
            if fp.optional and MARK not in text:
                print(f"note: {fp.rel}: left unpatched ({state[8:]})", file=sys.stderr)
                continue
            raise _refusal(f, state[8:], version)
        if state.startswith("outdated"):
            text, _ = _reverted_text(text, fp)
            assert text is not None
        new, _ = _patched_text(text, fp)
        assert new is not None
        err = _compile_error(new, f)
        if err is not None:
            base = _compile_error(text, f)
            detail = (f"does not compile under Python {sys.version.split()[0]} even unpatched "
                      f"({base}); run the tool with the Python that runs Megatron" if base else
                      f"the patched text would not compile ({err})")
            raise _refusal(f, detail, version)
        plan[f] = new
    return plan


def apply(tree: str | os.PathLike[str]) -> list[str]:
    """Patch the tree (idempotent). Returns the relative paths that changed."""
    root, version, patches = edit_set(tree)
    plan = _plan(root, version, patches)
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
    """Undo :func:`apply` byte for byte (idempotent). Returns the relative paths that changed."""
    root, version, patches = edit_set(tree)
    plans: dict[Path, str] = {}
    for fp in patches:
        f = root / fp.rel
        if not f.is_file():
            continue
        text = _read(f)
        if MARK not in text:
            continue
        orig, why = _reverted_text(text, fp)
        if orig is None:
            raise _refusal(f, f"{why} (edited by hand?); restore the file from Megatron", version)
        plans[f] = orig
    saver = root / SAVER_REL
    if saver.is_file() and "tensor_capture" not in saver.read_text(encoding="utf-8",
                                                                   errors="replace"):
        raise PatchError(f"{saver}: not written by this tool; nothing reverted")
    changed: list[str] = []
    for f, text in plans.items():
        _write_atomic(f, text)
        changed.append(str(f.relative_to(root)))
    if saver.is_file():
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
    detect(src)                                   # refuse an unsupported version before copying
    init = src / "__init__.py"
    stamp_text = f"{src}|{init.stat().st_mtime_ns}|{patch_fingerprint()}\n"
    stamp = work / ".tensor_capture_stamp"
    target = work / "megatron" / "core"
    if stamp.is_file() and stamp.read_text() == stamp_text and target.is_dir():
        states = check(work)
        if all(v == "patched" or v.startswith("skipped") for v in states.values()):
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


def _version_table() -> str:
    return "; ".join(f"{fam.name}: {', '.join(fam.tested + ((fam.checked,) if fam.checked else ()))}"
                     for fam in FAMILIES)


@cli_entry("megatron-tensor-patch", user_errors=(PatchError,))
def main(argv: list[str] | None = None) -> int:
    ap = CommandParser(
        prog="megatron-tensor-patch",
        description="Insert tensor capture / CUSTOM_QUANT_TYPE emulation calls into a Megatron "
                    "tree. Idempotent; --revert undoes it byte for byte. The edit set follows "
                    "megatron/core/package_info.py; supported: " + supported_text() + ".",
        epilog="Tested: " + _version_table() + ". Exit status: 0 done, 2 refused "
               "(one line on stderr: the file, the anchor or version, the supported list).")
    ap.add_argument("tree", help="Megatron-LM checkout, or a directory containing megatron/core")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="report the state; exit 0 if patched, 1 if not patched, 2 on a problem")
    mode.add_argument("--revert", action="store_true", help="remove the edits and tensor_saver.py")
    mode.add_argument("--detect", action="store_true",
                      help="print the tree's megatron-core version (e.g. 0.19.2) and exit 0 if "
                           "it is supported; else one line on stderr and exit 2")
    mode.add_argument("--prepare", action="store_true",
                      help="treat TREE as a work directory: copy the installed megatron-core there, "
                           "patched, and print the directory to put on PYTHONPATH")
    args = ap.parse_args(argv)
    try:
        if args.detect:
            print(detect(args.tree))
            return 0
        if args.prepare:
            print(prepare_patched_megatron(args.tree))
            return 0
        if args.check:
            version = detect(args.tree)
            states = check(args.tree)
            print(f"megatron-core {version} (edit set {version.family.name})")
            for rel, st in states.items():
                print(f"{rel}: {st}")
            if any(s.startswith("unknown") or s == "absent" and rel != SAVER_REL
                   for rel, s in states.items()):
                return 2
            needed = [s for s in states.values() if not s.startswith("skipped")]
            return 0 if all(s == "patched" for s in needed) else 1
        changed = revert(args.tree) if args.revert else apply(args.tree)
        verb = "reverted" if args.revert else "patched"
        print(f"{verb}: {', '.join(changed)}" if changed else f"already {verb}: nothing to do")
        return 0
    except OSError as exc:
        return fail(f"{exc.filename or args.tree}: {exc.strerror or exc}", "megatron-tensor-patch")


if __name__ == "__main__":
    sys.exit(main())
