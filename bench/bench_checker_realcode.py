"""amp-static-check on public training code: precision on hand-labelled findings, recall on real
AMP bugs, and the time to scan a real ~10,000-line tree.

    python bench/bench_checker_realcode.py [--corpus bench/realcode/corpus.json]
        [--bugs bench/realcode/bugs.json] [--libraries bench/realcode/libraries.json]
        [--mirrors /work/.mirror] [--cache /tmp/realcode_cache]
        [--json OUT] [--repo owner/name ...] [--no-timing]

The repositories are not part of the project: corpus.json and bugs.json hold only references
(repository, commit, paths, lines) and our own labels. Each repository must be on this machine
as a git mirror under ``--mirrors`` (``<owner>+<name>/repo``, what the fetch tool leaves); the
.py/.sh files of the scan folders are extracted at the pinned commit (git ls-tree + cat-file,
which skips blobs a snapshot left out) into ``--cache`` and given to ``check_paths`` together,
so project mode sees the package as a whole. Only findings in the
listed files count. Labels match findings by (repo, path, line, rule).

bugs_heldout*.json beside bugs.json (same format; ``--heldout``) hold real bugs found after the
rules were written and never used to write them: each set's recall is printed apart, as the
estimate of how the rules do on bugs they were not shaped by (a set whose missed kinds later
rules were written for says so in BUGS.md; the newest set is the blind one).

libraries.json beside corpus.json (same format; ``--libraries``) is a second labelled set:
model-library folders in which nothing trains, where the checker's default shows medium
confidence too; its precision is printed apart.

Prints precision per rule and overall (tp / (tp + fp) over labelled findings), the unlabelled
findings with their source line (to label by hand), labels no finding matched any more, recall
on bugs.json (a bug is caught by a finding of its expected rule, or of any AMP rule when none is
expected, on its file within 3 lines of its buggy lines) with the missed bugs and their class,
and the scan time of a real tree of about 10,000 lines against the time to only parse it.
Exit 0; 1 when a repository was not on this machine (it is skipped).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowp_common import CommandParser, UserError, atomic_write_json, cli_entry
from training_profiler.amp_checker.checker import check_paths
from training_profiler.amp_checker.project import PROGRAM_MARKERS
from training_profiler.amp_checker.rules import Confidence

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = ROOT / "bench" / "realcode" / "corpus.json"
DEFAULT_BUGS = ROOT / "bench" / "realcode" / "bugs.json"
BUG_WINDOW = 3          # a bug is caught by a finding within this many lines of its buggy lines
TIMING_LINES = 10_000   # size of the tree whose scan is timed
TIMING_GOAL_S = 5.0
VERDICTS = ("tp", "fp")
# project markers extracted beside the .py/.sh files: the checker tells the programs of a scan
# apart by them (training_profiler.amp_checker.project.program_root); bumped when extraction changes
_MARKERS = {m.encode() for m in PROGRAM_MARKERS if m != ".git"}
EXTRACT_VERSION = "markers-1"
Key = tuple[str, str, int, str]   # (repo, path, line, rule)


@dataclass(frozen=True)
class Hit:
    """One checker finding, its path relative to the repository root."""

    repo: str
    path: str
    line: int
    rule: str
    message: str
    confidence: str = "high"

    @property
    def key(self) -> Key:
        return (self.repo, self.path, self.line, self.rule)


# ---- input ------------------------------------------------------------------------------
def _need(obj: dict, field: str, kind: type, where: str) -> object:
    if not isinstance(obj, dict) or not isinstance(obj.get(field), kind):
        raise UserError(f"{where}: needs a {kind.__name__} field {field!r}; see the schema "
                        "in bench/realcode/README.md")
    return obj[field]


def load_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc}); give the file with --corpus/--bugs") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg}); fix the file") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: the top level must be a JSON object")
    return data


def load_corpus(path: Path) -> tuple[list[dict], list[dict]]:
    """The repositories and labels of corpus.json, checked field by field (one line per mistake)."""
    data = load_json(path)
    repos = _need(data, "repos", list, str(path))
    labels = data.get("labels", [])
    for i, r in enumerate(repos):
        where = f"{path}: repos[{i}]"
        _need(r, "repo", str, where), _need(r, "commit", str, where)
        _need(r, "scan", list, where), _need(r, "files", list, where)
        bad = [f for f in r["files"] if not any(_inside(f, s) for s in r["scan"])]
        if bad:
            raise UserError(f"{where}: file {bad[0]!r} is in no scan folder of {r['repo']}; add its folder to 'scan'")
    seen: set[Key] = set()
    for i, lab in enumerate(labels):
        where = f"{path}: labels[{i}]"
        for f, k in (("repo", str), ("path", str), ("line", int), ("rule", str), ("verdict", str), ("why", str)):
            _need(lab, f, k, where)
        if lab["verdict"] not in VERDICTS:
            raise UserError(f"{where}: verdict {lab['verdict']!r}; use 'tp' or 'fp'")
        key = label_key(lab)
        if key in seen:
            raise UserError(f"{where}: a second label for {key}; keep one")
        seen.add(key)
    return repos, labels


def load_bugs(path: Path) -> list[dict]:
    data = load_json(path)
    bugs = _need(data, "bugs", list, str(path))
    for i, b in enumerate(bugs):
        where = f"{path}: bugs[{i}]"
        for f, k in (("id", str), ("repo", str), ("parent_commit", str), ("path", str),
                     ("lines", list), ("scan", list), ("bug_class", str)):
            _need(b, f, k, where)
        if not b["lines"]:
            raise UserError(f"{where}: 'lines' is empty; give the buggy lines")
    return bugs


def _inside(path: str, folder: str) -> bool:
    folder = folder.strip("/")
    return folder in ("", ".") or path == folder or path.startswith(folder + "/")


def label_key(label: dict) -> Key:
    return (label["repo"], label["path"], int(label["line"]), label["rule"])


# ---- trees ------------------------------------------------------------------------------
def mirror_dir(mirrors: Path, repo: str) -> Path:
    """The git directory the fetch tool leaves for owner/name."""
    return mirrors / repo.replace("/", "+") / "repo"


def extract(gitdir: Path, commit: str, folders: Sequence[str], cache: Path, repo: str) -> Path:
    """The .py and .sh files (and project markers: pyproject.toml, setup.cfg) of the scan
    folders of ``repo`` at ``commit``, with an empty ``.git`` at the root as a clone has, under the cache
    (extracted once, then reused). Blobs the mirror lacks (snapshots leave out files of 4 MiB
    and more) are skipped; only the checker's own inputs are written."""
    want = "\n".join(sorted(folders)) + f"\n{EXTRACT_VERSION}"
    # keyed on the scan list as well: two runs with different scan lists share a cache safely
    dest = cache / repo.replace("/", "+") / f"{commit}-{hashlib.sha1(want.encode()).hexdigest()[:8]}"
    done = dest / ".extracted"
    if done.exists() and done.read_text() == want:
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    paths = [f.strip("/") for f in folders if f.strip("/") not in ("", ".")]
    ls = subprocess.run(["git", f"--git-dir={gitdir}", "ls-tree", "-r", "-z", commit, "--", *paths],
                        capture_output=True)
    if ls.returncode:
        raise UserError(f"{repo}: cannot list {commit[:12]} in {gitdir} "
                        f"({ls.stderr.decode(errors='replace').strip()}); check the commit in the corpus")
    blobs = []
    for entry in ls.stdout.split(b"\0"):
        if not entry:
            continue
        meta, _, name = entry.partition(b"\t")
        mode, kind, sha = meta.split()
        if kind == b"blob" and mode != b"120000" and (name.endswith((b".py", b".sh"))
                                                      or name.rsplit(b"/", 1)[-1] in _MARKERS):
            blobs.append((sha.decode(), name.decode()))
    listed = {n for _, n in blobs}
    absent = [f for f in paths if f not in listed and not any(n.startswith(f + "/") for n in listed)]
    if absent:
        raise UserError(f"{repo}: scan folder {absent[0]!r} holds no .py/.sh file at {commit[:12]}; fix 'scan'")
    cat = subprocess.run(["git", f"--git-dir={gitdir}", "cat-file", "--batch"],
                         input="".join(f"{sha}\n" for sha, _ in blobs).encode(), capture_output=True, check=True)
    out, pos = cat.stdout, 0
    for _sha, name in blobs:
        end = out.index(b"\n", pos)
        header = out[pos:end].split()
        pos = end + 1
        if header[-1] == b"missing":
            continue
        size = int(header[2])
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(out[pos:pos + size])
        pos += size + 1
    (dest / ".git").mkdir(exist_ok=True)  # the checkout's root, as a clone has it: one program
    done.write_text(want)
    return dest


def repo_path(path: str, dest: Path, roots: Sequence[Path]) -> str:
    """A finding's path relative to the repository root, whether the checker reported it
    absolute, relative to the working directory or relative to the scan root it came from."""
    p = Path(path)
    for cand in ([p] if p.is_absolute() else [p, *(r / p for r in roots if r.is_dir()), dest / p]):
        if cand.is_file():
            try:
                return cand.resolve().relative_to(dest.resolve()).as_posix()
            except ValueError:
                continue
    raise UserError(f"cannot place the finding path {path!r} under {dest}; the checker's path "
                    "format changed, update repo_path() in this bench")


def scan(dest: Path, repo: str, folders: Sequence[str], keep: Iterable[str] | None = None,
         amp_only: bool = True, min_confidence: Confidence | None = None) -> list[Hit]:
    """Findings of check_paths on the scan folders taken together (at the checker's default
    confidence for them unless ``min_confidence``); only files in ``keep`` (repository-relative
    paths) when given, only AMP rules when ``amp_only``."""
    roots = scan_roots(dest, folders)
    report = check_paths(roots, min_confidence=min_confidence)
    wanted = set(keep) if keep is not None else None
    hits = []
    for f in report.findings:
        rel = repo_path(f.path, dest, roots)
        if (wanted is None or rel in wanted) and (not amp_only or f.rule_id.startswith("AMP")):
            hits.append(Hit(repo, rel, f.line, f.rule_id, f.message, f.confidence.name.lower()))
    return sorted(hits, key=lambda h: h.key)


# ---- scoring ----------------------------------------------------------------------------
def match(hits: Sequence[Hit], labels: Sequence[dict]) -> tuple[list[tuple[Hit, dict]], list[Hit], list[dict]]:
    """(labelled findings with their label, unlabelled findings, labels no finding matched)."""
    by_key = {label_key(lab): lab for lab in labels}
    found = {h.key for h in hits}
    labelled = [(h, by_key[h.key]) for h in hits if h.key in by_key]
    unlabelled = [h for h in hits if h.key not in by_key]
    stale = [lab for lab in labels if label_key(lab) not in found]
    return labelled, unlabelled, stale


def precision_table(labelled: Sequence[tuple[Hit, dict]], by: str = "rule") -> dict[str, dict]:
    """rule (or repo, with by="repo") -> {tp, fp, precision}; plus 'overall' and
    'overall_without_AMP007' (deprecation warnings set aside)."""
    def row(pairs: Iterable[tuple[Hit, dict]]) -> dict:
        c = Counter(lab["verdict"] for _, lab in pairs)
        n = c["tp"] + c["fp"]
        return {"tp": c["tp"], "fp": c["fp"], "precision": c["tp"] / n if n else None}

    keys = sorted({getattr(h, by) for h, _ in labelled})
    table = {k: row(p for p in labelled if getattr(p[0], by) == k) for k in keys}
    table["overall"] = row(labelled)
    table["overall_without_AMP007"] = row(p for p in labelled if p[0].rule != "AMP007")
    return table


def bug_caught(bug: dict, hits: Sequence[Hit]) -> Hit | None:
    """The finding that catches ``bug`` (schema: its expected rule, or any AMP rule but the
    deprecation notice AMP007 when none, on its file within BUG_WINDOW lines of its buggy
    lines), or None. A deprecation notice that happens to sit on a buggy line says nothing
    about the bug."""
    lo, hi = min(bug["lines"]) - BUG_WINDOW, max(bug["lines"]) + BUG_WINDOW
    want = bug.get("expect_rule")
    for h in hits:
        if h.path == bug["path"] and lo <= h.line <= hi and (h.rule == want if want else h.rule.startswith("AMP") and h.rule != "AMP007"):
            return h
    return None


def recall(bugs: Sequence[dict], hits_by_bug: dict[str, list[Hit]]) -> tuple[float | None, list[dict]]:
    """(caught / scanned, missed bugs) over the bugs that were scanned (keys of hits_by_bug)."""
    scanned = [b for b in bugs if b["id"] in hits_by_bug]
    missed = [b for b in scanned if bug_caught(b, hits_by_bug[b["id"]]) is None]
    return ((len(scanned) - len(missed)) / len(scanned) if scanned else None), missed


# ---- timing -----------------------------------------------------------------------------
def python_files(folders: Iterable[Path]) -> list[Path]:
    out: list[Path] = []
    for f in folders:
        out += sorted(f.rglob("*.py")) if f.is_dir() else [f] if f.suffix == ".py" else []
    return out


def scan_roots(dest: Path, folders: Sequence[str]) -> list[Path]:
    return [dest / f.strip("/") if f.strip("/") not in ("", ".") else dest for f in folders]


def tree_lines(roots: Sequence[Path]) -> int:
    return sum(len(f.read_bytes().splitlines()) for f in python_files(roots))


def timing_tree(trees: Sequence[tuple[str, Path, Sequence[str]]], target: int = TIMING_LINES,
                repo: str | None = None) -> tuple[str, list[Path]]:
    """The scan folders (as extracted, structure intact) of ``repo``, or of the repository
    whose scan folders hold the number of Python lines closest to ``target``."""
    if repo is not None:
        chosen = [t for t in trees if t[0] == repo]
        if not chosen:
            raise UserError(f"--timing-repo {repo}: not among the scanned repositories")
        return repo, scan_roots(chosen[0][1], chosen[0][2])
    name, dest, folders = min(trees, key=lambda t: abs(tree_lines(scan_roots(t[1], t[2])) - target))
    return name, scan_roots(dest, folders)


def time_scan(roots: Sequence[Path], repeats: int = 3) -> dict:
    """Seconds for check_paths on ``roots`` taken together (best of ``repeats``) against the
    seconds to only read and parse the same .py files: the same run's baseline."""
    files = python_files(roots)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    parse_s = best(lambda: [ast.parse(p.read_bytes()) for p in files])
    check_s = best(lambda: check_paths(list(roots)))
    return {"files": len(files), "lines": tree_lines(roots), "check_s": check_s, "parse_s": parse_s,
            "ratio_to_parse": check_s / parse_s if parse_s else None, "goal_s": TIMING_GOAL_S}


# ---- report -----------------------------------------------------------------------------
def source_line(dest: Path, hit: Hit) -> str:
    try:
        return (dest / hit.path).read_text(errors="replace").splitlines()[hit.line - 1].strip()
    except (OSError, IndexError):
        return "?"


def _fmt_p(p: float | None) -> str:
    return "   -" if p is None else f"{p:.2f}"


def print_table(table: dict[str, dict], head: str = "rule") -> None:
    print(f"{head:34s} {'tp':>4s} {'fp':>4s} precision")
    for key, r in table.items():
        print(f"{key:34s} {r['tp']:4d} {r['fp']:4d} {_fmt_p(r['precision'])}")


def score_labelled_set(name: str, path: Path, repos: list[dict], labels: list[dict],
                       tree: Callable[[str, str, Sequence[str]], Path | None],
                       folders_of: Callable[[dict], list[str]], minimum: Confidence | None,
                       quiet: bool) -> tuple[dict, list]:
    """Scan each entry of a labelled set (the training-file corpus, or the model libraries) at
    its commit, print its precision tables, unlabelled findings and stale labels; the result
    for --json and the scanned trees (for the timing)."""
    hits: list[Hit] = []
    dests: dict[str, Path] = {}
    trees: list[tuple[str, Path, Sequence[str]]] = []
    n_files = n_lines = 0
    for r in repos:
        dest = tree(r["repo"], r["commit"], folders_of(r))
        if dest is None:
            continue
        absent = [f for f in r["files"] if not (dest / f).is_file()]
        if absent:
            raise UserError(f"{path}: {r['repo']} has no {absent[0]} at {r['commit'][:12]}; fix 'files'")
        t0 = time.perf_counter()
        got = scan(dest, r["repo"], folders_of(r), r["files"], min_confidence=minimum)
        n_files += len(r["files"])
        n_lines += sum(len((dest / f).read_bytes().splitlines()) for f in r["files"])
        if not quiet:
            print(f"{r['repo']}@{r['commit'][:12]}: {len(r['files'])} files, {len(got)} findings "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
        hits += got
        dests[r["repo"]] = dest
        trees.append((r["repo"], dest, folders_of(r)))

    labelled, unlabelled, stale = match(hits, labels)
    table = precision_table(labelled)
    table_by_confidence = precision_table(labelled, by="confidence")
    print(f"\n{name}: {len(dests)} repositories, {n_files} files, {n_lines} lines, {len(hits)} findings "
          f"({len(labelled)} labelled)")
    print_table(table)
    print()
    print_table({k: v for k, v in table_by_confidence.items() if not k.startswith("overall")}, head="confidence")
    by_repo = precision_table(labelled, by="repo")
    print()
    print_table({k: v for k, v in by_repo.items() if not k.startswith("overall")}, head="repository")
    if unlabelled:
        print(f"\nunlabelled findings ({len(unlabelled)}):")
        for h in unlabelled:
            print(f"  {h.repo} {h.path}:{h.line} {h.rule} ({h.confidence}) {h.message}\n"
                  f"      | {source_line(dests[h.repo], h)}")
    if stale:
        print(f"\nlabels that match no finding now ({len(stale)}):")
        for lab in stale:
            print(f"  {lab['repo']} {lab['path']}:{lab['line']} {lab['rule']} [{lab['verdict']}] {lab['why']}")

    result: dict = {"repositories": len(dests), "files": n_files, "lines": n_lines,
                    "findings": len(hits), "precision": table, "precision_by_repo": by_repo,
                    "precision_by_confidence": table_by_confidence,
                    "unlabelled": [h.__dict__ for h in unlabelled], "stale_labels": stale}
    return result, trees


def score_bugs(label: str, bugs: list[dict], tree: Callable[[str, str, Sequence[str]], Path | None],
               folders_of: Callable[[dict], list[str]], minimum: Confidence | None, quiet: bool) -> dict:
    """Scan each bug's folders at its parent commit and print the recall and the missed bugs."""
    by_bug: dict[str, list[Hit]] = {}
    for b in bugs:
        dest = tree(b["repo"], b["parent_commit"], folders_of(b))
        if dest is None:
            continue
        if not (dest / b["path"]).is_file():
            print(f"bug {b['id']}: {b['path']} is not in its scan folders at {b['parent_commit'][:12]}; "
                  "skipped (fix 'path' or 'scan' in the bugs file)")
            continue
        by_bug[b["id"]] = scan(dest, b["repo"], folders_of(b), [b["path"]], min_confidence=minimum)
        if not quiet:
            hit = bug_caught(b, by_bug[b["id"]])
            print(f"bug {b['id']}: " + (f"caught by {hit.rule} at line {hit.line}" if hit else "missed"), flush=True)
    rec, missed = recall(bugs, by_bug)
    print(f"\n{label}: {len(by_bug)} scanned of {len(bugs)}, recall {_fmt_p(rec)} "
          f"({len(by_bug) - len(missed)}/{len(by_bug)})")
    for b in missed:
        print(f"  missed {b['id']} [{b['bug_class']}] expect {b.get('expect_rule') or 'any AMP rule'} "
              f"at {b['path']}:{min(b['lines'])}-{max(b['lines'])}")
    return {"scanned": len(by_bug), "total": len(bugs), "recall": rec,
            "missed": [{"id": b["id"], "bug_class": b["bug_class"], "expect_rule": b.get("expect_rule")}
                       for b in missed]}


# Each held-out set's recall at the default while it was still blind (caught, scanned; measured
# with the code before the rules that read it, bench/realcode/BUGS.md). Every set has since been
# read, so these are the only blind numbers; the recall measured now is development recall.
BLIND_RECALL = {"bugs_heldout.json": (4, 19), "bugs_heldout2.json": (4, 49),
                "bugs_heldout3.json": (2, 45), "bugs_heldout4.json": (8, 42)}


def print_summary(result: dict, sets: Sequence[tuple[str, str, Path]]) -> dict:
    """The checker's three numbers on one table: real-code precision at the default (the
    corpus and the model libraries together), development recall (every bug set, scored now)
    and blind recall (each held-out set while it was blind, as recorded)."""
    tp = fp = 0
    for part in (result, result.get("libraries") or {}):
        row = (part.get("precision") or {}).get("overall") or {}
        tp, fp = tp + row.get("tp", 0), fp + row.get("fp", 0)
    caught = scanned = 0
    for key, _, _ in sets:
        r = result.get(key)
        if r and r["recall"] is not None:
            caught += round(r["recall"] * r["scanned"])
            scanned += r["scanned"]
    b_caught = sum(c for c, _ in BLIND_RECALL.values())
    b_total = sum(n for _, n in BLIND_RECALL.values())
    summary = {"precision": tp / (tp + fp) if tp + fp else None, "precision_counts": [tp, fp],
               "development_recall": caught / scanned if scanned else None, "development_counts": [caught, scanned],
               "blind_recall": b_caught / b_total, "blind_counts": [b_caught, b_total],
               "blind_by_set": {k: c / n for k, (c, n) in BLIND_RECALL.items()}}
    def three(x: float | None) -> str:  # 0.948 must not print as 0.95 against a 0.95 goal
        return "-" if x is None else f"{x:.3f}"
    print(f"\nsummary: real-code precision {three(summary['precision'])} ({tp}/{tp + fp}) at the default; "
          f"development recall {three(summary['development_recall'])} ({caught}/{scanned}); "
          f"blind recall {three(summary['blind_recall'])} ({b_caught}/{b_total}: "
          + ", ".join(f"{k} {c}/{n}" for k, (c, n) in BLIND_RECALL.items()) + ", as recorded while blind)")
    return summary


def heldout_key(path: Path) -> str:
    """The result key of a held-out set: ``heldout_bugs`` for bugs_heldout.json, and the file's
    suffix after it for later sets (bugs_heldout2.json -> ``heldout_bugs2``)."""
    return "heldout_bugs" + path.stem.removeprefix("bugs_heldout")


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="bench_checker_realcode", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="corpus.json (repos + labels)")
    p.add_argument("--bugs", type=Path, default=DEFAULT_BUGS, help="bugs.json; recall is skipped when absent")
    p.add_argument("--heldout", type=Path, action="append", default=None,
                   help="a held-out bugs file: real bugs chosen after the rules were written, scored apart "
                   "(repeatable; default: every bugs_heldout*.json beside --bugs, in name order)")
    p.add_argument("--libraries", type=Path, default=None,
                   help="libraries.json: model-library folders (nothing in them trains) and their labels, in "
                   "corpus.json's format (default: libraries.json beside --corpus; skipped when absent)")
    p.add_argument("--mirrors", type=Path, default=Path("/work/.mirror"),
                   help="folder of git mirrors named owner+name/repo (default /work/.mirror)")
    p.add_argument("--cache", type=Path, default=Path("/tmp/realcode_cache"),
                   help="where scan folders are extracted (default /tmp/realcode_cache)")
    p.add_argument("--repo", action="append", default=[], help="only this repository (repeatable)")
    p.add_argument("--json", type=Path, help="write the tables, unlabelled findings and recall here")
    p.add_argument("--no-timing", action="store_true", help="skip the ~10,000-line scan timing")
    p.add_argument("--timing-repo", help="time this repository's scan folders (default: the one "
                   "closest to 10,000 lines)")
    p.add_argument("--quiet", action="store_true", help="no per-repository progress lines")
    p.add_argument("--scan-root", choices=["recorded", "repo"], default="recorded",
                   help="what each scan covers: the entry's recorded scan folders (default), or the "
                   "whole repository at that commit, as a user runs the checker on a checkout's root "
                   "(much slower: diffusers alone takes minutes)")
    p.add_argument("--min-confidence", choices=["low", "medium", "high"], default=None,
                   help="score findings at or above this confidence (default: what the checker "
                   "shows for the scan: high for a project, every confidence for loose scripts)")
    return p


@cli_entry("bench_checker_realcode")
def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    for flag, path in [("--heldout", h) for h in a.heldout or []] + [("--libraries", a.libraries)]:
        if path is not None and not path.is_file():
            raise UserError(f"{flag} {path}: no such file; give a file in "
                            f"{'bugs.json' if flag == '--heldout' else 'corpus.json'}'s format")
    repos, labels = load_corpus(a.corpus)
    if a.repo:
        unknown = sorted(set(a.repo) - {r["repo"] for r in repos})
        if unknown:
            raise UserError(f"--repo {unknown[0]}: not in {a.corpus}; pick one of its repos")
        repos = [r for r in repos if r["repo"] in a.repo]
        labels = [lab for lab in labels if lab["repo"] in a.repo]
    missing: list[str] = []
    minimum = Confidence.parse(a.min_confidence) if a.min_confidence else None

    def folders_of(entry: dict) -> list[str]:
        return ["."] if a.scan_root == "repo" else entry["scan"]

    def tree(repo: str, commit: str, folders: Sequence[str]) -> Path | None:
        gitdir = mirror_dir(a.mirrors, repo)
        if not gitdir.is_dir():
            if repo not in missing:
                print(f"{repo}: not on this machine; fetch it with the fetch tool (github:{repo})")
                missing.append(repo)
            return None
        return extract(gitdir, commit, folders, a.cache, repo)

    result, trees = score_labelled_set("corpus", a.corpus, repos, labels, tree, folders_of, minimum, a.quiet)
    result.update({"min_confidence": a.min_confidence or "checker default", "scan_root": a.scan_root})
    libraries = a.libraries or a.corpus.parent / "libraries.json"
    if libraries.exists():
        lib_repos, lib_labels = load_corpus(libraries)
        if a.repo:
            lib_repos = [r for r in lib_repos if r["repo"] in a.repo]
            lib_labels = [lab for lab in lib_labels if lab["repo"] in a.repo]
        result["libraries"], _ = score_labelled_set("model libraries", libraries, lib_repos, lib_labels, tree,
                                                    folders_of, minimum, a.quiet)

    heldout = a.heldout or sorted(a.bugs.parent.glob("bugs_heldout*.json"))
    sets = [("bugs", "real bugs", a.bugs)] + [(heldout_key(h), f"held-out real bugs ({h.name})", h) for h in heldout]
    for key, label, path in sets:
        if not path.exists():
            if key == "bugs":
                print(f"\nreal bugs: {path} not found; recall skipped")
            continue
        bugs = load_bugs(path)
        if a.repo:
            bugs = [b for b in bugs if b["repo"] in a.repo]
        result[key] = score_bugs(label, bugs, tree, folders_of, minimum, a.quiet)

    result["summary"] = print_summary(result, sets)

    if not a.no_timing and trees:
        name, roots = timing_tree(trees, repo=a.timing_repo)
        t = time_scan(roots)
        t["repo"] = name
        print(f"\nscan of a real tree ({name}: {', '.join(r.name for r in roots)}): {t['files']} files, "
              f"{t['lines']} lines in {t['check_s']:.2f} s "
              f"(goal < {TIMING_GOAL_S:g} s; parsing alone {t['parse_s']:.2f} s, ratio {t['ratio_to_parse']:.1f}x)")
        result["timing"] = t

    if a.json:
        atomic_write_json(a.json, result, make_parents=True)
        print(f"wrote {a.json}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
