"""Run-time precision audit (issue 43): each reproduction of bench/audit_cases gives its rule and
its clean twin nothing; the audit changes no value and leaves nothing installed; the decorator,
the context manager and lowp-audit work on a plain loop, a Hugging Face-style model and our
Megatron GPT."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from training_helpers import small_data  # noqa: F401

from training_profiler.audit import audit_precision, precision_audit, run_script
from training_profiler.audit.cli import main as audit_main
from training_profiler.audit.rules import RULES

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "bench" / "audit_cases"
EXPECTED = json.loads((CASES / "expected.json").read_text())


def _rules(findings) -> set[str]:
    return {f.rule_id for f in findings}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_reproduction_found_and_twin_clean(case: str) -> None:
    row = EXPECTED[case]
    bug = run_script(str(CASES / case), [], steps=2)
    twin = run_script(str(CASES / row["clean_twin"]), [], steps=2)
    assert bug.error is None and twin.error is None, (bug.error, twin.error)
    assert row["rule"] in _rules(bug.findings), [f.message for f in bug.findings]
    found = next(f for f in bug.findings if f.rule_id == row["rule"])
    assert found.path.endswith(case) and found.line > 0     # the user's line, not torch's
    assert twin.findings == [], [f"{f.rule_id} {f.message}" for f in twin.findings]


def test_every_rule_has_a_reproduction() -> None:
    assert {r.id for r in RULES} == {row["rule"] for row in EXPECTED.values()}
    assert all(r.explanation and r.suggestion for r in RULES)


def _loop(steps: int, audit_steps: int | None, dtype=torch.bfloat16) -> tuple[list[float], list]:
    """A plain loop under autocast; with ``audit_steps`` its step is @audit_precision'd."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16), torch.randint(0, 8, (8,))

    def step() -> float:
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    if audit_steps is not None:
        step = audit_precision(steps=audit_steps, report=None)(step)
    return [step() for _ in range(steps)], [p.detach().clone() for p in model.parameters()], step


def test_audit_changes_no_value() -> None:
    bare_losses, bare_params, _ = _loop(4, None)
    losses, params, _ = _loop(4, 2)
    assert losses == bare_losses
    assert all(torch.equal(a, b) for a, b in zip(params, bare_params))


def test_decorator_audits_only_its_steps_and_removes_everything() -> None:
    from torch.nn.modules import module as m
    from torch.optim import optimizer as o

    before = (len(m._global_forward_pre_hooks), len(m._global_forward_hooks),
              len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks),
              torch.amp.GradScaler.scale, torch.autograd.Function.__dict__["apply"],
              torch.amp.autocast_mode.autocast.__enter__)
    _, _, step = _loop(2, 2)
    calls = sum(s.calls for s in step.audit.record.sites.values())
    assert calls > 0 and len(step.audit.record.steps) == 2
    step()                                                   # a third call runs bare
    assert sum(s.calls for s in step.audit.record.sites.values()) == calls
    assert len(step.audit.record.steps) == 2
    after = (len(m._global_forward_pre_hooks), len(m._global_forward_hooks),
             len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks),
             torch.amp.GradScaler.scale, torch.autograd.Function.__dict__["apply"],
             torch.amp.autocast_mode.autocast.__enter__)
    assert after == before and torch._C._len_torch_dispatch_stack() == 0
    assert step.audit.findings == []                         # bf16 autocast over fp32: clean


def test_decorator_prints_the_findings_after_its_last_audited_step(capsys) -> None:
    @audit_precision(steps=2)
    def step() -> None:
        torch.log_softmax(torch.randn(2, 4).bfloat16(), -1)

    step()
    assert capsys.readouterr().err == ""
    step()
    err = capsys.readouterr().err
    assert "AUD001" in err and f"File: {__file__}" in err
    step()
    assert capsys.readouterr().err == ""


def test_record_is_per_call_site_not_per_call() -> None:
    _, _, step = _loop(2, 2)
    sites_2 = len(step.audit.record.sites)
    _, _, step10 = _loop(10, 10)
    assert len(step10.audit.record.sites) == sites_2         # 5x the calls, the same sites
    assert max(s.calls for s in step10.audit.record.sites.values()) >= 10


def test_autocast_state_is_what_autocast_says() -> None:
    """Under autocast, log_softmax on bf16 is autocast's (CUDA's runs it in fp32) and a mean it
    leaves in bf16 its policy: no finding;
    the same op on bf16 with autocast off is one, located on this file's line."""
    logits = torch.randn(4, 8).bfloat16()
    conv = torch.nn.Conv2d(3, 4, 3)
    with precision_audit() as on:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.log_softmax(logits, -1)
            conv(torch.randn(2, 3, 8, 8)).mean((2, 3))   # pooling a bf16 conv: autocast's policy
    with precision_audit() as off:
        torch.log_softmax(logits, -1)
    assert on.findings == []
    (f,) = off.findings
    assert f.rule_id == "AUD001" and f.path == __file__


def test_torch_checkpointing_is_not_a_dtype_changing_function() -> None:
    """CheckpointFunction returns autocast's bf16 for fp32 inputs and restores autocast itself."""
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(4, 4)
    with precision_audit() as audit:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = checkpoint(lin, torch.randn(2, 4, requires_grad=True), use_reentrant=True)
        out.float().sum().backward()
    assert audit.findings == [] and out.dtype == torch.bfloat16


def test_fp16_range_uses_quant_analysis_limits() -> None:
    from quant.analysis import dtype_limits

    top = dtype_limits(torch.float16).max_normal
    near = torch.tensor([0.95 * top], dtype=torch.float16)
    far = torch.tensor([0.85 * top], dtype=torch.float16)
    with precision_audit() as a:
        near * 1.0
    with precision_audit() as b:
        far * 1.0
    assert _rules(a.findings) == {"AUD003"} and b.findings == []


def test_sparse_zero_gradients_are_not_flushed_ones() -> None:
    """An embedding's unused rows are zero in any dtype: AUD004 needs underflow under way too."""
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(4096, 16).half(), torch.nn.Linear(16, 4).half()
    opt = torch.optim.SGD([*emb.parameters(), *head.parameters()], lr=0.1)
    with precision_audit() as sparse:
        F.cross_entropy(head(emb(torch.tensor([1, 2, 3]))).float(), torch.tensor([0, 1, 2])).backward()
        opt.step()
    opt.zero_grad()
    with precision_audit() as tiny:
        (1e-5 * F.cross_entropy(head(emb(torch.tensor([1, 2, 3]))).float(),
                                torch.tensor([0, 1, 2]))).backward()
        opt.step()
    assert sparse.record.steps[0].lowp_grad_flushed > 0.9 * sparse.record.steps[0].lowp_grad_elems
    assert "AUD004" not in _rules(sparse.findings) and "AUD004" in _rules(tiny.findings)


def test_hugging_face_style_model() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=32)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    found = {}
    for mode in ("fp32", "autocast", "bf16-logprobs"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        if mode == "bf16-logprobs":
            model = model.to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        @audit_precision(steps=2, report=None)
        def step() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
                out = model(input_ids=ids, labels=None if mode == "bf16-logprobs" else ids)
            loss = out.loss if out.loss is not None else \
                -torch.log_softmax(out.logits, -1).gather(-1, ids.unsqueeze(-1)).float().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()

        step()
        step()
        found[mode] = _rules(step.audit.findings)
        assert any(s.module.startswith("LlamaForCausalLM.model.layers.0")
                   for s in step.audit.record.sites.values())
    assert found == {"fp32": set(), "autocast": set(), "bf16-logprobs": {"AUD001"}}


@pytest.mark.megatron
def test_megatron_gpt_driver() -> None:
    from training_driver import megatron_env as me
    from training_driver.optim import MasterParams, build_adamw

    me.quiet_megatron_warnings()
    me.init_distributed(0, 1, master_port=me.free_port())
    found = {}
    try:
        shape = me.LlamaShape(num_layers=1, hidden_size=32, ffn_hidden_size=64,
                              num_attention_heads=4, num_query_groups=2, vocab_size=64, seq_length=16)
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(7))
        for mode in ("fp32", "bf16", "bf16-logits-loss"):
            torch.manual_seed(0)
            model = me.build_llama_model(shape, torch.float32 if mode == "fp32" else torch.bfloat16)
            master = MasterParams(model)
            opt = build_adamw(master.params, 1e-3, 0.01)

            @audit_precision(steps=2, report=None)
            def step() -> None:
                if mode == "bf16-logits-loss":   # the loss on the model's own bf16 logits
                    logits = model(tokens, labels=None, **me.causal_inputs(tokens))
                    loss = F.cross_entropy(logits.flatten(0, 1), tokens.t().flatten())
                else:
                    loss = model(tokens, labels=tokens, **me.causal_inputs(tokens)).float().mean()
                loss.backward()
                master.grads_to_master()
                opt.step()
                opt.zero_grad()
                master.master_to_model()

            step()
            step()
            found[mode] = _rules(step.audit.findings)
    finally:
        me.destroy_distributed()
    assert found == {"fp32": set(), "bf16": set(), "bf16-logits-loss": {"AUD001"}}


def _exit(main, argv: list[str]) -> object:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.megatron
def test_embedded_default_training_is_clean(small_data) -> None:
    """llama-train itself, fp32 and bf16 (bf16 model, fp32 master weights), under lowp-audit -m."""
    args = ["--data-path", small_data["data_path"], "--tokenizer", small_data["tokenizer"],
            "--model", "tiny", "--train-iters", "3", "--no-resume"]
    for dtype in ("fp32", "bf16"):
        out = run_script("training_driver.train", [*args, "--dtype", dtype], steps=2, module=True)
        assert out.error is None and out.steps == 2, out.error
        assert out.findings == [], [f"{f.rule_id} {f.message}" for f in out.findings]


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(body)
    return str(path)


LOOP = """import sys, torch
model = torch.nn.Linear(4, 4).to(torch.bfloat16)
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
for i in range(int(sys.argv[1])):
    print("step", i, flush=True)
    model(torch.randn(2, 4, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_cli_runs_the_script_for_its_steps(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    script = _script(tmp_path, LOOP)
    out_json = tmp_path / "audit.json"
    code = audit_main([script, "--steps", "3", "--json", str(out_json), "--", "50"])
    out = capsys.readouterr().out
    ran = [line for line in out.splitlines() if line.startswith("step ")]
    assert ran == ["step 0", "step 1", "step 2"]                # stopped after 3 optimizer steps
    assert code == 1 and "AUD006" in out and f"{script}:" not in out   # the text format
    assert [f["rule"] for f in json.loads(out_json.read_text())["findings"]] == ["AUD006"]
    assert audit_main([script, "--json", str(out_json), "--", "1"]) == 2   # refuses to overwrite
    assert "--force" in capsys.readouterr().err
    assert sys.argv[0] != script


def test_a_run_that_keeps_overflowing_stops_after_its_iterations(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """Every step is skipped by the GradScaler (the loss is Inf): no optimizer step ever runs,
    yet the audit stops after --steps iterations, counted by GradScaler.update."""
    script = _script(tmp_path, """import torch
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
for i in range(50):
    print("iteration", i, flush=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (model(torch.randn(2, 4)) * 1e5).float().pow(2).sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
""")
    out = run_script(script, [], steps=2)
    assert out.error is None and out.steps == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("iteration")] \
        == ["iteration 0", "iteration 1"]


def test_cli_script_failing_on_its_own(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    script = _script(tmp_path, "import torch\nraise RuntimeError('no data here')\n")
    assert audit_main([script]) == 1
    err = capsys.readouterr().err
    assert "script failed" in err and "RuntimeError: no data here" in err
    tb = Path(err.strip().rsplit("its traceback: ", 1)[1])
    assert "no data here" in tb.read_text() and "Traceback" in tb.read_text()
    tb.unlink()
    assert _exit(audit_main, [script, "--nope"]) == 2
    assert _exit(audit_main, ["-m", "no_such_module_here"]) == 2
    assert "no such module" in capsys.readouterr().err


def test_static_checker_merges_the_audit(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from training_profiler.amp_checker.checker import main as static_main

    script = _script(tmp_path, LOOP.replace("int(sys.argv[1])", "3").replace('    print("step", i, flush=True)\n', ""))
    code = static_main([script, "--audit", script, "--format", "json", "--min-confidence", "low"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["files_checked"] == 2
    assert {f["rule"] for f in report["findings"] if f["rule"].startswith("AUD")} == {"AUD006"}
    assert all(f["path"] == script for f in report["findings"])


# ---- issue 48: findings at the line the user changes; hand-written updates judged -------------

def _line(text: str, marker: str) -> int:
    """The 1-based line of ``text`` holding ``marker`` (once)."""
    (n,) = [i for i, line in enumerate(text.splitlines(), 1) if marker in line]
    return n


def _audited(tmp_path: Path, body: str, args: list[str] = (), steps: int = 2):
    """``body`` run as a training script under the audit (which it must not fail in): its
    findings as lowp-audit's JSON writes them."""
    script = _script(tmp_path, body)
    out = run_script(script, args, steps=steps)
    assert out.error is None, out.error
    return script, [f.to_dict() for f in out.findings]


ADAM_FP16 = """import sys, torch
class Mine(torch.optim.Adam):                    # a user subclass: built where it is called
    def __init__(self, params, eps):
        super().__init__(params, lr=1e-3, eps=eps)
dtype = torch.float16 if sys.argv[1] == "half" else torch.float32
model = torch.nn.Linear(8, 8).to(dtype)          # CAST
opt = (Mine if sys.argv[2] == "mine" else torch.optim.Adam)(  # BUILT
    model.parameters(), eps=1e-8)
for i in range(5):
    (model(torch.randn(4, 8, dtype=dtype)).float() ** 2).mean().backward()
    opt.step()                                   # STEP
    opt.zero_grad()
"""


@pytest.mark.parametrize("kind", ["adam", "mine"])
def test_fp16_adam_state_is_found_where_the_optimizer_was_built(tmp_path: Path, kind: str) -> None:
    script = _script(tmp_path, ADAM_FP16)
    out_json = tmp_path / "audit.json"
    assert audit_main([script, "--json", str(out_json), "--", "half", kind]) == 1
    (f,) = [f for f in json.loads(out_json.read_text())["findings"] if f["rule"] == "AUD005"]
    assert (f["path"], f["line"]) == (script, _line(ADAM_FP16, "# BUILT"))
    assert f"stepped at line {_line(ADAM_FP16, '# STEP')}" in f["message"]
    assert f"parameters cast to float16 at line {_line(ADAM_FP16, '# CAST')}" in f["message"]
    assert "eps 1e-08" in f["message"]
    _, clean = _audited(tmp_path, ADAM_FP16, ["float", kind])
    assert clean == []


def test_an_optimizer_built_before_the_audit_is_found_where_it_stepped() -> None:
    """The construction line is seen only while the audit runs (a decorated step's optimizer
    is built before it): the finding stays where the optimizer ran."""
    model = torch.nn.Linear(8, 8).half()
    opt = torch.optim.Adam(model.parameters(), eps=1e-8)

    @audit_precision(steps=1, report=None)
    def step() -> None:
        (model(torch.randn(4, 8).half()).float() ** 2).mean().backward()
        opt.step()                                                    # DECORATED_STEP

    step()
    (f,) = [f for f in step.audit.findings if f.rule_id == "AUD005"]
    assert f.path == __file__ and f.line == _line(Path(__file__).read_text(), "# DECORATED" "_STEP")
    assert "built at" not in f.message and "cast to" not in f.message


def test_scaler_cast_and_autocast_findings_stand_where_they_were_built_or_entered() -> None:
    """AUD008 at the GradScaler's construction, AUD006 at the model's cast, AUD007 at the float16
    autocast region's entry; each message names where it ran."""
    lines = {case: (CASES / case).read_text() for case in
             ("scaler_with_bf16.py", "bf16_params_no_master.py", "fp16_autocast_no_scaler.py")}
    expect = {"scaler_with_bf16.py": ("AUD008", "GradScaler(", "scaling at line", "scaler.scale("),
              "bf16_params_no_master.py": ("AUD006", ".to(torch.bfloat16)", "stepped at line", "opt.step()"),
              "fp16_autocast_no_scaler.py": ("AUD007", "torch.autocast(", "float16 gradients at line",
                                             ".backward()")}
    for case, (rule, at, ran, ran_at) in expect.items():
        (f,) = [f for f in run_script(str(CASES / case), [], steps=2).findings if f.rule_id == rule]
        assert f.line == _line(lines[case], at), (case, f.line, f.message)
        assert f"{ran} {_line(lines[case], ran_at)}" in f.message, f.message


def test_an_op_under_autocast_names_the_region_entered() -> None:
    text = (CASES / "bce_under_autocast.py").read_text()
    (f,) = run_script(str(CASES / "bce_under_autocast.py"), [], steps=2).findings
    assert f.rule_id == "AUD010"
    assert f"autocast bfloat16 entered at line {_line(text, 'torch.autocast(')}" in f.message


MANUAL = """import sys, torch
import torch.nn.functional as F
dtype, lr, form = getattr(torch, sys.argv[1]), float(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
model = model.to(dtype)                                         # CAST
x, y = torch.randn(64, 16, dtype=dtype), torch.randint(0, 8, (64,))
for i in range(20):
    print("iteration", i, flush=True)
    loss = F.cross_entropy(model(x).float(), y)
    model.zero_grad()
    loss.backward()
    params = list(model.parameters())
    if form == "foreach":
        with torch.no_grad():
            torch._foreach_add_(params, [p.grad for p in params], alpha=-lr)  # UPDATE foreach
    for p in params if form != "foreach" else []:
        if form == "data":
            p.data.add_(p.grad, alpha=-lr)                      # UPDATE data
        else:
            with torch.no_grad():
                if form == "param":
                    p.add_(p.grad, alpha=-lr)                   # UPDATE param
                else:
                    p -= lr * p.grad                            # UPDATE isub
"""


@pytest.mark.parametrize("form", ["data", "param", "isub", "foreach"])
def test_hand_written_bf16_updates_are_judged(tmp_path: Path, form: str,
                                              capsys: pytest.CaptureFixture) -> None:
    """word_language_model's loop: lost updates found in bfloat16 (at the cast, naming the update
    line); none when the same loop runs in float32 or its update is large enough for bfloat16."""
    script, found = _audited(tmp_path, MANUAL, ["bfloat16", "1e-3", form], steps=3)
    ran = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iteration")]
    assert ran == [f"iteration {i}" for i in range(4)]     # stopped at the 4th iteration's backward
    (f,) = found
    assert f["rule"] == "AUD006" and (f["path"], f["line"]) == (script, _line(MANUAL, "# CAST"))
    assert f"updated at line {_line(MANUAL, f'# UPDATE {form}')}" in f["message"]
    assert _audited(tmp_path, MANUAL, ["float32", "1e-3", form])[1] == []
    assert _audited(tmp_path, MANUAL, ["bfloat16", "10", form])[1] == []


def test_a_lost_update_is_counted_element_by_element() -> None:
    """Half the elements get an update of 1e-4 of their value (far below bfloat16's half ulp,
    2^-9 relative at least), half one of 1e-1 (far above): exactly the first half is lost; the
    parameter ends as the same update without the audit leaves it."""
    torch.manual_seed(0)
    w = (torch.rand(1000) + 0.5).bfloat16()
    step = torch.cat([w[:500].float() * 1e-4, w[500:].float() * 1e-1]).bfloat16()
    bare, audited = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    with torch.no_grad():
        bare.sub_(step)
    with precision_audit() as audit, torch.no_grad():
        audited.sub_(step)
    (up,) = audit.record.updates.values()
    assert (up.moved_elems, up.stuck_elems, up.op) == (1000, 500, "sub_")
    assert torch.equal(audited, bare)


def test_copies_and_steps_are_not_hand_written_updates() -> None:
    """``copy_`` from float32 masters is no update; an optimizer's own in-place ops are its step's."""
    model = torch.nn.Linear(8, 8).bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with precision_audit() as audit:
        model(torch.randn(2, 8).bfloat16()).float().sum().backward()
        opt.step()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.float() + 1e-6)
    assert audit.record.updates == {} and len(audit.record.steps) == 1


def test_the_construction_wrappers_are_removed_after_the_audit() -> None:
    methods = (torch.optim.Optimizer.__init__, torch.amp.GradScaler.__init__,
               *(torch.nn.Module.__dict__[m] for m in ("half", "bfloat16", "float", "double", "to", "type")))
    with precision_audit():
        torch.nn.Linear(2, 2).half()
        assert torch.optim.Optimizer.__init__ is not methods[0]
    assert (torch.optim.Optimizer.__init__, torch.amp.GradScaler.__init__,
            *(torch.nn.Module.__dict__[m] for m in ("half", "bfloat16", "float", "double", "to", "type"))) == methods
