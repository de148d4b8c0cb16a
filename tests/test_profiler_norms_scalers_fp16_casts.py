"""Checker rules for a total gradient norm in float16 (AMP029), a GradScaler
with nothing low precision to scale for (AMP030), float16 hard-coded where the project offers
bfloat16 (AMP001). Each premise checked with real torch where a CPU can show it, and each rule's
edges (what it must not report) on small projects."""
from __future__ import annotations

import textwrap
from pathlib import Path

import torch
from amp_project_helpers import LOW, found, make_project

from training_profiler.amp_checker import checker as sc


# ---- AMP029 gradient norm in float16 ------------------------------------------------------------
def test_a_float16_gradient_norm_is_inf_and_clipping_by_it_zeroes_the_step() -> None:
    """Loss-scaled float16 gradients: each element fits, the norm does not."""
    grad = torch.full((64,), 20000.0, dtype=torch.float16)
    assert torch.isfinite(grad).all()
    total = torch.norm(torch.stack([torch.norm(grad, 2)]), 2)
    assert total.dtype == torch.float16 and torch.isinf(total)
    clip_coef = 1.0 / (total + 1e-6)
    assert torch.all(grad * clip_coef == 0)                       # the whole step is zeroed
    exact = torch.norm(grad, 2, dtype=torch.float32)
    assert torch.isfinite(exact) and abs(exact.item() - 160000.0) < 1.0


_NORM = """
    import torch
    def clip(params, max_norm):
        total = torch.norm(torch.stack([torch.norm(p.grad.detach(), 2) for p in params]), 2)
        for p in params:
            p.grad.detach().mul_(max_norm / (total + 1e-6))
"""


def test_a_gradient_norm_is_high_with_float16_parameters_in_the_project_and_low_without(tmp_path: Path) -> None:
    pkg = make_project(tmp_path, {"clip.py": _NORM})
    assert found(pkg, "AMP029") == [("clip.py", 4, "LOW")]       # the inner norm, not the norm of norms
    (pkg / "fp16.py").write_text("import torch\ndef init(shape):\n"
                                 "    return torch.nn.Parameter(torch.empty(shape, dtype=torch.float16))\n")
    assert found(pkg, "AMP029") == [("clip.py", 4, "HIGH")]


def test_a_single_logged_norm_and_an_upcast_norm_are_not_reported(tmp_path: Path) -> None:
    pkg = make_project(tmp_path, {"log.py": """
        import torch
        def log_norms(model, log):
            for name, p in model.named_parameters():
                log(name, p.grad.norm())
        def total(params):
            norms = []
            for p in params:
                g = p.grad.detach().float()
                norms.append(g.norm(2))
            return torch.stack(norms).norm(2)
    """})
    assert found(pkg, "AMP029") == []


# ---- AMP030 GradScaler without autocast ---------------------------------------------------------
def test_a_forward_outside_autocast_stays_float32_whatever_the_scaler_does() -> None:
    model = torch.nn.Linear(4, 4)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    loss = model(torch.randn(2, 4)).sum()
    assert loss.dtype == torch.float32
    scaled = scaler.scale(loss)
    assert scaled.dtype == torch.float32 and torch.allclose(scaled, loss * 1024.0)   # it only multiplies


_LOOP = """
    import torch
    def train(model, loader, optimizer):
        scaler = torch.amp.GradScaler("cuda")
        for batch in loader:
            loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
"""


def test_a_scaler_alone_is_reported_at_the_forward_and_autocast_anywhere_silences_it(tmp_path: Path) -> None:
    pkg = make_project(tmp_path, {"train.py": _LOOP})
    assert found(pkg, "AMP030") == [("train.py", 6, "HIGH")]
    (pkg / "model.py").write_text("import torch\nclass M(torch.nn.Module):\n"
                                  "    @torch.autocast('cuda', dtype=torch.float16)\n"
                                  "    def forward(self, x):\n        return x\n")
    assert found(pkg, "AMP030") == []


def test_a_bfloat16_cast_does_not_silence_it_and_a_float16_cast_does(tmp_path: Path) -> None:
    pkg = make_project(tmp_path, {"train.py": _LOOP,
                              "load.py": "import torch\ndef load(model):\n    return model.to(torch.bfloat16)\n"})
    assert found(pkg, "AMP030") == [("train.py", 6, "HIGH")]
    (pkg / "load.py").write_text("import torch\ndef load(model):\n    return model.to(torch.float16)\n")
    assert found(pkg, "AMP030") == []


def test_a_scaler_wrapper_given_the_loss_is_not_reported(tmp_path: Path) -> None:
    """timm's NativeScaler: the loss arrives as a parameter; the forward is elsewhere."""
    pkg = make_project(tmp_path, {"scaler.py": """
        import torch
        class NativeScaler:
            def __init__(self):
                self._scaler = torch.amp.GradScaler("cuda")
            def __call__(self, loss, optimizer):
                self._scaler.scale(loss).backward()
                self._scaler.step(optimizer)
                self._scaler.update()
    """})
    assert found(pkg, "AMP030") == []


# ---- AMP001 float16 hard-coded where the project offers bfloat16 ---------------------------------
def test_float16_cannot_hold_what_bfloat16_holds() -> None:
    x = torch.tensor([70000.0, 1e-8], dtype=torch.bfloat16)
    assert torch.isfinite(x).all() and x[1] > 0
    y = x.to(torch.float16)
    assert torch.isinf(y[0]) and y[1] == 0                          # overflow, and underflow below 6e-8


_MERGE = """
    import torch
    def merge(model):
        model = model.merge_and_unload()
        model.to(dtype=torch.float16)
        return model
"""


def test_a_hard_coded_model_cast_is_reported_only_where_bf16_is_offered(tmp_path: Path) -> None:
    pkg = make_project(tmp_path, {"merge.py": _MERGE})
    assert found(pkg, "AMP001", "hard-coded") == []
    (pkg / "args.py").write_text("def add(parser):\n    parser.add_argument('--bf16', action='store_true')\n")
    assert found(pkg, "AMP001", "hard-coded") == [("merge.py", 5, "HIGH")]


def test_a_guarded_cast_a_tensor_cast_and_a_default_dtype_are_not_hard_coded(tmp_path: Path) -> None:
    pkg = make_project(tmp_path, {"args.py": "def add(parser):\n    parser.add_argument('--bf16')\n", "m.py": """
        import torch
        def build(task, cfg):
            model = task.build_model(cfg.model)
            if cfg.fp16:
                model = model.half()
            return model
        def shards(in_tensors):
            return {k: in_tensors[k].half() for k in in_tensors}
        def shard_dtype(shards):
            dtype = torch.float16
            for k in shards:
                dtype = shards[k].dtype
            return dtype
        def to_fp16(model):
            return model.half()
    """})
    assert found(pkg, "AMP001", "hard-coded") == []


def test_bfloat16_is_offered_by_a_switch_or_a_choice_not_by_a_format_list_or_a_cast(tmp_path: Path) -> None:
    pkg = make_project(tmp_path, {"merge.py": _MERGE, "report.py": """
        def formats(analyze, x):
            rows = x.bfloat16()
            return analyze(rows, formats=["bf16", "fp8_e4m3"])
    """})
    assert found(pkg, "AMP001", "hard-coded") == []
    (pkg / "args.py").write_text('FIELDS = {"torch_dtype": {"choices": ["auto", "bfloat16", "float16"]}}\n')
    assert found(pkg, "AMP001", "hard-coded") == [("merge.py", 5, "HIGH")]


def test_a_separate_script_offering_bf16_says_nothing_of_another(tmp_path: Path) -> None:
    for name, source in {"merge_tool": _MERGE, "train_tool": "def add(p):\n    p.add_argument('--bf16')\n"}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.py").write_text(textwrap.dedent(source))
    assert not [f for f in sc.check_paths([tmp_path], min_confidence=LOW).findings if "hard-coded" in f.message]


def test_a_pipeline_part_is_medium_and_a_test_module_is_not_reported(tmp_path: Path) -> None:
    pkg = make_project(tmp_path, {"args.py": "def add(p):\n    p.add_argument('--bf16')\n", "gen.py": """
        import torch
        def sample(pipeline, vae):
            vae.to(dtype=torch.float16)
            pipeline.transformer = pipeline.transformer.to(torch.float16)
    """})
    assert found(pkg, "AMP001", "hard-coded") == [("gen.py", 4, "MEDIUM"), ("gen.py", 5, "MEDIUM")]
    (pkg / "tests").mkdir()
    (pkg / "tests" / "test_merge.py").write_text(textwrap.dedent(_MERGE))
    assert [f for f in found(pkg, "AMP001", "hard-coded") if f[0] == "test_merge.py"] == []


# ---- AMP031 a log that float16 makes -inf -------------------------------------------------------
def test_float16_rounds_a_sigmoid_and_a_small_eps_to_zero_before_the_log() -> None:
    margin = torch.tensor([-18.0], dtype=torch.float16)
    assert torch.sigmoid(margin).item() == 0.0 and torch.isinf(torch.log(torch.sigmoid(margin))).all()
    assert torch.isfinite(torch.nn.functional.logsigmoid(margin.float())).all()
    p = torch.zeros(1, dtype=torch.float16)
    assert torch.isinf((p + 1e-8).log()).all()                      # 1e-8 is below 6e-8: zero in float16
    assert torch.isfinite((p + 1e-6).log()).all() and torch.isfinite((p.float() + 1e-8).log()).all()


def test_log_underflow_follows_named_constants_and_skips_autocast_softmax(tmp_path: Path) -> None:
    pkg = make_project(tmp_path, {"loss.py": """
        import torch
        EPS = 1e-8
        def cost(p, logits):
            alpha, gamma, eps = 0.25, 2.0, 1e-8
            a = (p + EPS).log()
            b = torch.log(1 - p + eps)
            c = torch.log(torch.softmax(logits, -1) + 1e-9)
            d = torch.log(p + 1e-6)
            return a + b + c + d
        def train(model, x, opt):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = cost(model(x), model(x))
            loss.backward()
    """})
    assert [(line, conf) for _, line, conf in found(pkg, "AMP031")] == [(6, "HIGH"), (7, "HIGH")]
