"""What a file does (issue 48 item 4): a script that takes no training step (inference, export,
evaluation) and a benchmark that only times its steps get training-path findings (accumulation,
AMP setup) at low confidence at most; the same code in a script that trains keeps its level.
The files are judged by what they call, never by their names: each case is also scanned under
the other kind's file name."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from training_profiler.amp_checker import checker as sc
from training_profiler.amp_checker.catalog import RULES
from training_profiler.amp_checker.rules import Confidence

CASES = Path(__file__).parent / "profiler_purpose"
NOTE = {"inference": sc.PURPOSE_NOTES[sc.INFERENCE], "benchmark": sc.PURPOSE_NOTES[sc.BENCHMARK]}


def _scan(tmp_path: Path, files: dict[str, str | Path], minimum: Confidence | None = Confidence.LOW):
    """``files``: name in the scanned folder -> a fixture path or the text itself."""
    folder = tmp_path / "scan"
    folder.mkdir(parents=True)
    for name, src in files.items():
        target = folder / name
        if isinstance(src, Path):
            shutil.copy(src, target)
        else:
            target.write_text(src)
    report = sc.check_paths([folder], min_confidence=minimum)
    return {(Path(f.path).name, f.line, f.rule_id): f for f in report.findings}, report


def _line(case: str, text: str) -> int:
    """The line of ``case``'s fixture that holds ``text``."""
    lines = (CASES / case).read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if text in line)


SOFTMAX, MEAN = _line("infer_sample.py", "F.softmax("), _line("infer_sample.py", "logits.mean()")
AUTOCAST = _line("bench_steps.py", "torch.autocast(")


def _training_path(found: dict, name: str) -> dict:
    ids = {r.id for r in RULES if r.training_path}
    return {(line, rule): f for (n, line, rule), f in found.items() if n == name and rule in ids}


@pytest.mark.parametrize("as_name", ["infer_sample.py", "train.py"])
def test_an_inference_script_gets_low_confidence_and_its_training_twin_keeps_its_level(
        tmp_path: Path, as_name: str) -> None:
    infer, _ = _scan(tmp_path / "a", {as_name: CASES / "infer_sample.py", "tinynet.py": CASES / "tinynet.py"})
    train, _ = _scan(tmp_path / "b", {"infer.py": CASES / "train_sample.py", "tinynet.py": CASES / "tinynet.py"})
    low, kept = _training_path(infer, as_name), _training_path(train, "infer.py")
    # the same softmax and mean on autocast's logits, at the same lines, in both files
    assert {("AMP004", SOFTMAX), ("AMP005", MEAN)} <= {(r, line) for line, r in low}
    assert {(r, line) for line, r in low} <= {(r, line) for line, r in kept}
    assert all(f.confidence == Confidence.LOW and f.message.endswith(NOTE["inference"]) for f in low.values())
    assert all(f.confidence == Confidence.HIGH and "script" not in f.message for f in kept.values())


@pytest.mark.parametrize("as_name", ["bench_steps.py", "train.py"])
def test_a_benchmark_that_only_times_steps_gets_low_and_one_that_saves_keeps_its_level(
        tmp_path: Path, as_name: str) -> None:
    bench, _ = _scan(tmp_path / "a", {as_name: CASES / "bench_steps.py", "tinynet.py": CASES / "tinynet.py"})
    train, _ = _scan(tmp_path / "b", {"bench.py": CASES / "train_steps.py", "tinynet.py": CASES / "tinynet.py"})
    low, kept = bench[(as_name, AUTOCAST, "AMP008")], train[("bench.py", AUTOCAST, "AMP008")]
    assert low.confidence == Confidence.LOW and low.message.endswith(NOTE["benchmark"])
    assert kept.confidence == Confidence.HIGH and not kept.message.endswith(NOTE["benchmark"])


def test_the_default_of_a_project_hides_the_inference_finding_and_shows_the_training_one(tmp_path: Path) -> None:
    found, report = _scan(tmp_path, {"sample.py": CASES / "infer_sample.py", "fit.py": CASES / "train_sample.py",
                                     "tinynet.py": CASES / "tinynet.py"}, minimum=None)
    assert report.project_mode and report.min_confidence == Confidence.HIGH
    assert ("fit.py", SOFTMAX, "AMP004") in found and not _training_path(found, "sample.py")


_ENGINE = '''import torch


def train_one_epoch(model, opt, batches):
    for x in batches:
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        out.float().mean().backward()
        opt.step()
'''

_MAIN_CALLS_ENGINE = '''import torch
import torch.nn.functional as F

from engine import train_one_epoch


def report(model, x):
    with torch.autocast("cuda", dtype=torch.float16):
        logits = model(x)
    return F.softmax(logits, dim=-1)


if __name__ == "__main__":
    net = torch.nn.Linear(4, 4).cuda()
    train_one_epoch(net, make_optimizer(net), [torch.randn(2, 4, device="cuda")])
    print(report(net, torch.randn(2, 4, device="cuda")))
'''


def test_a_script_whose_imported_engine_trains_is_a_training_program(tmp_path: Path) -> None:
    found, _ = _scan(tmp_path, {"main.py": _MAIN_CALLS_ENGINE, "engine.py": _ENGINE})
    softmax = found[("main.py", 10, "AMP004")]
    assert softmax.confidence == Confidence.HIGH and not softmax.message.endswith(NOTE["inference"])


def test_a_script_imported_by_training_code_is_judged_as_training_code(tmp_path: Path) -> None:
    """``infer_sample.py`` with a trainer that imports its ``predict``: no longer a script that
    only runs a model."""
    trainer = ("import torch\nfrom infer_sample import predict\n\n\ndef fit(model, opt, x):\n"
               "    labels, mean_logit = predict(model, x)\n    mean_logit.backward()\n    opt.step()\n")
    found, _ = _scan(tmp_path, {"infer_sample.py": CASES / "infer_sample.py", "tinynet.py": CASES / "tinynet.py",
                                "trainer.py": trainer})
    assert found[("infer_sample.py", SOFTMAX, "AMP004")].confidence == Confidence.HIGH


@pytest.mark.parametrize("fit_call", ["trainer.fit(net)", "trainer.train()"])
def test_a_script_that_hands_its_model_to_a_library_trainer_trains(tmp_path: Path, fit_call: str) -> None:
    text = (CASES / "infer_sample.py").read_text().replace(
        "    net.eval()\n", f"    trainer = make_trainer(net)\n    {fit_call}\n")
    found, _ = _scan(tmp_path, {"run.py": text, "tinynet.py": CASES / "tinynet.py"})
    assert found[("run.py", SOFTMAX, "AMP004")].confidence == Confidence.HIGH


def _without_device_timing(text: str) -> str:
    return text.replace("    torch.cuda.synchronize()\n    start = time.perf_counter()\n", "").replace(
        "    torch.cuda.synchronize()\n    return (time.perf_counter() - start) / steps\n", "    return steps\n")


def _amp008(found: dict):
    (hit,) = [f for (_, _, r), f in found.items() if r == "AMP008"]
    return hit


def test_a_step_timed_by_its_caller_is_a_benchmark_step(tmp_path: Path) -> None:
    """The device synchronized and the clock read around the call, not inside the stepping function."""
    text = _without_device_timing((CASES / "bench_steps.py").read_text()).replace(
        '    print(f"{timed_steps(net, sgd, 50) * 1e3:.3f} ms per step")\n',
        "    torch.cuda.synchronize()\n    start = time.perf_counter()\n    timed_steps(net, sgd, 50)\n"
        "    torch.cuda.synchronize()\n    print(time.perf_counter() - start)\n")
    found, _ = _scan(tmp_path, {"steps.py": text, "tinynet.py": CASES / "tinynet.py"})
    assert _amp008(found).confidence == Confidence.LOW and _amp008(found).message.endswith(NOTE["benchmark"])
    saved = text + '    torch.save(net.state_dict(), "w.pt")\n'
    found, _ = _scan(tmp_path / "saved", {"steps.py": saved, "tinynet.py": CASES / "tinynet.py"})
    assert _amp008(found).confidence == Confidence.HIGH


def test_a_loop_that_reads_the_wall_clock_for_a_log_line_trains(tmp_path: Path) -> None:
    """A trainer times its iterations with ``time.perf_counter()`` alone (no device synchronize,
    no CUDA events) and may save through hooks elsewhere: not a benchmark."""
    text = _without_device_timing((CASES / "bench_steps.py").read_text()).replace(
        "    for _ in range(steps):\n", "    for _ in range(steps):\n        start = time.perf_counter()\n")
    found, _ = _scan(tmp_path, {"steps.py": text, "tinynet.py": CASES / "tinynet.py"})
    assert _amp008(found).confidence == Confidence.HIGH


def test_a_model_module_with_a_demo_block_keeps_its_level(tmp_path: Path) -> None:
    """A file that defines a model is library code that training elsewhere runs, whatever its
    ``__main__`` demo does; the same demo without the class is an inference script."""
    demo = ("\n\ndef probs(model, x):\n    with torch.autocast('cuda', dtype=torch.float16):\n"
            "        y = model(x)\n    return y.softmax(-1)\n\n\nif __name__ == '__main__':\n"
            "    print(probs(TinyNet().cuda(), torch.randn(2, 16, device='cuda')))\n")
    library, _ = _scan(tmp_path / "a", {"tinynet.py": (CASES / "tinynet.py").read_text() + demo})
    script, _ = _scan(tmp_path / "b", {"demo.py": "import torch\nfrom tinynet import TinyNet" + demo,
                                       "tinynet.py": CASES / "tinynet.py"})
    (a,) = [f for (_, _, r), f in library.items() if r == "AMP004"]
    (b,) = [f for (n, _, r), f in script.items() if r == "AMP004" and n == "demo.py"]
    assert not a.message.endswith(NOTE["inference"])
    assert b.confidence == Confidence.LOW and b.message.endswith(NOTE["inference"])


def test_only_training_path_rules_are_capped(tmp_path: Path) -> None:
    """A hazard that exists whatever the code is for (a custom Function without custom_fwd, a
    float16 constant that overflows) keeps its level in an inference script."""
    text = (CASES / "infer_sample.py").read_text().replace(
        "    probs = F.softmax(logits, dim=-1)\n",
        "    probs = F.softmax(logits.masked_fill(batch[:, :4] > 0, -1e9), dim=-1)\n")
    found, _ = _scan(tmp_path, {"infer.py": text, "tinynet.py": CASES / "tinynet.py"})
    capped = {r for (_, _, r), f in found.items() if f.message.endswith(NOTE["inference"])}
    assert capped and all(r.training_path for r in RULES if r.id in capped)
    untouched = {r: f for (_, _, r), f in found.items() if r not in capped}
    assert untouched["AMP011"].confidence == Confidence.HIGH
