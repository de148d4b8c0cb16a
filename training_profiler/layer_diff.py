"""P3: layer-wise precision diff ("AutoDiff"): where does low precision start to hurt?

Runs one batch through a model twice, in fp32 and in a low-precision mode (a quant/ format on
every Linear, or bf16/fp16 autocast), compares each layer's forward output and output gradient
(relative error, cosine similarity) and names the first layer where the error jumps.

Memory-safe by construction: layers are compared one group at a time. For each group the two
passes keep only that group's outputs and gradients (gradients via torch.autograd.grad, so the
parameters' .grad are untouched), and the low-precision pass quantizes weights on the fly instead
of holding a second model. Peak memory is one training graph plus two copies of one group's
outputs, at the price of 2 passes per group.

    precision-diff --model tiny-gpt --mode mxfp8 --group-size 4
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lowp_common import CommandParser, UserError, cli_entry, json_dumps
from training_profiler._tensors import first_tensor
from training_profiler.lowp_emulation import AUTOCAST_MODES, is_linear, precision


@dataclass
class LayerDiff:
    name: str
    module_type: str
    fwd_rel_error: float
    fwd_cosine: float
    grad_rel_error: float
    grad_cosine: float


@dataclass
class DiffReport:
    mode: str
    layers: list[LayerDiff]
    first_jump: str | None
    jump_ratio: float
    worst_layer: str | None
    loss_ref: float
    loss_lowp: float
    groups: int
    passes: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_text(self) -> str:
        lines = [f"Layer-wise precision diff: fp32 vs {self.mode}  (loss {self.loss_ref:.6g} vs "
                 f"{self.loss_lowp:.6g}; {self.groups} group(s), {self.passes} passes)",
                 f"  {'#':>3} {'layer':<48} {'type':<20} {'fwd rel err':>11} {'fwd cos':>9} "
                 f"{'grad rel err':>12} {'grad cos':>9}"]
        for i, l in enumerate(self.layers):
            mark = "  <-- first jump" if l.name == self.first_jump else ""
            lines.append(f"  {i:>3} {l.name[:48]:<48} {l.module_type[:20]:<20} {l.fwd_rel_error:>11.3e} "
                         f"{l.fwd_cosine:>9.5f} {l.grad_rel_error:>12.3e} {l.grad_cosine:>9.5f}{mark}")
        if self.first_jump:
            lines.append(f"First jump: '{self.first_jump}' (forward error x{self.jump_ratio:.1f} over the "
                         f"layer before). Worst layer: '{self.worst_layer}'.")
        else:
            lines.append(f"No jump: the error grows smoothly. Worst layer: '{self.worst_layer}'.")
        lines += [f"Note: {n}" for n in self.notes]
        return "\n".join(lines)


def default_layers(model: torch.nn.Module) -> list[str]:
    """Leaf modules that own parameters (Linear, embeddings, norms, ...)."""
    return [n for n, m in model.named_modules()
            if not list(m.children()) and any(True for _ in m.parameters(recurse=False))]


def _as_loss(out: Any) -> torch.Tensor:
    t = first_tensor(out)
    if t is None:
        raise ValueError("step_fn must return a tensor (the loss, or an output to average)")
    return t.float().mean() if t.numel() != 1 else t.float().reshape(())


def _execution_order(model: torch.nn.Module, step_fn: Callable, names: Sequence[str], seed: int) -> list[str]:
    order: list[str] = []
    mods = dict(model.named_modules())
    hs = [mods[n].register_forward_hook(lambda m, a, o, n=n: order.append(n) if n not in order else None)
          for n in names]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            step_fn(model)
    finally:
        for h in hs:
            h.remove()
    return order + [n for n in names if n not in order]


def _run_pass(model: torch.nn.Module, step_fn: Callable, group: Sequence[str], mode: str, seed: int
              ) -> tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor | None]]]:
    """One forward+backward; returns the loss and {layer: (output, output gradient)} for ``group``."""
    mods = dict(model.named_modules())
    live: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(m, a, out):
            t = first_tensor(out)
            if t is not None and t.is_floating_point() and name not in live:
                live[name] = t
                # Copied now: later ops may work in place on it (Megatron's cross entropy
                # turns the logits into softmax in place).
                values[name] = t.detach().float().clone()
                if t.requires_grad:
                    # Registered before the emulation's gradient quantizer: records the gradient
                    # as it arrives at this output (torch.autograd.grad's own return values
                    # mix pre- and post-hook values depending on graph position).
                    t.register_hook(lambda g: grads.__setitem__(name, g.detach().float().clone()))
        return hook

    hs = [mods[n].register_forward_hook(keep(n)) for n in group]
    try:
        with torch.random.fork_rng(devices=[]), precision(model, mode):
            torch.manual_seed(seed)
            loss = _as_loss(step_fn(model))
            names = [n for n in group if n in live and live[n].requires_grad]
            if names:
                torch.autograd.grad(loss, [live[n] for n in names], allow_unused=True)
    finally:
        for h in hs:
            h.remove()
    out = {n: (values[n], grads.get(n)) for n in live}
    live.clear()
    return float(loss.detach()), out


def _compare(ref: torch.Tensor | None, test: torch.Tensor | None) -> tuple[float, float]:
    from quant import metrics

    if ref is None or test is None or ref.shape != test.shape:
        return math.nan, math.nan
    return float(metrics.relative_error(ref, test)), float(metrics.cosine_similarity(ref, test))


def find_jump(errors: Sequence[float], jump_factor: float, min_error: float) -> tuple[int | None, float]:
    """Index of the first layer whose error is ``jump_factor`` times the layer before's (both
    floored at ``min_error``), and that ratio. The first layer is never a jump: its error is
    the format's own rounding."""
    for i in range(1, len(errors)):
        cur, prev = errors[i], errors[i - 1]
        if not math.isfinite(cur):
            return i, math.inf
        if cur >= min_error and cur >= jump_factor * max(prev if math.isfinite(prev) else 0.0, min_error):
            return i, cur / max(prev, min_error)
    return None, 0.0


def check_mode(mode: str) -> None:
    """ValueError unless ``mode`` is fp32, an autocast mode or a quant format (checked before any
    model is built, so a typo costs no megatron import)."""
    if mode != "fp32" and mode not in AUTOCAST_MODES:
        from quant.vocabulary import FormatNameError, check_format_name

        try:
            check_format_name(mode, "--mode", high_precision=False)
        except FormatNameError as exc:
            raise ValueError(f"{exc}; or an autocast mode: {', '.join(sorted(AUTOCAST_MODES))}") from None


def layer_diff(model: torch.nn.Module, step_fn: Callable[[torch.nn.Module], Any], mode: str = "bf16", *,
               layers: Sequence[str] | None = None, group_size: int | None = 8, jump_factor: float = 4.0,
               min_error: float = 1e-3, seed: int = 0, progress: bool = False) -> DiffReport:
    """Compare every layer's output and output gradient between fp32 and ``mode``.

    ``step_fn(model)`` runs one batch and returns the loss (or an output, which is averaged);
    it must not call backward. ``mode`` is a quant format name (emulated on Linear-like layers),
    'autocast_bf16' or 'autocast_fp16'. ``group_size=None`` compares all layers in one pair of
    passes (fastest, most memory).
    """
    check_mode(mode)
    all_names = dict(model.named_modules())
    names = list(layers) if layers is not None else default_layers(model)
    unknown = [n for n in names if n not in all_names]
    if unknown:
        raise ValueError(f"layers not in the model: {unknown[:5]}")
    if not names:
        raise ValueError("no layers to compare (the model has no leaf module with parameters)")
    names = _execution_order(model, step_fn, names, seed)
    size = group_size or len(names)
    groups = [names[i:i + size] for i in range(0, len(names), size)]
    results: dict[str, LayerDiff] = {}
    loss_ref = loss_low = math.nan
    from tqdm import tqdm

    for group in tqdm(groups, desc=f"fp32 vs {mode}", unit="group", disable=not progress, file=sys.stderr):
        loss_ref, ref = _run_pass(model, step_fn, group, "fp32", seed)
        loss_low, low = _run_pass(model, step_fn, group, mode, seed)
        for n in group:
            r, l = ref.get(n), low.get(n)
            fe, fc = _compare(r[0] if r else None, l[0] if l else None)
            ge, gc = _compare(r[1] if r else None, l[1] if l else None)
            results[n] = LayerDiff(n, type(all_names[n]).__name__, fe, fc, ge, gc)
        del ref, low
    ordered = [results[n] for n in names]
    errs = [l.fwd_rel_error for l in ordered]
    idx, ratio = find_jump(errs, jump_factor, min_error)
    finite = [(e, l.name) for e, l in zip(errs, ordered) if math.isfinite(e)]
    worst = max(finite)[1] if finite else None
    notes = []
    if mode not in AUTOCAST_MODES and mode != "fp32":
        n_lin = sum(is_linear(all_names[n]) for n in names)
        notes.append(f"{mode} emulated on Linear layers only (inputs, weights, output gradients); "
                     f"{n_lin} of the {len(names)} compared layers are Linear, the others carry "
                     f"the error forward")
    return DiffReport(mode, ordered, ordered[idx].name if idx is not None else None, ratio, worst,
                      loss_ref, loss_low, len(groups), 2 * len(groups) + 1, notes)


# ---- command line ------------------------------------------------------------------------------
def _demo_mlp(seed: int) -> tuple[torch.nn.Module, Callable]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(64, 64), torch.nn.GELU())],
                                torch.nn.Linear(64, 8))
    x = torch.randn(32, 64)
    y = torch.randint(0, 8, (32,))
    return model, lambda m: torch.nn.functional.cross_entropy(m(x), y)


def _tiny_gpt(seed: int, num_layers: int) -> tuple[torch.nn.Module, Callable, Callable]:
    from training_driver.megatron_env import quiet_megatron_warnings

    quiet_megatron_warnings()      # before megatron is imported: its TE/apex notes say nothing here
    from training_driver.megatron_env import (
        LlamaShape,
        build_llama_model,
        causal_inputs,
        destroy_distributed,
        free_port,
        init_distributed,
    )

    init_distributed(0, 1, master_port=free_port(), seed=seed)
    shape = LlamaShape(num_layers=num_layers)
    model = build_llama_model(shape)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab_size, (2, shape.seq_length), generator=gen)
    dev = next(model.parameters()).device
    tokens = tokens.to(dev)
    return model, lambda m: m(tokens, labels=tokens, **causal_inputs(tokens)).float().mean(), destroy_distributed


@cli_entry("precision-diff")
def main(argv: Sequence[str] | None = None) -> int:
    p = CommandParser(prog="precision-diff", description="Layer-wise fp32 vs low-precision diff: "
                      "names the first layer where the error jumps.")
    p.add_argument("--model", choices=("tiny-gpt", "mlp"), default="tiny-gpt",
                   help="tiny-gpt: a small megatron-core GPTModel (TP=1); mlp: a 5-layer MLP")
    p.add_argument("--mode", default="mxfp8", help="a CUSTOM_QUANT_TYPE format, or autocast_bf16 / autocast_fp16")
    p.add_argument("--group-size", type=int, default=8, help="layers compared per pair of passes (0: all at once)")
    p.add_argument("--num-layers", type=int, default=2, help="transformer layers of tiny-gpt")
    p.add_argument("--jump-factor", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=("text", "json"), default="text")
    args = p.parse_args(argv)
    try:   # every argument checked before megatron is imported: a typo is one line, no warnings
        check_mode(args.mode)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.group_size < 0 or args.num_layers < 1:
        raise UserError("--group-size must be >= 0 and --num-layers >= 1")
    cleanup = None
    try:
        if args.model == "mlp":
            model, step = _demo_mlp(args.seed)
        else:
            model, step, cleanup = _tiny_gpt(args.seed, args.num_layers)
        report = layer_diff(model, step, args.mode, group_size=args.group_size or None,
                            jump_factor=args.jump_factor, seed=args.seed, progress=True)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    finally:
        if cleanup:
            cleanup()
    print(json_dumps(report.to_dict(), indent=2, default=str) if args.format == "json" else report.to_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
