"""The checker's bug-kind rules (amp_rules.BUG_KIND_FAMILIES): each rule's premise checked with
real torch where a CPU can show it, and the rule's edges (what it must not report) on small
sources."""
from __future__ import annotations

import ast
import copy
import textwrap
from pathlib import Path

import pytest
import torch

from training_profiler.amp_checker import checker as sc
from training_profiler.amp_checker.context import FileContext
from training_profiler.amp_checker.rules.helpers import EXACT_INTEGERS


def _rules(source: str) -> list[tuple[int, str]]:
    return [(f.line, f.rule_id) for f in sc.check_source(textwrap.dedent(source), "m.py")[0]]


# ---- AMP020 matrix decomposition --------------------------------------------------------------
def test_a_decomposition_of_a_product_made_under_autocast_fails_and_is_reported() -> None:
    """Autocast lowers the product; CUDA autocast has no float32 entry for svd (unlike CPU
    autocast, which upcasts it), so on CUDA svd gets the half matrix as it is: shown here with
    autocast off around the svd, which is what no entry amounts to."""
    a, b = torch.rand(2, 5, 3), torch.rand(2, 5, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cov = torch.einsum("bni,bnj->bij", a, b)
        assert cov.dtype == torch.bfloat16
        with torch.autocast("cpu", enabled=False), pytest.raises(RuntimeError, match="BFloat16"):
            torch.svd(cov)
    with torch.autocast("cpu", enabled=False):
        torch.svd(torch.einsum("bni,bnj->bij", a.float(), b.float()))
    bad = """
        import torch
        def align(a, b):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                cov = torch.einsum("bni,bnj->bij", a, b)
                return torch.linalg.svd(cov)
    """
    assert (6, "AMP020") in _rules(bad)
    assert "AMP020" not in {r for _, r in _rules(bad.replace("linalg.svd(cov)", "linalg.svd(cov.float())"))}
    assert "AMP020" not in {r for _, r in _rules(bad.replace("torch.einsum(\"bni,bnj->bij\", a, b)", "a + b"))}


# ---- AMP026 rotary angles -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_positions_in_a_cast_buffer_dtype_round_above_the_exact_integers(dtype: torch.dtype) -> None:
    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))

        def positions(self, n):
            return torch.arange(n).type_as(self.inv_freq)

    model = Rotary().to(dtype)                      # the whole model cast: the buffer goes with it
    last = EXACT_INTEGERS[str(dtype).split(".")[1]]
    pos = model.positions(4 * last).float()
    exact = torch.arange(4 * last).float()
    assert torch.equal(pos[:last + 1], exact[:last + 1])
    assert pos[last + 1] != exact[last + 1]          # the first integer the format cannot hold


def test_rotary_rule_edges() -> None:
    cls = """
        import torch
        class Rotary(torch.nn.Module):
            def __init__(self, dim):
                super().__init__()
                self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
            def forward(self, x):
                t = torch.arange(x.shape[1], device=x.device, dtype=self.inv_freq.dtype)
                return torch.outer(t, self.inv_freq).cos()
    """
    assert (8, "AMP026") in _rules(cls)
    assert "AMP026" not in {r for _, r in _rules(cls.replace("dtype=self.inv_freq.dtype", "dtype=torch.float32"))}
    # an integer buffer (position ids) is not a frequency table
    ids = cls.replace('"inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))',
                      '"position_ids", torch.arange(dim)').replace("self.inv_freq", "self.position_ids")
    assert "AMP026" not in {r for _, r in _rules(ids)}
    # a device move of the angles is not a dtype cast
    fn = """
        import torch
        def apply(freqs, t):
            freqs = freqs.to(t.device)
            return t * freqs.cos()
    """
    assert _rules(fn) == []
    assert (4, "AMP026") in _rules(fn.replace("freqs.to(t.device)", "freqs.type_as(t)"))


# ---- AMP025 a copied model cast to half ---------------------------------------------------------
def test_an_ema_copy_in_float16_stops_moving() -> None:
    model = torch.nn.Linear(4, 4, bias=False)
    torch.nn.init.ones_(model.weight)
    ema = copy.deepcopy(model).half()
    target = torch.full((4, 4), 1.5)
    decay = 0.9999
    for _ in range(10):
        with torch.no_grad():
            for v in ema.state_dict().values():
                v *= decay
                v += (1 - decay) * target.half()
    assert torch.equal(ema.weight.float(), torch.ones(4, 4))    # ten updates, nothing moved


def test_a_half_copy_made_to_save_the_average_is_not_reported() -> None:
    source = """
        import copy
        import torch
        class Ema:
            def __init__(self, model):
                self.ema = copy.deepcopy(model).eval()
            def update(self, model, d=0.999):
                for e, p in zip(self.ema.parameters(), model.parameters()):
                    e.mul_(d).add_(p.detach(), alpha=1 - d)
            def save(self, path):
                torch.save(copy.deepcopy(self.ema).half().state_dict(), path)
    """
    assert "AMP025" not in {r for _, r in _rules(source)}
    assert (6, "AMP025") in _rules(source.replace("copy.deepcopy(model).eval()", "copy.deepcopy(model).eval().half()"))


# ---- a precision handed to a library through **kwargs --------------------------------------------
def test_a_precision_passed_through_a_kwargs_dict_is_read() -> None:
    source = textwrap.dedent("""
        from lightning import Fabric
        def make(fp16, fabric_kwargs):
            if fp16:
                fabric_kwargs.update(precision="16-mixed")
            return Fabric(accelerator="cuda", **fabric_kwargs)
    """)
    ctx = FileContext(ast.parse(source))
    assert ("float16", "mixed") in {(d, str(h).lower()) for d, h in ctx.library_precisions}
    later = source.replace('    if fp16:\n        fabric_kwargs.update(precision="16-mixed")\n', "").replace(
        '    return Fabric(accelerator="cuda", **fabric_kwargs)',
        '    fabric = Fabric(accelerator="cuda", **fabric_kwargs)\n'
        '    fabric_kwargs.update(precision="16-mixed")\n    return fabric')
    assert later.count("update(") == 1 and later.index("Fabric(") < later.index("update(")
    assert FileContext(ast.parse(later)).library_precisions == set()   # set after the call: not given


# ---- AMP027 through a project helper ------------------------------------------------------------
def test_a_plain_scaler_beside_an_fsdp_helper_is_high_and_a_sharded_one_silences_it(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "dist.py").write_text(textwrap.dedent("""
        from torch.distributed.fsdp import FullyShardedDataParallel
        def prepare_fsdp(model):
            return FullyShardedDataParallel(model)
    """))
    (pkg / "trainer.py").write_text(textwrap.dedent("""
        import torch
        from pkg.dist import prepare_fsdp
        def fit(model, batches, opt):
            model = prepare_fsdp(model)
            scaler = torch.amp.GradScaler("cuda")
            for x in batches:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x).sum()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    """))
    found = [(Path(f.path).name, f.line, f.rule_id, f.confidence.name) for f in sc.check_paths([pkg]).findings
             if f.rule_id == "AMP027"]
    assert found == [("trainer.py", 6, "AMP027", "HIGH")]
    (pkg / "scaler.py").write_text("from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n")
    assert not [f for f in sc.check_paths([pkg]).findings if f.rule_id == "AMP027"]


def test_a_separate_script_that_uses_fsdp_says_nothing_about_this_one(tmp_path: Path) -> None:
    """An examples folder: one program shards with FSDP, another trains with DDP and a plain
    GradScaler; the second is not reported."""
    (tmp_path / "fsdp_example").mkdir()
    (tmp_path / "fsdp_example" / "__init__.py").write_text("")
    (tmp_path / "fsdp_example" / "run.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel\n"
        "def main(model):\n    return FullyShardedDataParallel(model)\n")
    (tmp_path / "ddp_example").mkdir()
    (tmp_path / "ddp_example" / "__init__.py").write_text("")
    (tmp_path / "ddp_example" / "train.py").write_text(textwrap.dedent("""
        import torch
        def fit(model, batches, opt):
            model = torch.nn.parallel.DistributedDataParallel(model)
            scaler = torch.amp.GradScaler("cuda")
            for x in batches:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x).sum()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    """))
    low = sc.Confidence.parse("low")
    assert not [f for f in sc.check_paths([tmp_path], min_confidence=low).findings if f.rule_id == "AMP027"]


def test_a_decomposition_in_set_up_code_is_not_reported() -> None:
    """An adapter's initialisation (peft's AdaMSS `update_layer`) runs before training, outside
    its autocast: only a `forward`, or code inside an autocast block, is judged."""
    source = """
        import torch
        class Adapter(torch.nn.Module):
            def update_layer(self, data, a):
                q, r = torch.linalg.qr(data.T @ a)
                return q
            def forward(self, data, a):
                q, r = torch.linalg.qr(data.T @ a)
                return q
        def train(model, x, a, opt):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, a).sum()
            loss.backward()
            opt.step()
    """
    assert [(n, r) for n, r in _rules(source) if r == "AMP020"] == [(8, "AMP020")]


# ---- AMP028 autocast off, inputs not upcast ------------------------------------------------------
def test_turning_autocast_off_does_not_upcast() -> None:
    """The rule's premise: inside a disabled region a half input stays half and a product of it
    stays half (CPU autocast shown; CUDA's behaves the same)."""
    x = torch.rand(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ x
        assert h.dtype == torch.bfloat16
        with torch.autocast("cpu", enabled=False):
            assert (h @ h).dtype == torch.bfloat16
            assert (h.float() @ h.float()).dtype == torch.float32


def test_autocast_off_rule_edges() -> None:
    source = """
        import torch
        def score(q, k, temperature):
            with torch.autocast("cuda", enabled=False):
                return torch.matmul(q, k.transpose(-1, -2)) / temperature
    """
    assert (4, "AMP028") in _rules(source)
    # an upcast, or any cast its author chose, before the use
    assert "AMP028" not in {r for _, r in _rules(source.replace("matmul(q,", "matmul(q.float(),").replace(
        "k.transpose", "k.float().transpose"))}
    assert "AMP028" not in {r for _, r in _rules(source.replace(
        '            return', '            q = q.to(k.dtype)\n            return'))}
    # a value made inside the region (not an input) is not this rule's
    made = source.replace("torch.matmul(q, k.transpose(-1, -2))", "torch.matmul(torch.ones(2, 2), torch.eye(2))")
    assert "AMP028" not in {r for _, r in _rules(made)}


def test_a_method_of_the_class_is_not_a_layer_for_autocast_off() -> None:
    """``self.noise_assignment(x_start, noise)`` inside a disabled region is the class's own
    method (denoising-diffusion-pytorch's q_sample), not a float32 layer meeting a half input."""
    source = """
        import torch
        class Diffusion(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = torch.nn.Linear(4, 4)
            def assign(self, a, b):
                return a
            @torch.autocast("cuda", enabled=False)
            def q_sample(self, x_start, noise):
                return self.assign(x_start, noise)
            @torch.autocast("cuda", enabled=False)
            def project(self, x):
                return self.proj(x)
    """
    assert [(n, r) for n, r in _rules(source) if r == "AMP028"] == [(12, "AMP028")]


def test_tables_made_fresh_inside_the_region_are_not_inputs() -> None:
    """OLMo's rotary tables: ``torch.arange(seq_len, device=device, dtype=torch.float)`` inside a
    disabled region is a new float32 tensor, not an input arriving in half."""
    source = """
        import torch
        def rotary(seq_len, device, inv_freq_base):
            with torch.autocast(device.type, enabled=False):
                seq = torch.arange(seq_len, device=device, dtype=torch.float)
                freqs = torch.einsum("i , j -> i j", seq, seq)
                return freqs @ freqs.T
    """
    assert "AMP028" not in {r for _, r in _rules(source)}


def test_the_rotary_texts_say_the_exact_integer_limits() -> None:
    """The rule text is declared literally (test_profiler_static_rule_layout); it must still say
    the one definition's numbers."""
    from training_profiler.amp_checker.rules.positions import RotaryAnglesInLowPrecision
    from training_profiler.amp_checker.rules.sensitive_ops import SENSITIVE_OPS
    text = RotaryAnglesInLowPrecision.rule.explanation
    assert f"up to {EXACT_INTEGERS['bfloat16']} (float16: {EXACT_INTEGERS['float16']})" in text
    assert f"up to {EXACT_INTEGERS['bfloat16']} (float16 up to {EXACT_INTEGERS['float16']})" in SENSITIVE_OPS[0].reason
