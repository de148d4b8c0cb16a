"""Recall of amp-static-check on the real AMP bugs of bench/realcode/bugs.json.

For each bug the scan folders are extracted at the parent of the fix commit from a local
mirror (the `fetch` tool's /work/.mirror/<owner>+<name>/repo), the checker runs on them as one
project, and the bug counts as caught when a finding of expect_rule (any AMP rule when
expect_rule is null) lands on the bug's file within [min(lines)-3, max(lines)+3].
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from lowp_common import UserError, cli_entry  # noqa: E402  (the script runs from any folder)

SLACK = 3


def _extract(gitdir: Path, commit: str, folders: list[str], dest: Path) -> None:
    """Write the folders of one commit under dest (git archive | tar)."""
    spec = [] if folders == ["."] else folders
    done = subprocess.run(["git", f"--git-dir={gitdir}", "archive", commit, *spec], capture_output=True)
    if done.returncode:
        raise UserError(f"{gitdir}: cannot archive {commit} {' '.join(spec)} "
                        f"({done.stderr.decode(errors='replace').strip()}); fetch the repository again")
    archive = done.stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def _findings(root: Path, folders: list[str]) -> list[dict]:
    """Run the checker from root on the folders; return its findings."""
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]))
    out = subprocess.run([sys.executable, "-m", "training_profiler.static_checker", "--format", "json",
                          "--fail-on", "high", *folders], cwd=root, env=env, capture_output=True, text=True)
    if out.returncode not in (0, 1):
        raise RuntimeError(f"checker failed on {folders}: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)["findings"]


def measure(bug: dict, mirror: Path) -> dict:
    """Caught or not, and the AMP findings on the bug's file near its lines."""
    gitdir = mirror / bug["repo"].replace("/", "+") / "repo"
    if not gitdir.is_dir():
        raise UserError(f"{gitdir}: no mirror of {bug['repo']}; fetch it (github:{bug['repo']}) or pass --mirror")
    lo, hi = min(bug["lines"]) - SLACK, max(bug["lines"]) + SLACK
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _extract(gitdir, bug["parent_commit"], bug["scan"], root)
        found = _findings(root, bug["scan"])
    near = [f for f in found if os.path.normpath(f["path"]) == os.path.normpath(bug["path"])
            and lo <= f["line"] <= hi and f["rule"].startswith("AMP")]
    want = bug["expect_rule"]
    caught = any(want is None or f["rule"] == want for f in near)
    return {"id": bug["id"], "caught": caught, "near": [(f["rule"], f["line"]) for f in near],
            "on_file": sorted({(f["rule"], f["line"]) for f in found
                               if os.path.normpath(f["path"]) == os.path.normpath(bug["path"])})}


def _load(path: Path) -> list[dict]:
    """The bug records of a bugs.json file."""
    try:
        return json.loads(path.read_text())["bugs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path}: not a readable bugs.json with a 'bugs' list ({exc})") from None


@cli_entry("measure_bugs")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bugs", type=Path, default=HERE / "bugs.json", help="bugs file (default %(default)s)")
    parser.add_argument("--mirror", type=Path, default=Path("/work/.mirror"),
                        help="folder of git mirrors named owner+name/repo (default %(default)s)")
    parser.add_argument("--only", default="", help="comma-separated bug ids to measure (default all)")
    args = parser.parse_args(argv)
    bugs = _load(args.bugs)
    only = {s for s in args.only.split(",") if s}
    unknown = only - {b["id"] for b in bugs}
    if unknown:
        raise UserError(f"--only: unknown bug id(s) {', '.join(sorted(unknown))}; see {args.bugs}")
    results = [measure(b, args.mirror) for b in bugs if not only or b["id"] in only]
    for r in results:
        print(f"{r['id']:40s} {'CAUGHT' if r['caught'] else 'missed'}  near={r['near']}  file={r['on_file'][:8]}")
    print(f"recall {sum(r['caught'] for r in results)}/{len(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
