"""No result is replaced silently (issue 40): a command that would write over a result it wrote
earlier refuses in one line naming ``--force`` before any work; a report of the same capture
into the folder it wrote is a refresh (a derived view) and goes ahead.

One test per command that writes results, calling its checks or its ``main`` in-process; the
shared rule is ``lowp_common.outputs`` (tested first).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from lowp_common import UserError, check_writable, claim_folder, mark_folder, refuse_overwrite


def test_refuse_overwrite_names_the_file_and_force(tmp_path: Path) -> None:
    plan = tmp_path / "precision_plan.yaml"
    refuse_overwrite([plan], what="a plan", force=False)          # nothing there: fine
    plan.write_text("rules: []\n")
    with pytest.raises(UserError, match=r"precision_plan.yaml holds a plan written earlier; "
                                        r"pass --force to replace it or give another --out"):
        refuse_overwrite([plan], what="a plan", force=False, elsewhere="give another --out")
    refuse_overwrite([plan], what="a plan", force=True)


def test_a_report_folder_is_refreshed_for_its_capture_and_refused_for_another(tmp_path: Path) -> None:
    a, b, out = tmp_path / "cap_a", tmp_path / "cap_b", tmp_path / "draw"
    a.mkdir(), b.mkdir(), out.mkdir()
    kinds = ("index.html",)
    claim = lambda src, force=False: claim_folder(out, src, kinds, force=force,  # noqa: E731
                                                  what="a report", elsewhere="another --output_dir")
    (out / "notes.txt").write_text("mine")
    claim(b)                                   # no report there yet: any capture may draw
    (out / "index.html").write_text("<html>")
    with pytest.raises(UserError, match="of an unknown source .*--force"):
        claim(a)                               # a report nobody marked: not ours to replace
    mark_folder(out, a)
    claim(a)                                   # the same capture: a refresh
    claim(tmp_path / "x" / ".." / "cap_a")     # the same folder, spelt otherwise
    with pytest.raises(UserError, match=f"drawn from {a}"):
        claim(b)
    claim(b, force=True)


def test_check_writable(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    check_writable(tmp_path / "new" / "deeper", "--out", folder=True)
    check_writable(tmp_path / "r.json", "--json")
    with pytest.raises(UserError, match="--out .*f is a file, not a folder"):
        check_writable(tmp_path / "f" / "sub", "--out", folder=True)
    with pytest.raises(UserError, match="--json .*is a folder; give a file name"):
        check_writable(tmp_path, "--json")
    with pytest.raises(UserError, match="is a file; give a folder"):
        check_writable(tmp_path / "f", "--out", folder=True)


def _attribute_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    from attribution.cli import build_parser

    return build_parser().parse_args(["--format", "fp8_e4m3", "--out", str(tmp_path / "out"),
                                      *extra])


def test_lowp_attribute_keeps_an_earlier_plan_without_force(tmp_path: Path) -> None:
    """The issue's case: a re-run replaced a 150-step plan with a 10-step one, exit 0."""
    from attribution.cli import _out_dir

    assert _out_dir(_attribute_args(tmp_path)) == tmp_path / "out"
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precision_plan.yaml").write_text("rules: []\n")
    with pytest.raises(UserError, match="precision_plan.yaml holds a lowp-attribute result .*"
                                        "--force .*--out"):
        _out_dir(_attribute_args(tmp_path))
    assert _out_dir(_attribute_args(tmp_path, "--force")) == tmp_path / "out"
    (tmp_path / "r.json").write_text("{}")
    with pytest.raises(UserError, match="r.json holds"):
        _out_dir(_attribute_args(tmp_path, "--out", str(tmp_path / "o2"), "--json",
                                 str(tmp_path / "r.json")))


def test_lowp_attribute_refuses_before_training(tmp_path: Path, capsys, monkeypatch) -> None:
    from attribution import cli

    monkeypatch.setattr(cli, "_data", lambda args: pytest.fail("started work"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "attribution.json").write_text("{}")
    assert cli.main(["--format", "fp8_e4m3", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lowp-attribute: error: ") and "--force" in err[0]


def test_mxfp_scaling_test_refuses_to_replace_a_sweep(tmp_path: Path, capsys, monkeypatch) -> None:
    import torch

    from quant_tools import scaling_cli

    monkeypatch.chdir(tmp_path)
    torch.save(torch.randn(32, 32).bfloat16(), tmp_path / "t.pt")
    argv = ["t.pt", "--no-plots", "--num-levels", "2", "--output-dir", "o"]
    assert scaling_cli.main(argv) == 0
    results = tmp_path / "o" / "mxfp_scaling_results_fp8_e4m3.txt"
    before = results.read_text()
    capsys.readouterr()
    assert scaling_cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert "FINAL SUMMARY" not in out and len(err.strip().splitlines()) == 1 and "--force" in err
    assert results.read_text() == before
    assert scaling_cli.main([*argv, "--force"]) == 0
    (tmp_path / "r.json").write_text("{}")
    assert scaling_cli.main(["t.pt", "--no-plots", "--output-dir", "o2", "--json", "r.json"]) == 2
    assert "r.json holds" in capsys.readouterr().err


def test_a_report_of_another_capture_is_refused(tmp_path: Path, capsys) -> None:
    from tensor_viz import full

    out = tmp_path / "draw"
    out.mkdir()
    (out / "index.html").write_text("<html>an earlier report</html>")
    mark_folder(out, tmp_path / "capture_a")
    (tmp_path / "capture_b").mkdir()
    code = full.main(["--tensor_dir", str(tmp_path / "capture_b"), "--output_dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "capture_a" in err[0] and "--force" in err[0]
    assert (out / "index.html").read_text() == "<html>an earlier report</html>"


def test_preprocess_corpus_keeps_an_earlier_dataset(tmp_path: Path, capsys) -> None:
    from training_driver.data import preprocess

    prefix = tmp_path / "d" / "mine"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "mine_text_document.idx").write_bytes(b"earlier")
    argv = ["--input", str(tmp_path / "c.txt"), "--output-prefix", str(prefix)]
    (tmp_path / "c.txt").write_text("one document\n\nanother one\n")
    assert preprocess.main(argv) == 2
    err = capsys.readouterr().err
    assert "mine_text_document.idx holds a dataset or tokenizer" in err and "--force" in err
    assert (tmp_path / "d" / "mine_text_document.idx").read_bytes() == b"earlier"
    args = preprocess.build_parser().parse_args([*argv, "--force"])
    preprocess.check_outputs(args)          # --force: goes ahead


def test_llama_train_no_resume_keeps_earlier_checkpoints(tmp_path: Path, capsys) -> None:
    from training_driver import train
    from training_driver.checkpoint import LATEST_FILE

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / LATEST_FILE).write_text("5\n")
    argv = ["--data-path", "d", "--tokenizer", "t", "--checkpoint-dir", str(ckpt), "--no-resume"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds checkpoints written earlier; pass --force" in err[0]
    train.check_restart(train.build_parser().parse_args([*argv, "--force"]))
    train.check_restart(train.build_parser().parse_args(argv[:-1]))     # resuming: fine


def test_the_same_capture_redraws_its_report_and_another_is_refused(tmp_path: Path, capsys) -> None:
    """A report is a derived view: drawing the capture it came from again into its folder is
    a refresh (kept as it is when nothing new was captured); another capture is refused."""
    from test_viz_columnar import _capture

    from tensor_viz import full

    _capture(tmp_path / "cap", ranks=1, iterations=1, whatif=False)
    _capture(tmp_path / "other", ranks=1, iterations=1, whatif=False)
    argv = ["--tensor_dir", str(tmp_path / "cap"), "--output_dir", str(tmp_path / "draw"),
            "--no-progress", "--workers", "1", "--whatif", "none"]
    assert full.main(argv) == 0
    index = (tmp_path / "draw" / "index.html").read_text()
    assert full.main(argv) == 0 and "it is current" in capsys.readouterr().out
    other = ["--tensor_dir", str(tmp_path / "other"), *argv[2:]]
    assert full.main(other) == 2
    assert "drawn from" in capsys.readouterr().err
    assert (tmp_path / "draw" / "index.html").read_text() == index
    assert full.main([*other, "--force"]) == 0


def test_lowp_diagnose_keeps_an_earlier_json_without_force(tmp_path: Path, capsys) -> None:
    """Refused before the capture is read: the earlier diagnosis stays as it was."""
    from tensor_viz.diagnose import cli as diagnose_cli

    out = tmp_path / "diagnosis.json"
    out.write_text('{"findings": []}\n')
    assert diagnose_cli.main([str(tmp_path), "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "diagnosis.json holds a diagnosis written earlier" in err[0]
    assert "--force" in err[0] and out.read_text() == '{"findings": []}\n'
