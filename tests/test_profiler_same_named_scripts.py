"""Scripts that share a file name in different folders (a repository's examples/a/train.py and
examples/b/train.py) are separate programs. Under one module name, the second replaced the first
in the project and the first file's own call sites were looked up in the other one: scanned from
the repository root, diffusers' dreambooth LoRA script lost every finding (its copy under
research_projects took its name)."""
from __future__ import annotations

import textwrap
from pathlib import Path

from training_profiler.amp_checker import checker as sc
from training_profiler.amp_checker.project import module_names
from training_profiler.amp_checker.rules import Confidence

TRAIN = """
import torch


def log_validation(model, torch_dtype):
    return model.to("cuda", dtype=torch_dtype)


def main(args, model, loader, optimizer):
    weight_dtype = torch.float16 if args.fp16 else torch.float32
    for x in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().mean()
        loss.backward()
        optimizer.step()
    log_validation(model, weight_dtype)
"""

OTHER = """
def log_validation(model, torch_dtype):
    return model
"""


def _tree(root: Path, second: str) -> None:
    for folder, text in (("a", TRAIN), (second, OTHER)):
        (root / folder).mkdir(parents=True)
        (root / folder / "train.py").write_text(textwrap.dedent(text))


def test_a_script_keeps_its_findings_beside_a_same_named_one(tmp_path) -> None:
    _tree(tmp_path / "alone", "unused")
    (tmp_path / "alone" / "unused" / "train.py").unlink()
    _tree(tmp_path / "pair", "b")
    found = {}
    for case in ("alone", "pair"):
        report = sc.check_paths([tmp_path / case], min_confidence=Confidence.LOW)
        found[case] = sorted((f.line, f.rule_id) for f in report.findings if "/a/" in f.path.replace("\\", "/"))
    assert found["alone"], "the case must give findings on its own"
    assert found["pair"] == found["alone"]


def test_module_names_tell_same_named_scripts_apart(tmp_path) -> None:
    paths = []
    for folder in ("x/dreambooth", "y/z/dreambooth", "solo"):
        (tmp_path / folder).mkdir(parents=True)
        name = "train.py" if folder != "solo" else "other.py"
        paths.append(tmp_path / folder / name)
        paths[-1].write_text("")
    names = module_names(paths)
    assert names[paths[2]] == "other"
    assert names[paths[0]] == "x.dreambooth.train" and names[paths[1]] == "z.dreambooth.train"
