"""Workers for the capture tests on real megatron-core (run in spawned processes).

Each worker puts the patched megatron-core copy (or nothing, for the unpatched baseline)
first on sys.path before importing megatron, builds the tiny Llama GPTModel, runs forward and
backward under several capture settings on the same weights and tokens, and writes losses,
gradients and the capture directories for the parent test to check.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

SCENARIOS = ("off", "capture", "mxfp8", "mxfp8_noattn")


def _fwd_bwd(model, tokens):
    from training_driver.megatron_env import causal_inputs

    for p in model.parameters():
        p.grad = None
    loss = model(tokens, labels=tokens, **causal_inputs(tokens))
    loss.float().mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().clone(), grads


def tiny_shape(me):
    """The tiny Llama of the runtime capture tests: 2 layers, hidden 64, 4 heads in 2 GQA
    groups, sequence 32; ``me``: the training_driver.megatron_env module of the worker's
    (patched) tree."""
    return me.LlamaShape(num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                         num_query_groups=2, vocab_size=128, seq_length=32)


def tiny_model_and_tokens(me):
    """The tiny Llama (:func:`tiny_shape`) and its batch of 2 sequences of seeded tokens."""
    shape = tiny_shape(me)
    tokens = torch.randint(0, shape.vocab_size, (2, shape.seq_length),
                           generator=torch.Generator().manual_seed(7))
    return me.build_llama_model(shape), tokens


def megatron_worker(rank: int, world: int, patched_dir: str | None, port: int, out_dir: str,
                    scenarios: tuple[str, ...]) -> None:
    for var in ("TENSOR_SAVE_ENABLED", "CUSTOM_QUANT_TYPE", "TENSOR_SAVE_CONFIG",
                "TENSOR_SAVER_ITERATION", "TENSOR_SAVE_DIR"):
        os.environ.pop(var, None)
    # The baseline must see the installed megatron-core even if the parent put a patched
    # copy on sys.path; a patched run must see its copy first.
    sys.path[:] = [p for p in sys.path if not (Path(p) / "megatron/core/tensor_saver.py").is_file()
                   or (Path(p) / "megatron/core/__init__.py").is_file() is False]
    if patched_dir:
        sys.path.insert(0, patched_dir)
    from training_driver import megatron_env as me

    me.init_distributed(rank, world, tensor_model_parallel_size=world, master_port=port)
    import megatron.core

    out = Path(out_dir)
    result: dict = {"megatron_file": megatron.core.__file__}
    try:
        model, tokens = tiny_model_and_tokens(me)
        for scen in scenarios:
            if scen == "off":
                loss, grads = _fwd_bwd(model, tokens)
            else:
                from megatron.core import tensor_saver as ts

                kw = dict(enabled=True, save_dir=str(out / scen), save_quantized=True)
                if scen.startswith("mxfp8"):
                    kw["quant_type"] = "mxfp8"
                    kw["emulate_attention"] = scen == "mxfp8"
                elif scen.startswith("te_"):            # a Transformer Engine recipe
                    kw["quant_type"] = scen
                saver = ts.configure(**kw)
                saver.set_iteration(3)
                saver.set_sample_idx(5)
                loss, grads = _fwd_bwd(model, tokens)
                saver.flush()
                ts.reset_tensor_saver()
            result[f"loss_{scen}"] = loss
            result[f"grads_{scen}"] = grads
    finally:
        torch.save(result, out / f"result_rank{rank}.pt")
        me.destroy_distributed()


def run_spawned(world: int, patched_dir: str | None, out_dir: Path,
                scenarios: tuple[str, ...]) -> list[dict]:
    import torch.multiprocessing as mp

    from training_driver.megatron_env import free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(megatron_worker, args=(world, patched_dir, free_port(), str(out_dir), scenarios),
             nprocs=world, join=True)
    return [torch.load(out_dir / f"result_rank{r}.pt", weights_only=True) for r in range(world)]


def expected_sites(num_layers: int = 2) -> set[tuple[str, str, str, str]]:
    """(module_path, operation, phase, tensor_name) for one forward+backward of the tiny GPT."""
    linear = [("forward", "pre", "input"), ("forward", "pre", "weight"),
              ("forward", "post", "output"), ("backward", "pre", "grad_output"),
              ("backward", "pre", "weight"), ("backward", "post", "grad_input"),
              ("backward", "post", "grad_weight")]
    attn = [("forward", "pre", "query"), ("forward", "pre", "key"), ("forward", "pre", "value"),
            ("forward", "pre", "attention_probs"),
            ("forward", "post", "context"), ("backward", "pre", "grad_context"),
            ("backward", "post", "grad_query"), ("backward", "post", "grad_key"),
            ("backward", "post", "grad_value")]
    out = set()
    paths = ["output_layer"]
    for i in range(num_layers):
        base = f"decoder.layers.{i}"
        paths += [f"{base}.self_attention.linear_qkv", f"{base}.self_attention.linear_proj",
                  f"{base}.mlp.linear_fc1", f"{base}.mlp.linear_fc2"]
        out |= {(f"{base}.self_attention.core_attention",) + a for a in attn}
    out |= {(p,) + x for p in paths for x in linear}
    return out
