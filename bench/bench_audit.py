"""Run-time precision audit: its cost on a training step and what it finds (issues 43, 48).

    python bench/bench_audit.py            # cost, then recall / false findings
    python bench/bench_audit.py --quick    # cost only

Cost: one training step timed bare, under the audit, and bare again after the audit (the
recorder and every hook removed), the same step in the same run; the ratio is audited / bare
(the issue asks <= 3x for the audited steps, 1x after). Findings: every reproduction of
``bench/audit_cases/expected.json`` must give its rule (recall), its clean twin nothing, and so
must the embedded default training, llama-train fp32 and bf16, run under ``lowp-audit -m``
(false findings), as must tiny Hugging Face models trained correctly.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CASES = ROOT / "bench" / "audit_cases"

from training_profiler.audit import precision_audit, run_script  # noqa: E402


def _mlp_step(hidden: int = 512, layers: int = 4, batch: int = 256, autocast: bool = True):
    """A plain PyTorch step: an MLP classifier under bf16 autocast, AdamW."""
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.LayerNorm(hidden)]
    model = torch.nn.Sequential(*mods, torch.nn.Linear(hidden, 1000))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, hidden)
    y = torch.randint(0, 1000, (batch,))

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def _manual_step(hidden: int = 512, layers: int = 4, batch: int = 256, lr: float = 1e-3):
    """word_language_model's loop (issue 48): a bfloat16 MLP whose parameters the step updates
    by hand, ``p.data.add_(p.grad, alpha=-lr)``; under the audit each update is judged."""
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    model = torch.nn.Sequential(*mods, torch.nn.Linear(hidden, 1000)).to(torch.bfloat16)
    x = torch.randn(batch, hidden, dtype=torch.bfloat16)
    y = torch.randint(0, 1000, (batch,))

    def step() -> float:
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        model.zero_grad()
        loss.backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        return loss.item()

    return step


def _gpt_step():
    """The embedded model: megatron-core's tiny Llama GPT, the driver's bf16 master weights."""
    from training_driver import megatron_env as me
    from training_driver.optim import MasterParams, build_adamw

    me.quiet_megatron_warnings()
    me.init_distributed(0, 1, master_port=me.free_port())
    shape = me.LlamaShape(num_layers=2, hidden_size=256, ffn_hidden_size=704, num_attention_heads=8,
                          num_query_groups=4, vocab_size=2048, seq_length=128)
    torch.manual_seed(0)
    model = me.build_llama_model(shape, torch.bfloat16)
    master = MasterParams(model)
    opt = build_adamw(master.params, 1e-3, 0.01)
    tokens = torch.randint(0, shape.vocab_size, (4, shape.seq_length), generator=torch.Generator().manual_seed(7))

    def step() -> float:
        loss = model(tokens, labels=tokens, **me.causal_inputs(tokens)).float().mean()
        loss.backward()
        master.grads_to_master()
        opt.step()
        opt.zero_grad()
        master.master_to_model()
        return float(loss.detach())

    return step, me.destroy_distributed


def _timed(step, audited: bool) -> tuple[float, int]:
    t = time.perf_counter()
    if not audited:
        step()
        return time.perf_counter() - t, 0
    with precision_audit() as audit:
        step()
    return time.perf_counter() - t, len(audit.findings)


def cost(name: str, step, n: int = 7) -> None:
    """Bare and audited steps interleaved (a loaded machine slows both alike), then bare steps
    after the last audit; medians."""
    step()                                   # warm-up
    bare, audited, findings = [], [], 0
    for _ in range(n):
        bare.append(_timed(step, False)[0])
        seconds, found = _timed(step, True)
        audited.append(seconds)
        findings += found
    after = statistics.median(_timed(step, False)[0] for _ in range(n))
    b, a = statistics.median(bare), statistics.median(audited)
    print(f"{name:40s} bare {b * 1e3:7.1f} ms | audited {a * 1e3:7.1f} ms (x{a / b:.2f}) | "
          f"after {after * 1e3:7.1f} ms (x{after / b:.2f}) | findings {findings}")


def findings_table() -> None:
    rows = json.loads((CASES / "expected.json").read_text())
    caught, twin_findings = 0, 0
    for case, row in rows.items():
        bug = run_script(str(CASES / case), [], steps=2)
        twin = run_script(str(CASES / row["clean_twin"]), [], steps=2)
        rules = sorted({f.rule_id for f in bug.findings})
        hit = row["rule"] in rules
        caught += hit
        twin_findings += len(twin.findings)
        assert bug.error is None and twin.error is None, (case, bug.error, twin.error)
        print(f"{case:32s} {row['bug_kind']:32s} expect {row['rule']} {'found' if hit else 'MISSED':6s} "
              f"rules {','.join(rules):28s} twin {len(twin.findings)} finding(s)")
    print(f"recall {caught}/{len(rows)} = {caught / len(rows):.2f}; findings on the {len(rows)} clean "
          f"twins: {twin_findings}")
    _hf_sweep()
    embedded = _embedded_default()
    print("embedded default (llama-train --model tiny, 2 audited steps): "
          + ", ".join(f"{k}: {v} finding(s)" for k, v in embedded.items()))


def _hf_sweep() -> None:
    """Tiny Hugging Face models built from configs (no download), trained correctly for 2 steps:
    fp32, bf16 autocast, fp16 autocast with a GradScaler. Every finding here is a false one."""
    try:
        import transformers as T
    except ImportError:
        print("Hugging Face models: skipped (transformers is not installed)")
        return
    builders = {
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4,
                                                       n_positions=32)),
        "bert-cls": lambda: T.BertForSequenceClassification(T.BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, num_labels=3)),
        "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(
            vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)),
    }
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    runs, false = 0, 0
    for name, build in builders.items():
        for dtype in (None, torch.bfloat16, torch.float16):
            torch.manual_seed(0)
            model = build()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
            labels = torch.tensor([0, 2]) if name == "bert-cls" else ids
            with precision_audit() as audit:
                for _ in range(2):
                    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                        loss = model(input_ids=ids, labels=labels).loss
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad()
            runs += 1
            false += len(audit.findings)
            for f in audit.findings:
                print(f"  {name} {dtype}: {f.rule_id} {f.message}")
    print(f"Hugging Face models (GPT-2, BERT classifier, T5, Mistral x fp32 / bf16 autocast / fp16 "
          f"autocast + GradScaler): {false} finding(s) in {runs} runs")


def _embedded_default() -> dict[str, int]:
    from training_driver.data.corpus import write_builtin_corpus
    from training_driver.data.preprocess import preprocess

    with tempfile.TemporaryDirectory() as root:
        corpus = os.path.join(root, "corpus.jsonl")
        write_builtin_corpus(corpus, max_chars=60_000)
        data = preprocess([corpus], os.path.join(root, "data", "docs"), vocab_size=384, progress=False)
        out = {}
        for dtype in ("fp32", "bf16"):
            args = ["--data-path", data["data_prefix"], "--tokenizer", data["tokenizer"], "--model",
                    "tiny", "--dtype", dtype, "--train-iters", "3", "--no-resume"]
            res = run_script("training_driver.train", args, steps=2, module=True)
            assert res.error is None and res.steps == 2, res.error
            out[dtype] = len(res.findings)
            for f in res.findings:
                print(f"  {dtype}: {f.path}:{f.line} {f.rule_id} {f.message}")
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="cost only")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    cost("plain MLP step (bf16 autocast)", _mlp_step())
    cost("plain MLP step (fp32)", _mlp_step(autocast=False))
    cost("bf16 MLP step, updated by hand", _manual_step())
    saved_env = dict(os.environ)
    step, done = _gpt_step()
    try:
        cost("megatron tiny GPT step (bf16 + master)", step)
    finally:
        done()
        os.environ.clear()          # the process group's MASTER_PORT etc.: llama-train runs next
        os.environ.update(saved_env)
    if not args.quick:
        findings_table()


if __name__ == "__main__":
    main()
