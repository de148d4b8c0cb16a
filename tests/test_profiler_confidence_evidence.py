"""Confidence from what model code says about its own precision (issue 30): a module that tests
its tensors for float16 expects them, and a project that turns autocast off around a computation
knows that computation runs under autocast. Each case is checked with and without the evidence,
so the lift comes from the evidence and nothing else."""
from __future__ import annotations

import textwrap

from training_profiler.amp_checker import checker as sc
from training_profiler.amp_checker.rules import Confidence

_KV_CACHE = """
import torch

class KVCache(torch.nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.register_buffer("k", torch.zeros(shape), persistent=False)

    def forward(self, input_pos, k):
        return self.k.index_copy_(2, input_pos, k)
"""

_FLASH_CHECK = """
def use_flash(q):
    return q.dtype in (torch.float16, torch.bfloat16)
"""

_ROTARY = """
import torch

class Rotary(torch.nn.Module):
    def forward(self, position_ids):
        pos = position_ids.float()
        return (self.inv_freq[:, None] @ pos[None, :]).cos()
"""

_GUARDED_ROTARY = """
class OtherRotary(torch.nn.Module):
    def forward(self, position_ids):
        with torch.autocast("cuda", enabled=False):
            freqs = self.inv_freq[:, None].float() @ position_ids[None, :].float()
        return freqs.cos()
"""

_NORM = """
import torch

class SyncNorm(torch.nn.BatchNorm2d):
    def forward(self, input):
        meansqr = torch.mean(input * input, dim=[0, 2, 3])
        return input * torch.rsqrt(meansqr + self.eps)[None, :, None, None]
"""

_HALF_CHECK = """
def pool(x):
    orig_dtype = x.dtype
    if orig_dtype == torch.float16:
        x = x.float()
    return x
"""


def _levels(source: str, rule: str) -> list[Confidence]:
    findings, err = sc.check_source(textwrap.dedent(source), "model.py", min_confidence=Confidence.LOW)
    assert err is None
    return [f.confidence for f in findings if f.rule_id == rule]


def test_a_buffer_write_is_high_in_a_module_that_tests_for_half_tensors() -> None:
    assert _levels(_KV_CACHE, "AMP021") == [Confidence.LOW]
    assert _levels(_KV_CACHE + _FLASH_CHECK, "AMP021") == [Confidence.HIGH]


def test_a_dtype_parameter_compared_with_float16_is_not_evidence() -> None:
    """``dtype in (torch.float16, ...)`` on a requested dtype says nothing about the tensors."""
    requested = "\ndef cache(dtype):\n    return dtype in (torch.float16, torch.bfloat16)\n"
    assert _levels(_KV_CACHE + requested, "AMP021") == [Confidence.LOW]


def test_rotary_positions_are_high_where_the_project_guards_the_same_product() -> None:
    alone = _levels(_ROTARY, "AMP020")
    assert alone and alone[0] != Confidence.HIGH
    both = _levels(_ROTARY + _GUARDED_ROTARY, "AMP020")
    assert both == [Confidence.HIGH]  # the guarded one is not reported


def test_norm_squares_are_high_in_a_module_that_tests_for_float16() -> None:
    assert _levels(_NORM, "AMP016") == [Confidence.MEDIUM]
    assert _levels(_NORM + _HALF_CHECK, "AMP016") == [Confidence.HIGH]


_FABRIC = """
import torch
import lightning as L


def default_precision(training):
    if torch.cuda.is_bf16_supported():
        return "bf16-mixed" if training else "bf16-true"
    return "16-mixed" if training else "16-true"


def main(model, loader, precision=None):
    precision = precision or {chosen}
    fabric = L.Fabric(precision=precision)
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for x in loader:
        loss = model(x).float().mean()
        fabric.backward(loss)
        optimizer.step()
"""


def test_a_precision_chosen_between_mixed_and_true_is_not_half_parameters() -> None:
    """Adam's eps is judged against float16 parameters only when the code can only pass a
    ``-true`` precision; a helper that returns mixed or true (its branches not followed) is
    mixed: autocast keeps float32 master weights."""
    assert _levels(_FABRIC.format(chosen="default_precision(training=True)"), "AMP012") == []
    assert _levels(_FABRIC.format(chosen='"16-true"'), "AMP012") == [Confidence.HIGH]


def test_a_projects_own_trainer_class_is_not_transformers_trainer() -> None:
    """Only a library Trainer builds AdamW with eps=1e-8 itself; OpenNMT's own ``Trainer`` does not."""
    own = """
import torch

class Trainer:
    def __init__(self, model, optim):
        self.model, self.optim = model, optim

def build(model, optim, loader):
    model.half()
    trainer = Trainer(model, optim)
    for x in loader:
        model(x).float().mean().backward()
        optim.step()
    return trainer
"""
    library = own.replace("class Trainer:", "from transformers import Trainer\n\nclass Unused:")
    assert _levels(own, "AMP012") == []
    assert _levels(library, "AMP012") == [Confidence.HIGH]
