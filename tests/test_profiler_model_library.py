"""A model library (a package in which nothing trains) hands the precision to its users: its
value hazards are MEDIUM ("decided outside the scan") and the default shows MEDIUM for it, while a
package that trains keeps HIGH only. Each case is checked with and without what decides it."""
from __future__ import annotations

import textwrap
from pathlib import Path

from training_profiler.amp_checker import checker as sc
from training_profiler.amp_checker.rules import Confidence

_ATTENTION = """
import torch
from torch import nn


class CausalAttention(nn.Module):
    def forward(self, q, k, v, mask):
        scores = q @ k.transpose(-1, -2)
        scores = scores.masked_fill(mask, -1e10)
        return scores.softmax(-1) @ v
"""

_TRAINER = """
import torch
from .attention import CausalAttention


def train(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in batches:
        loss = model(x).sum()
        loss.backward()
        opt.step()
"""


def _package(root: Path, **modules: str) -> Path:
    pkg = root / "lib"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in modules.items():
        (pkg / f"{name}.py").write_text(textwrap.dedent(text))
    return pkg


def _rules(report: sc.Report) -> list[tuple[str, int, Confidence]]:
    return [(f.rule_id, f.line, f.confidence) for f in report.findings]


def test_library_value_hazard_is_medium_and_shown_by_default(tmp_path) -> None:
    report = sc.check_paths([_package(tmp_path, attention=_ATTENTION)])
    assert report.project_mode and report.model_library
    assert report.min_confidence == Confidence.MEDIUM
    (mask,) = [f for f in report.findings if f.rule_id == "AMP011"]
    assert mask.confidence == Confidence.MEDIUM and "a model library" in mask.message


def test_a_package_that_trains_is_not_a_library(tmp_path) -> None:
    report = sc.check_paths([_package(tmp_path, attention=_ATTENTION, trainer=_TRAINER)])
    assert report.project_mode and not report.model_library
    assert report.min_confidence == Confidence.HIGH
    assert all(f.rule_id != "AMP011" for f in report.findings)   # LOW: no float16 training seen
    low = sc.check_paths([tmp_path / "lib"], min_confidence=Confidence.LOW)
    assert [f.confidence for f in low.findings if f.rule_id == "AMP011"] == [Confidence.LOW]


def test_float32_limit_named_stays_low_in_a_library(tmp_path) -> None:
    named = _ATTENTION.replace("-1e10", "torch.finfo(torch.float32).min")
    report = sc.check_paths([_package(tmp_path, attention=named)], min_confidence=Confidence.LOW)
    assert [f.confidence for f in report.findings if f.rule_id == "AMP011"] == [Confidence.LOW]


def test_transposed_product_is_not_lifted_in_a_library(tmp_path) -> None:
    lora = """
    import torch
    from torch import nn


    class Adapter(nn.Module):
        def forward(self, a, b):
            gram = b.transpose(-1, -2) @ b
            return a @ gram
    """
    report = sc.check_paths([_package(tmp_path, adapter=lora)], min_confidence=Confidence.LOW)
    assert {f.confidence for f in report.findings if f.rule_id == "AMP019"} <= {Confidence.LOW}


_KERNEL_FN = """
import torch
import ext


class DeformConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, offset, weight):
        {casts}
        return ext.deform_conv_forward(input, offset, weight)

    @staticmethod
    def backward(ctx, grad):
        return ext.deform_conv_backward(grad), None, None
"""


def test_kernel_function_whose_casts_unify_its_operands_is_silent(tmp_path) -> None:
    mixed = sc.check_paths([_package(tmp_path, ops=_KERNEL_FN.format(casts="pass"))])
    assert [r for r, _, _ in _rules(mixed)].count("AMP006") == 2  # forward and backward, callers unknown
    unified = _KERNEL_FN.format(casts="input = input.type_as(offset)\n        weight = weight.type_as(input)")
    (tmp_path / "lib" / "ops.py").write_text(textwrap.dedent(unified))
    assert not [f for f in sc.check_paths([tmp_path / "lib"]).findings if f.rule_id == "AMP006"]


def test_kernel_function_without_backward_is_an_inference_op(tmp_path) -> None:
    nms = """
    import torch
    import ext


    class NMSop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, boxes, scores, threshold):
            return ext.nms(boxes, scores, threshold)
    """
    report = sc.check_paths([_package(tmp_path, nms=nms)], min_confidence=Confidence.LOW)
    assert [f.confidence for f in report.findings if f.rule_id == "AMP006"] == [Confidence.LOW]  # not "unknown"
    with_backward = nms.replace("return ext.nms(boxes, scores, threshold)", "return ext.nms(boxes, scores, threshold)"
                                "\n\n        @staticmethod\n        def backward(ctx, g):\n            return g, None, None")
    (tmp_path / "lib" / "nms.py").write_text(textwrap.dedent(with_backward))
    shown = sc.check_paths([tmp_path / "lib"])
    assert [f.confidence for f in shown.findings if f.rule_id == "AMP006"] == [Confidence.MEDIUM]


def test_float32_default_for_an_absent_input_is_not_a_buffer(tmp_path) -> None:
    upfirdn = """
    import torch
    import ext


    class Upfirdn(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cuda")
        def forward(ctx, x, f):
            if f is None:
                f = torch.ones([1, 1], dtype=torch.float32, device=x.device)
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            return ext.upfirdn2d(x, f, out)

        @staticmethod
        @torch.amp.custom_bwd(device_type="cuda")
        def backward(ctx, dy):
            return dy, None
    """
    report = sc.check_paths([_package(tmp_path, ops=upfirdn)], min_confidence=Confidence.LOW)
    assert [(r, line) for r, line, _ in _rules(report) if r == "AMP017"] == [("AMP017", 12)]
