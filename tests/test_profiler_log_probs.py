"""The checker rule for log-probabilities of a low-precision model's logits taken in the logits'
own dtype (AMP032), and AMP011's fill constants reached through names. Its premise checked with real torch, and its edges (what it
must not report) on small projects."""
from __future__ import annotations

import textwrap
from pathlib import Path

import torch
from amp_project_helpers import found, make_project


def _found(pkg: Path, rule: str = "AMP032") -> list[tuple[str, int, str]]:
    return found(pkg, rule)


def test_bfloat16_log_probs_are_off_by_enough_to_move_a_ppo_ratio() -> None:
    """The same bfloat16 logits: log_softmax in bfloat16 is off by several hundredths, in float32
    by a millionth; exp of the error is the PPO ratio's rounding (clip range 0.2)."""
    torch.manual_seed(0)
    logits = (torch.randn(4, 32000) * 3).to(torch.bfloat16)
    exact = torch.log_softmax(logits.double(), dim=-1)
    in_bf16 = torch.log_softmax(logits, dim=-1)
    upcast = torch.log_softmax(logits.float(), dim=-1)
    assert in_bf16.dtype == torch.bfloat16
    assert (in_bf16.double() - exact).abs().max() > 0.03
    assert (upcast.double() - exact).abs().max() < 1e-5
    assert torch.exp((in_bf16.double() - exact).abs().max()) > 1.03
    assert torch.nn.functional.cross_entropy(logits, torch.zeros(4, dtype=torch.long)).dtype == torch.bfloat16


_MODEL = """
    import torch
    from transformers import AutoModelForCausalLM
    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
"""
_LOSS = """
    import torch.nn.functional as F
    from pkg.model import load
    def step(path, ids):
        model = load(path)
        logits = model(ids).logits
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())
"""


def test_a_loss_on_a_bfloat16_models_logits_is_high_and_silent_without_low_precision_weights(tmp_path: Path) -> None:
    pkg = make_project(tmp_path, {"model.py": _MODEL, "loss.py": _LOSS})
    assert _found(pkg) == [("loss.py", 7, "HIGH")]
    (pkg / "model.py").write_text(textwrap.dedent(_MODEL).replace("torch_dtype=torch.bfloat16", "torch_dtype=torch.float32"))
    assert _found(pkg) == []


def test_a_deepspeed_bf16_section_is_low_precision_weights(tmp_path: Path) -> None:
    pkg = make_project(tmp_path, {"loss.py": _LOSS.replace("from pkg.model import load", "from pkg.config import load"),
                              "config.py": """
        def ds_config():
            return {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
        def load(path):
            ...
    """})
    assert _found(pkg) == [("loss.py", 7, "HIGH")]


def test_an_upcast_a_dtype_or_autocast_silences_it_and_autocast_elsewhere_lowers_it(tmp_path: Path) -> None:
    pkg = make_project(tmp_path, {"model.py": _MODEL, "loss.py": _LOSS.replace(".logits\n", ".logits.float()\n")})
    assert _found(pkg) == []
    (pkg / "loss.py").write_text(textwrap.dedent(_LOSS).replace(
        "F.cross_entropy(logits.flatten(0, 1), ids.flatten())", "F.log_softmax(logits, -1, dtype=torch.float32)"))
    assert _found(pkg) == []
    (pkg / "loss.py").write_text(textwrap.dedent(_LOSS).replace(
        "    return F.cross_entropy", "    with torch.autocast('cuda', dtype=torch.bfloat16):\n"
                                    "        return F.cross_entropy").replace("import torch.nn", "import torch\nimport torch.nn"))
    assert _found(pkg) == []                                          # autocast runs cross_entropy in float32
    (pkg / "loss.py").write_text(textwrap.dedent(_LOSS) + textwrap.dedent("""
        def other(model, x):
            import torch
            with torch.autocast("cuda"):
                return model(x)
    """))
    assert _found(pkg) == [("loss.py", 7, "MEDIUM")]


def test_logsigmoid_is_not_protected_by_autocast_and_names_without_logits_are_not_judged(tmp_path: Path) -> None:
    source = """
        import torch
        import torch.nn.functional as F
        from pkg.model import load
        def pairwise(path, a, b):
            model = load(path)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                chosen_logits, rejected_logits = model(a).logits, model(b).logits
                margin = F.logsigmoid(chosen_logits - rejected_logits)
                hidden = F.log_softmax(model(a).hidden_states, -1)
            return margin, hidden
    """
    pkg = make_project(tmp_path, {"model.py": _MODEL, "rm.py": source})
    assert _found(pkg) == [("rm.py", 9, "MEDIUM")]


def test_a_helper_that_upcasts_its_parameter_is_not_a_finding_at_its_callers(tmp_path: Path) -> None:
    helper = """
        import torch.nn.functional as F
        def log_probs_from_logits(logits, labels):
            logits = logits.float()
            return F.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1))
    """
    caller = """
        from pkg.model import load
        from pkg.helper import log_probs_from_logits
        def act(path, seq):
            out = load(path)(seq)
            return log_probs_from_logits(out["logits"], seq)
    """
    pkg = make_project(tmp_path, {"model.py": _MODEL, "helper.py": helper, "actor.py": caller})
    assert _found(pkg) == []
    (pkg / "helper.py").write_text(textwrap.dedent(helper).replace("    logits = logits.float()\n", ""))
    assert _found(pkg) == [("actor.py", 6, "HIGH")]     # the helper's own op: no low-precision model next to it


def test_autocast_in_the_program_or_only_a_dtype_test_as_evidence_is_medium(tmp_path: Path) -> None:
    train = """
        import torch
        from pkg.loss import step
        def train(path, batches):
            for ids in batches:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    step(path, ids).backward()
        def evaluate(path, ids):
            return step(path, ids)
    """
    pkg = make_project(tmp_path, {"model.py": _MODEL, "loss.py": _LOSS, "train.py": train})
    assert _found(pkg) == [("loss.py", 7, "MEDIUM")]               # the trainer's autocast may cover it
    (pkg / "train.py").write_text(textwrap.dedent(train).split("def evaluate")[0])
    assert _found(pkg) == []                                       # every call is under autocast: float32 there
    tested = """
        import torch
        class Norm(torch.nn.Module):
            def forward(self, x):
                if self.weight.dtype in [torch.float16, torch.bfloat16]:
                    x = x.to(self.weight.dtype)
                return x * self.weight
        def load(path):
            ...
    """
    (tmp_path / "two").mkdir()
    pkg2 = make_project(tmp_path / "two", {"model.py": tested, "loss.py": _LOSS})
    assert _found(pkg2) == [("loss.py", 7, "MEDIUM")]              # written to allow half weights, not a run
    (pkg2 / "model.py").write_text(textwrap.dedent(tested).replace("self.weight.dtype in", "x.dtype in"))
    assert _found(pkg2) == []                                      # an activation test is not a weight's


# ---- AMP011 through names: a parameter's default, a constant imported from the project ------------
_FP16_TRAINER = """
    import torch
    from pkg import layers
    def train(model, x, opt):
        model = model.half()
        loss = model(x).sum()
        loss.backward()
        opt.step()
"""


def test_a_fill_constant_reached_through_a_default_or_an_import_is_judged_like_a_literal(tmp_path: Path) -> None:
    assert torch.tensor(-1e32).half().isinf() and torch.tensor(-1e20).half().isinf()
    layers = """
        import torch
        from pkg.consts import NEAR_INF
        def masked_softmax(vector, mask, mask_fill_value: float = -1e32):
            return torch.softmax(vector.masked_fill(~mask, mask_fill_value), -1)
        def attend(scores, mask):
            return scores.masked_fill_(mask, -NEAR_INF)
        def safe(scores, mask, fill: float = -1e4):
            return scores.masked_fill(mask, fill)
        def rebound(scores, mask, fill: float = -1e32):
            fill = torch.finfo(scores.dtype).min
            return scores.masked_fill(mask, fill)
    """
    pkg = make_project(tmp_path, {"consts.py": "NEAR_INF = 1e20\n", "layers.py": layers, "train.py": _FP16_TRAINER})
    assert _found(pkg, "AMP011") == [("layers.py", 5, "HIGH"), ("layers.py", 7, "HIGH")]
