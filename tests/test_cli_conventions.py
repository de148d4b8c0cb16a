"""One exit-code convention for every command (issue 40): 0 ran, 2 a user mistake told in one
line ``prog: error: ...`` on stderr (never a traceback), 1 only when the tool itself failed;
no abbreviated options; a closed stdout is a quiet exit.

Every console script of setup.py is called here in-process with the mistakes a new user makes
(missing file, corrupt file, unknown name, misspelt or abbreviated flag, unwritable output);
``test_every_console_script_has_its_mistakes`` fails when a new command has no row. The script
paths (``python quant/mxfp_scaling_test.py``, ``bash script/one_click_visualize.sh``) and the
closed pipe run as processes in tests/test_cli_processes.py (slow tier).
"""
from __future__ import annotations

import ast
import importlib
import re
import subprocess
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parent.parent
PARSERS = ("ArgumentParser",)


def console_scripts() -> dict[str, str]:
    """name -> "module:function", read from setup.py's entry_points (the one list)."""
    text = (REPO / "setup.py").read_text(encoding="utf-8")
    return dict(re.findall(r'"([a-z0-9-]+)=([\w.]+:\w+)"', text))


def _main(target: str) -> Callable:
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


# ----------------------------------------------------------------------------------------------
# the inputs a mistake needs

@pytest.fixture
def bad(tmp_path: Path) -> dict[str, str]:
    """Paths: a missing one, corrupt files of each kind, a folder path under a regular file."""
    (tmp_path / "corrupt.pt").write_bytes(b"not a torch archive\n" * 4)
    (tmp_path / "corrupt.jsonl").write_text('{"text": "a document"\n')
    (tmp_path / "corrupt.yaml").write_text("a: [unclosed\n  b: :\n")
    (tmp_path / "corrupt.py").write_bytes(b"def f(:\n  \x00\x01 return\n")
    tok = tmp_path / "corrupt_tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{not json")
    cap = tmp_path / "corrupt_capture"
    cap.mkdir()
    (cap / "manifest_rank0.jsonl").write_text("{torn line\n")
    (cap / "x_iter000_rank00.pt").write_bytes(b"garbage")
    (tmp_path / "unknown.yaml").write_text("s:\n  enabled: true\n  layers:\n"
                                           "    layer_name_regex_pattern: .*\n"
                                           "  lowp:\n    NoSuchFeature:\n      enabled: true\n")
    old = tmp_path / "old_megatron" / "megatron" / "core"
    (old / "tensor_parallel").mkdir(parents=True)
    (old / "tensor_parallel" / "layers.py").write_text("")
    (old / "package_info.py").write_text('MAJOR, MINOR, PATCH = 0, 1, 0\n__version__ = "0.1.0"\n')
    (tmp_path / "a_file").write_text("x")
    return {"unknown_yaml": str(tmp_path / "unknown.yaml"),
            "old_megatron": str(tmp_path / "old_megatron"),"missing": str(tmp_path / "missing"), "missing_pt": str(tmp_path / "missing.pt"),
            "corrupt_pt": str(tmp_path / "corrupt.pt"), "corrupt_jsonl": str(tmp_path / "corrupt.jsonl"),
            "corrupt_yaml": str(tmp_path / "corrupt.yaml"), "corrupt_py": str(tmp_path / "corrupt.py"),
            "corrupt_tok": str(tok), "corrupt_capture": str(cap),
            "unwritable": str(tmp_path / "a_file" / "out"), "tmp": str(tmp_path)}


def _tensor(tmp: str) -> str:
    import torch

    path = Path(tmp) / "t.pt"
    torch.save(torch.randn(16, 16), path)
    return str(path)


#: command -> mistake -> argv (format fields from the ``bad`` fixture); None: the command
#: has no such input (the reason beside it)
MISTAKES: dict[str, dict[str, list[str] | str]] = {
    "quant-demo": {
        "missing": ["--input", "{missing_pt}"], "corrupt": ["--input", "{corrupt_pt}"],
        "unknown": ["--formats", "mxfp9"], "flag": ["--form", "mxfp8"],
        "unwritable": "prints to stdout only"},
    "mxfp-scaling-test": {
        "missing": ["{missing_pt}"], "corrupt": ["{corrupt_pt}"],
        "unknown": ["{tensor}", "--elem-format", "fp9"], "flag": ["{tensor}", "--no-plot"],
        "unwritable": ["{tensor}", "--output-dir", "{unwritable}"]},
    "megatron-tensor-patch": {
        "missing": ["{missing}"], "corrupt": ["{corrupt_tok}"],
        "unknown": ["{old_megatron}"], "flag": ["{tmp}", "--rev"],
        "unwritable": ["--prepare", "{unwritable}"]},
    "enhanced-tensor-visualizer": {
        "missing": ["--tensor_dir", "{missing}"], "corrupt": ["--tensor_dir", "{corrupt_capture}", "--no-progress"],
        "unknown": ["--tensor_dir", "{tmp}", "--whatif", "fp9"],
        "flag": ["--tensor_dir", "{tmp}", "--output"],
        "unwritable": ["--tensor_dir", "{tmp}", "--output_dir", "{unwritable}"]},
    "quick-visualize": {
        "missing": ["--tensor_dir", "{missing}"], "corrupt": ["--tensor_dir", "{corrupt_capture}", "--no-progress"],
        "unknown": ["--tensor_dir", "{tmp}", "--map-stat", "nope"],
        "flag": ["--tensor_dir", "{tmp}", "--no-prog"],
        "unwritable": ["--tensor_dir", "{tmp}", "--output_dir", "{unwritable}"]},
    "visualize-tensors": {
        "missing": ["--tensor_dir", "{missing}"], "corrupt": ["--tensor_dir", "{corrupt_capture}", "--no-progress"],
        "unknown": ["--tensor_dir", "{tmp}", "--whatif", "fp9"],
        "flag": ["--tensor_dir", "{tmp}", "--work", "1"],
        "unwritable": ["--tensor_dir", "{tmp}", "--output_dir", "{unwritable}"]},
    "llama-train": {
        "missing": ["--data-path", "{missing}", "--tokenizer", "{missing}"],
        "corrupt": ["--data-path", "{missing}", "--tokenizer", "{corrupt_tok}"],
        "unknown": ["--data-path", "{missing}", "--tokenizer", "{missing}", "--model", "gpt9"],
        "flag": ["--data-path", "{missing}", "--tokenizer", "{missing}", "--train-it", "3"],
        "unwritable": ["--data-path", "{missing}", "--tokenizer", "{missing}",
                       "--checkpoint-dir", "{unwritable}"]},
    "preprocess-corpus": {
        "missing": ["--input", "{missing}", "--output-prefix", "{tmp}/d/d"],
        "corrupt": ["--input", "{corrupt_jsonl}", "--output-prefix", "{tmp}/d/d"],
        "unknown": ["--input", "{corrupt_jsonl}", "--output-prefix", "{tmp}/d/d",
                    "--tokenizer", "{missing}"],
        "flag": ["--input", "{corrupt_jsonl}", "--output", "{tmp}/d/d"],
        "unwritable": ["--input", "{corrupt_jsonl}", "--output-prefix", "{unwritable}/d"]},
    "amp-static-check": {
        "missing": ["{missing}"], "corrupt": "a file Python cannot parse is a finding, not a mistake",
        "unknown": ["{tmp}", "--select", "AMP999"], "flag": ["{tmp}", "--min-conf", "high"],
        "unwritable": "prints to stdout only"},
    "analyze-tensor": {
        "missing": ["{missing_pt}"], "corrupt": ["{corrupt_pt}"],
        "unknown": ["{tensor}", "--formats", "fp9"], "flag": ["{tensor}", "--block", "16"],
        "unwritable": "prints to stdout only"},
    "precision-diff": {
        "missing": "reads no file", "corrupt": "reads no file",
        "unknown": ["--mode", "fp9"], "flag": ["--num-lay", "1"],
        "unwritable": "prints to stdout only"},
    "lowp-te-check": {
        "missing": ["{missing}"], "corrupt": ["{corrupt_yaml}"],
        "unknown": ["{unknown_yaml}"], "flag": ["{corrupt_yaml}", "--conf"],
        "unwritable": "prints to stdout only"},
    "lowp-attribute": {
        "missing": ["--format", "fp8_e4m3", "--resume", "{missing}"],
        "corrupt": ["--format", "fp8_e4m3", "--seeds", "1,x"],
        "unknown": ["--format", "fp9"], "flag": ["--format", "fp8_e4m3", "--step", "10"],
        "unwritable": ["--format", "fp8_e4m3", "--out", "{unwritable}"]},
    "lowp-diagnose": {
        "missing": ["{missing}"], "corrupt": ["{corrupt_capture}"],
        "unknown": ["{tmp}", "--loss", "{missing}"], "flag": ["{tmp}", "--ref", "{tmp}"],
        "unwritable": ["{tmp}", "--json", "{unwritable}/d.json"]},
    "lowp-audit": {
        "missing": ["{missing}"], "corrupt": ["{corrupt_py}"],
        "unknown": ["{corrupt_py}", "--fail-on", "fatal"], "flag": ["{missing}", "--step", "2"],
        "unwritable": ["{corrupt_py}", "--json", "{unwritable}/a.json"]},
}
KINDS = ("missing", "corrupt", "unknown", "flag", "unwritable")


def test_every_console_script_has_its_mistakes() -> None:
    """A new command needs its row: what a user gets wrong with it, or why it has no such input."""
    assert set(MISTAKES) == set(console_scripts())
    assert all(set(row) == set(KINDS) for row in MISTAKES.values())


def call(main: Callable, argv: list[str], capsys: pytest.CaptureFixture) -> tuple[object, str]:
    """The exit status and stderr of ``main(argv)`` run in this process."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_a_mistake_is_one_line_and_exit_2(name: str, kind: str, bad: dict[str, str],
                                          capsys: pytest.CaptureFixture,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    argv = MISTAKES[name][kind]
    if isinstance(argv, str):
        pytest.skip(f"{name}: {argv}")
    monkeypatch.chdir(bad["tmp"])
    fields = dict(bad, tensor=_tensor(bad["tmp"]) if "{tensor}" in argv else "")
    code, err = call(_main(console_scripts()[name]), [a.format(**fields) for a in argv], capsys)
    lines = err.strip().splitlines()
    assert (code, len(lines)) == (2, 1), f"{name} {kind}: exit {code}, stderr:\n{err}"
    assert "Traceback" not in err and re.match(r"[\w.-]+( \w+)?: error: ", lines[0]), lines[0]
    flags = [a for a in argv if a.startswith("-")]
    named = {"missing": "missing", "unwritable": "a_file",
             "flag": flags[-1] if flags else None}.get(kind)
    assert named is None or named in lines[0], f"{name} {kind}: the line names no {named!r}: {lines[0]}"


# ----------------------------------------------------------------------------------------------
# every parser of every command


def _tracked_py() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                          "*.py"], cwd=REPO, capture_output=True, check=True).stdout.decode()
    return [REPO / n for n in out.split("\0") if n and (REPO / n).is_file()]


def plain_parsers(path: Path) -> list[int]:
    """Lines of ``ArgumentParser(...)`` calls that allow abbreviated options (any parser other
    than lowp_common's CommandParser, unless it passes ``allow_abbrev=False``)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
        off = any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant)
                  and k.value.value is False for k in node.keywords)
        if name in PARSERS and not off:
            lines.append(node.lineno)
    return lines


def test_no_parser_takes_an_abbreviated_option() -> None:
    """``--step 10`` ran as ``--steps 10`` and replaced a plan (issue 40): every command's parser
    is a ``lowp_common.CommandParser`` (or says ``allow_abbrev=False``)."""
    found = [f"{p.relative_to(REPO)}:{n}" for p in _tracked_py()
             if not p.relative_to(REPO).parts[0] == "tests" for n in plain_parsers(p)]
    assert found == [], "use lowp_common.CommandParser in " + ", ".join(found)


def test_the_scan_finds_a_plain_parser(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import argparse\np = argparse.ArgumentParser(prog='x')\n"
                   "q = argparse.ArgumentParser(allow_abbrev=False)\n")
    assert plain_parsers(src) == [2]


def test_command_parser_refuses_abbreviations_in_one_line(capsys: pytest.CaptureFixture) -> None:
    from lowp_common import CommandParser

    p = CommandParser(prog="tool")
    p.add_argument("--steps", type=int)
    sub = p.add_subparsers(dest="what").add_parser("run")
    sub.add_argument("--seeds")
    for argv in (["--step", "10"], ["run", "--see", "3"]):
        with pytest.raises(SystemExit) as exc:
            p.parse_args(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "did you mean --steps?" in CommandParser._close_option(p, "unrecognized arguments: --step 10")


def test_help_names_no_default_for_a_flag(capsys: pytest.CaptureFixture) -> None:
    """``--no-verify ... (default: True)`` read as if verifying were off (issue 40)."""
    from attribution.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "do not run the written plan again on fresh seeds (default" not in text
    assert "--steps STEPS training steps per run (default: 150)" in text


def test_the_valid_format_list_names_fp32_once() -> None:
    """It read "..., fp32, fp32 (no quantization)" (issue 40)."""
    from tensor_capture.config import ConfigError, _quant

    with pytest.raises(ConfigError) as exc:
        _quant("quant_type", "fp9")
    names = str(exc.value).split("valid: ", 1)[1]
    assert names.count("fp32") == 1 and names.endswith("hp / fp32 / none (no quantization)")
