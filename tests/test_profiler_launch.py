"""Launch hazards: a launch script of our own with each hazard, caught line by
line; the clean twin has none; bad files are one line each and the scan goes on."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from training_profiler.amp_checker import launch_rules
from training_profiler.amp_checker.checker import check_paths, main, select_rules

HERE = Path(__file__).parent / "profiler_launch"


def _expected() -> set[tuple[str, int]]:
    """(rule, line) the hazards script's comments name (LCH003 and LCH005 where this install
    lacks FP4 / apex: decided by the same evidence the rules use)."""
    want = {("LCH006", 6), ("LCH001", 7), ("LCH002", 10), ("LCH004", 10)}
    if launch_rules.fp4_support()[0] is False:
        want.add(("LCH003", 12))
    import importlib.util

    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        want.add(("LCH005", 14))
    return want


def test_each_hazard_is_caught_on_its_line():
    report = check_paths([HERE / "hazards.sh"])
    got = {(f.rule_id, f.line) for f in report.findings}
    assert got == _expected() and not report.errors
    by = {f.rule_id: f for f in report.findings}
    assert "CUSTOM_QUANT_TYPE=mxfp8" in by["LCH001"].message and "the default" in by["LCH001"].message
    assert "unbounded_capture.yaml" in by["LCH006"].message


def test_the_clean_launch_has_no_finding():
    report = check_paths([HERE / "clean.sh"])
    assert report.findings == [] and report.files_checked == 1


def test_fp4_flags_are_judged_by_what_is_installed(monkeypatch):
    script = "#!/bin/bash\npython pretrain_gpt.py --bf16 --fp4-format e2m1 --no-gradient-accumulation-fusion\n"
    monkeypatch.setattr(launch_rules, "fp4_support", lambda: (False, "no fp4 setting"))
    assert [(f.rule_id, f.line) for f in launch_rules.check_script(script)] == [("LCH003", 2)]
    monkeypatch.setattr(launch_rules, "fp4_support", lambda: (True, ""))
    assert launch_rules.check_script(script) == []
    monkeypatch.setattr(launch_rules, "fp4_support", lambda: (None, "unknown"))
    assert launch_rules.check_script(script) == []      # unknown: no guess


def test_the_custom_recipe_or_local_linears_clear_the_te_hazard():
    base = "#!/bin/bash\nexport CUSTOM_QUANT_TYPE=nvfp4\npython pretrain_gpt.py --bf16 --no-gradient-accumulation-fusion {}\n"
    assert [f.rule_id for f in launch_rules.check_script(base.format(""))] == ["LCH001"]
    for ok in ("--transformer-impl local", "--fp8-format hybrid --fp8-recipe custom "
               "--fp8-quantizer-factory te_integration.factory.quantizer_factory"):
        assert launch_rules.check_script(base.format(ok)) == []


@pytest.mark.parametrize("word", ["hp", "HP", "fp32", "none"])
def test_a_high_precision_quant_type_is_no_te_hazard(word):
    """Every spelling of high precision (quant.vocabulary; hp was missing here) emulates nothing,
    so Transformer Engine linears lose nothing to it."""
    script = f"#!/bin/bash\nexport CUSTOM_QUANT_TYPE={word}\npython pretrain_gpt.py --bf16 --no-gradient-accumulation-fusion\n"
    assert launch_rules.check_script(script) == []
    assert [f.rule_id for f in launch_rules.check_script(script.replace(word, "mxfp8", 1))] == ["LCH001"]


def test_bad_files_are_one_line_each_and_the_scan_goes_on(tmp_path, capsys):
    (tmp_path / "a_binary.sh").write_bytes(b"\x7fELF\x00\x01")
    (tmp_path / "b_latin1.sh").write_bytes("#!/bin/bash\n# caf\xe9\n".encode("latin-1"))
    (tmp_path / "c_python.sh").write_text("#!/usr/bin/env python3\nprint('hi')\n")
    (tmp_path / "d_good.sh").write_text((HERE / "hazards.sh").read_text())
    (tmp_path / "unbounded_capture.yaml").write_text((HERE / "unbounded_capture.yaml").read_text())
    rc = main([str(tmp_path), "--format", "json"])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 3 and "Traceback" not in err
    assert "a_binary.sh" in lines[0] and "binary" in lines[0]
    assert "b_latin1.sh" in lines[1] and "not UTF-8" in lines[1]
    assert "c_python.sh" in lines[2] and "not a bash script" in lines[2]
    findings = json.loads(out)
    got = {(f["rule"], f["line"]) for f in (findings["findings"] if isinstance(findings, dict) else findings)}
    assert got == _expected()


def test_launch_rules_are_selected_like_the_others():
    assert [r.id for r in select_rules(["LCH002"], [])] == ["LCH002"]
    assert "LCH006" not in {r.id for r in select_rules(None, ["unbounded-capture"])}
    with pytest.raises(ValueError, match="LCH001"):
        select_rules(["LCH999"], [])
    report = check_paths([HERE / "hazards.sh"], select_rules(["LCH002"], []))
    assert [(f.rule_id, f.line) for f in report.findings] == [("LCH002", 10)]


def test_a_torchrun_of_another_program_is_not_a_megatron_launch():
    """Seen on pytorch/examples' run scripts: LCH005 is about Megatron-LM's fusion default."""
    other = "#!/bin/bash\ntorchrun --nnodes 1 --nproc_per_node 2 main.py --epochs 3\n"
    assert launch_rules.check_script(other, "x.sh", [launch_rules.LAUNCH_RULES_BY_ID["LCH005"]]) == []
    megatron = "#!/bin/bash\ntorchrun --nproc_per_node 8 train.py \\\n  --tensor-model-parallel-size 2 --num-layers 4\n"
    hits = launch_rules.check_script(megatron, "y.sh", [launch_rules.LAUNCH_RULES_BY_ID["LCH005"]])
    if launch_rules.importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        assert [f.line for f in hits] == [2]
