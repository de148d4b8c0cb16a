"""The real-code benchmark's own logic (bench/bench_checker_realcode.py) on a tiny corpus of our
own: a git repository made here (two small files written for this test), served the way the fetch
tool leaves mirrors, so extraction at a commit, matching to labels, precision, recall on bugs and
the missing-mirror path are all exercised without network or public code."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lowp_common import UserError

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")

_BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_checker_realcode.py"
_spec = importlib.util.spec_from_file_location("bench_checker_realcode", _BENCH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)

# Our own training step: float16 autocast + a GradScaler, clipping before unscale_ (AMP010), the
# deprecated torch.cuda.amp.GradScaler spelled out (AMP007).
TRAIN = '''import torch


def make_scaler():
    return torch.cuda.amp.GradScaler()


def step(model, batch, opt, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch).float().pow(2).mean()
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
'''
CLIP_LINE = 12
SCALER_LINE = 5
# A second file in the scan folder that is not listed: its findings must not count.
HELPER = '''import torch


def old_scaler():
    return torch.cuda.amp.GradScaler()
'''
REPO = "own/toy"


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


@pytest.fixture(scope="module")
def mirror(tmp_path_factory) -> tuple[Path, str]:
    """(mirrors folder, commit): a bare mirror at <mirrors>/own+toy/repo, like the fetch tool's."""
    root = tmp_path_factory.mktemp("realcode")
    work = root / "work"
    (work / "pkg").mkdir(parents=True)
    (work / "pkg" / "train.py").write_text(TRAIN)
    (work / "pkg" / "helper.py").write_text(HELPER)
    (work / "README").write_text("outside the scan folder\n")
    (work / "tools.py").write_text("import torch\n")  # outside the scan folder: only a whole-repo scan reads it
    (work / "pkg" / "notes.txt").write_text("not a file the checker reads\n")
    _git(work, "init", "-q")
    _git(work, "add", ".")
    _git(work, "commit", "-qm", "toy")
    commit = _git(work, "rev-parse", "HEAD")
    mirrors = root / "mirrors"
    mirrors.mkdir()
    _git(root, "clone", "-q", "--bare", str(work), str(mirrors / "own+toy" / "repo"))
    return mirrors, commit


def _corpus(path: Path, commit: str, labels: list[dict], extra_repos: list[dict] = ()) -> Path:
    path.write_text(json.dumps({"repos": [{"repo": REPO, "commit": commit, "scan": ["pkg"],
                                           "files": ["pkg/train.py"]}, *extra_repos],
                                "labels": labels}))
    return path


def _label(line: int, rule: str, verdict: str) -> dict:
    return {"repo": REPO, "path": "pkg/train.py", "line": line, "rule": rule, "verdict": verdict,
            "why": "test label"}


def test_extract_and_scan_keep_only_listed_files(mirror, tmp_path) -> None:
    mirrors, commit = mirror
    dest = bench.extract(bench.mirror_dir(mirrors, REPO), commit, ["pkg"], tmp_path, REPO)
    assert sorted(p.name for p in (dest / "pkg").iterdir()) == ["helper.py", "train.py"]
    assert not (dest / "README").exists() and not (dest / "pkg" / "notes.txt").exists()  # scan folders' .py/.sh only
    hits = bench.scan(dest, REPO, ["pkg"], ["pkg/train.py"])
    keys = {h.key for h in hits}
    assert (REPO, "pkg/train.py", CLIP_LINE, "AMP010") in keys
    assert all(h.path == "pkg/train.py" for h in hits)
    assert len(bench.scan(dest, REPO, ["pkg"])) > len(hits)   # helper.py's finding is dropped above
    # The checker may report paths absolute, or relative to the scan root: both map back.
    roots = [dest / "pkg"]
    assert {bench.repo_path(x, dest, roots) for x in (str(dest / "pkg" / "train.py"), "train.py",
                                                      "pkg/train.py")} == {"pkg/train.py"}
    with pytest.raises(UserError, match="cannot place"):
        bench.repo_path("elsewhere.py", dest, roots)
    # A second extraction reuses the cache; a wrong folder is one clear error.
    assert bench.extract(bench.mirror_dir(mirrors, REPO), commit, ["pkg"], tmp_path, REPO) == dest
    with pytest.raises(UserError, match="scan folder 'nope'"):
        bench.extract(bench.mirror_dir(mirrors, REPO), commit, ["nope"], tmp_path / "x", REPO)


def test_match_and_precision_table() -> None:
    hits = [bench.Hit(REPO, "a.py", 3, "AMP001", ""), bench.Hit(REPO, "a.py", 5, "AMP007", ""),
            bench.Hit(REPO, "a.py", 9, "AMP010", ""), bench.Hit(REPO, "a.py", 11, "AMP010", "")]
    labels = [{"repo": REPO, "path": "a.py", "line": 3, "rule": "AMP001", "verdict": "fp", "why": ""},
              {"repo": REPO, "path": "a.py", "line": 5, "rule": "AMP007", "verdict": "tp", "why": ""},
              {"repo": REPO, "path": "a.py", "line": 9, "rule": "AMP010", "verdict": "tp", "why": ""},
              {"repo": REPO, "path": "a.py", "line": 9, "rule": "AMP004", "verdict": "tp", "why": ""}]
    labelled, unlabelled, stale = bench.match(hits, labels)
    assert [h.line for h, _ in labelled] == [3, 5, 9]
    assert [(h.line, h.rule) for h in unlabelled] == [(11, "AMP010")]
    assert [(s["line"], s["rule"]) for s in stale] == [(9, "AMP004")]   # same line, other rule
    t = bench.precision_table(labelled)
    assert t["AMP001"] == {"tp": 0, "fp": 1, "precision": 0.0}
    assert t["overall"]["tp"] == 2 and t["overall"]["precision"] == pytest.approx(2 / 3)
    assert t["overall_without_AMP007"] == {"tp": 1, "fp": 1, "precision": 0.5}
    assert bench.precision_table([])["overall"]["precision"] is None
    other = (bench.Hit("own/other", "b.py", 1, "AMP007", ""), {"verdict": "fp"})
    by_repo = bench.precision_table([*labelled, other], by="repo")
    assert by_repo[REPO] == {"tp": 2, "fp": 1, "precision": pytest.approx(2 / 3)}
    assert by_repo["own/other"]["fp"] == 1 and by_repo["overall"]["fp"] == 2


@pytest.mark.parametrize("line,rule,expect,caught", [
    (7, "AMP010", "AMP010", True), (6, "AMP010", "AMP010", False),      # 3 lines before 10 ...
    (15, "AMP010", "AMP010", True), (16, "AMP010", "AMP010", False),    # ... and after 12
    (11, "AMP001", "AMP010", False),                                    # another rule
    (11, "AMP001", None, True), (11, "LCH001", None, False),            # any AMP rule when none expected
])
def test_bug_window(line: int, rule: str, expect: str | None, caught: bool) -> None:
    bug = {"id": "b", "path": "a.py", "lines": [12, 10], "expect_rule": expect, "bug_class": "c"}
    assert (bench.bug_caught(bug, [bench.Hit(REPO, "a.py", line, rule, "")]) is not None) is caught
    assert bench.bug_caught(bug, [bench.Hit(REPO, "b.py", 11, "AMP010", "")]) is None   # other file


def test_recall_counts_only_scanned_bugs() -> None:
    bugs = [{"id": i, "path": "a.py", "lines": [10], "expect_rule": "AMP010", "bug_class": "c"}
            for i in ("hit", "miss", "unscanned")]
    rec, missed = bench.recall(bugs, {"hit": [bench.Hit(REPO, "a.py", 10, "AMP010", "")], "miss": []})
    assert rec == 0.5 and [b["id"] for b in missed] == ["miss"]
    assert bench.recall(bugs, {}) == (None, [])


def test_main_end_to_end(mirror, tmp_path, capsys) -> None:
    mirrors, commit = mirror
    corpus = _corpus(tmp_path / "corpus.json", commit, [
        _label(CLIP_LINE, "AMP010", "tp"), _label(SCALER_LINE, "AMP007", "fp"),
        _label(1, "AMP001", "tp")])   # matches nothing: reported as stale
    bugs = tmp_path / "bugs.json"
    bugs.write_text(json.dumps({"bugs": [
        {"id": "clip", "repo": REPO, "parent_commit": commit, "path": "pkg/train.py",
         "lines": [CLIP_LINE + 3], "scan": ["pkg"], "bug_class": "clip-without-unscale", "expect_rule": "AMP010"},
        {"id": "bce", "repo": REPO, "parent_commit": commit, "path": "pkg/train.py",
         "lines": [CLIP_LINE], "scan": ["pkg"], "bug_class": "bce", "expect_rule": "AMP002"},
        {"id": "gone", "repo": REPO, "parent_commit": commit, "path": "pkg/gone.py",
         "lines": [1], "scan": ["pkg"], "bug_class": "x", "expect_rule": None}]}))
    out = tmp_path / "out.json"
    rc = bench.main(["--corpus", str(corpus), "--bugs", str(bugs), "--mirrors", str(mirrors),
                     "--cache", str(tmp_path / "cache"), "--json", str(out), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["files"] == 1 and r["lines"] == len(TRAIN.splitlines())
    assert r["precision"]["AMP010"] == {"tp": 1, "fp": 0, "precision": 1.0}
    assert r["precision"]["overall"]["precision"] == 0.5
    assert [(s["line"], s["rule"]) for s in r["stale_labels"]] == [(1, "AMP001")]
    assert r["bugs"]["recall"] == 0.5 and [m["id"] for m in r["bugs"]["missed"]] == ["bce"]
    assert "missed bce [bce]" in text
    assert "bug gone: pkg/gone.py is not in its scan folders" in text and r["bugs"]["scanned"] == 2
    assert r["timing"]["lines"] == len(TRAIN.splitlines()) + len(HELPER.splitlines())
    assert r["timing"]["check_s"] > 0


def test_library_set_beside_the_corpus_is_scored_apart(mirror, tmp_path, capsys) -> None:
    """libraries.json next to corpus.json (same format) gets its own precision tables; a
    corpus without one is scored alone."""
    mirrors, commit = mirror
    corpus = _corpus(tmp_path / "corpus.json", commit, [_label(CLIP_LINE, "AMP010", "tp")])
    _corpus(tmp_path / "libraries.json", commit, [_label(CLIP_LINE, "AMP010", "fp")])
    out = tmp_path / "out.json"
    args = ["--corpus", str(corpus), "--bugs", str(tmp_path / "none.json"), "--mirrors", str(mirrors),
            "--cache", str(tmp_path / "cache"), "--json", str(out), "--quiet", "--no-timing"]
    assert bench.main(args) == 0
    r = json.loads(out.read_text())
    assert r["precision"]["AMP010"]["precision"] == 1.0
    assert r["libraries"]["precision"]["AMP010"] == {"tp": 0, "fp": 1, "precision": 0.0}
    assert "model libraries: 1 repositories" in capsys.readouterr().out
    (tmp_path / "libraries.json").unlink()
    assert bench.main(args) == 0 and "libraries" not in json.loads(out.read_text())


def test_heldout_bugs_beside_the_bugs_are_scored_apart(mirror, tmp_path, capsys) -> None:
    mirrors, commit = mirror
    corpus = _corpus(tmp_path / "corpus.json", commit, [])
    record = {"repo": REPO, "parent_commit": commit, "path": "pkg/train.py", "scan": ["pkg"],
              "bug_class": "clip-without-unscale", "expect_rule": "AMP010"}
    bugs = tmp_path / "bugs.json"
    bugs.write_text(json.dumps({"bugs": [{**record, "id": "seen", "lines": [CLIP_LINE]}]}))
    (tmp_path / "bugs_heldout.json").write_text(json.dumps({"bugs": [
        {**record, "id": "fresh", "lines": [CLIP_LINE]}, {**record, "id": "far", "lines": [CLIP_LINE + 20]}]}))
    (tmp_path / "bugs_heldout2.json").write_text(json.dumps({"bugs": [
        {**record, "id": "later", "lines": [CLIP_LINE + 20]}]}))
    out = tmp_path / "out.json"
    assert bench.main(["--corpus", str(corpus), "--bugs", str(bugs), "--mirrors", str(mirrors), "--cache",
                       str(tmp_path / "cache"), "--json", str(out), "--quiet", "--no-timing"]) == 0
    r = json.loads(out.read_text())
    assert r["bugs"]["recall"] == 1.0
    assert r["heldout_bugs"]["recall"] == 0.5 and [m["id"] for m in r["heldout_bugs"]["missed"]] == ["far"]
    assert r["heldout_bugs2"]["recall"] == 0.0   # every set beside the bugs, each scored apart
    text = capsys.readouterr().out
    assert "held-out real bugs (bugs_heldout.json): 2 scanned of 2, recall 0.50 (1/2)" in text
    assert "held-out real bugs (bugs_heldout2.json): 1 scanned of 1, recall 0.00 (0/1)" in text


def test_scan_root_repo_scans_the_whole_repository(mirror, tmp_path) -> None:
    """``--scan-root repo``: the checker gets the checkout's root, not the recorded folders, so
    the extraction holds every Python file and the scan is one project from the root."""
    mirrors, commit = mirror
    corpus = _corpus(tmp_path / "corpus.json", commit, [_label(CLIP_LINE, "AMP010", "tp")])
    out = tmp_path / "out.json"
    rc = bench.main(["--corpus", str(corpus), "--bugs", str(tmp_path / "none.json"), "--mirrors",
                     str(mirrors), "--cache", str(tmp_path / "cache"), "--json", str(out), "--quiet",
                     "--no-timing", "--scan-root", "repo"])
    r = json.loads(out.read_text())
    assert rc == 0 and r["scan_root"] == "repo"
    assert r["precision"]["AMP010"] == {"tp": 1, "fp": 0, "precision": 1.0}
    (dest,) = [d for d in (tmp_path / "cache").rglob("pkg")]
    assert sorted(p.relative_to(dest.parent).as_posix() for p in dest.parent.rglob("*.py")) == [
        "pkg/helper.py", "pkg/train.py", "tools.py"]


def test_missing_mirror_is_one_line_and_exit_1(mirror, tmp_path, capsys) -> None:
    mirrors, commit = mirror
    corpus = _corpus(tmp_path / "corpus.json", commit, [], extra_repos=[
        {"repo": "nobody/absent", "commit": "0" * 40, "scan": ["x"], "files": ["x/a.py"]}])
    rc = bench.main(["--corpus", str(corpus), "--bugs", str(tmp_path / "none.json"), "--mirrors",
                     str(mirrors), "--cache", str(tmp_path / "cache"), "--no-timing", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "nobody/absent: not on this machine; fetch it with the fetch tool (github:nobody/absent)" in out
    assert "corpus: 1 repositories, 1 files" in out        # the present repository still ran


@pytest.mark.parametrize("corpus,message", [
    ("{", "not valid JSON"),
    ('{"repos": [{"repo": "a/b"}]}', "repos[0]: needs a str field 'commit'"),
    ('{"repos": [{"repo": "a/b", "commit": "c", "scan": ["x"], "files": ["y/z.py"]}]}',
     "file 'y/z.py' is in no scan folder"),
    ('{"repos": [], "labels": [{"repo": "a/b", "path": "p", "line": 1, "rule": "AMP001", '
     '"verdict": "maybe", "why": "w"}]}', "verdict 'maybe'"),
])
def test_bad_corpus_is_one_line(tmp_path, capsys, corpus: str, message: str) -> None:
    path = tmp_path / "corpus.json"
    path.write_text(corpus)
    assert bench.main(["--corpus", str(path), "--no-timing"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--heldout", "--libraries"])
def test_a_named_set_that_is_not_there_is_one_line(tmp_path, capsys, flag: str) -> None:
    """A set the user names explicitly and mistypes is an error, not silently skipped (only the
    defaults beside corpus.json/bugs.json may be absent)."""
    corpus = tmp_path / "corpus.json"
    corpus.write_text('{"repos": [], "labels": []}')
    assert bench.main(["--corpus", str(corpus), flag, str(tmp_path / "typo.json"), "--no-timing"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{flag} {tmp_path / 'typo.json'}: no such file" in err and len(err.splitlines()) == 1
