"""Transformer Engine's Linear / LayerNormLinear on a GPU under our quantizer factory, against
our emulation (quant.gemm_plan): output, dgrad, wgrad, bias gradient and fused ``main_grad``.

``python bench/te_gpu_check.py [--fmt mxfp8]`` on a CUDA machine with TE >= 2.16 installed
(bench/gpu_check.sh step 6). Prints one line per check with the largest difference relative to
the reference's largest value; exit 1 when any exceeds 1e-5. The CPU counterpart, on TE's
Python with a stub extension, is tests/test_te_real.py.
"""
from __future__ import annotations

import sys

import torch

from lowp_common import CommandParser


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def check(fmt: str, tokens: int = 256, n_in: int = 512, n_out: int = 384) -> dict[str, float]:
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import CustomRecipe

    from quant import gemm_plan
    from te_integration import factory

    recipe = CustomRecipe(qfactory=factory.make_factory(fmt))
    q = gemm_plan.format_quantizer(fmt)
    torch.manual_seed(0)
    x = torch.randn(tokens, n_in, device="cuda")
    dy = torch.randn(tokens, n_out, device="cuda")
    out: dict[str, float] = {}
    for kind in ("Linear", "LayerNormLinear"):
        mod = getattr(te, kind)(n_in, n_out, bias=True, params_dtype=torch.float32,
                                fuse_wgrad_accumulation=True).cuda()
        mod.bias.data = mod.bias.data.bfloat16().float()     # TE's FP8 GEMMs take a bf16 bias
        preset = torch.randn_like(mod.weight)
        mod.weight.main_grad = preset.clone()
        mod.weight.grad_added_to_main_grad = False
        xi = x.clone().requires_grad_(True)
        with te.autocast(enabled=True, recipe=recipe):
            y = mod(xi)
        y.backward(dy)
        inp = x if kind == "Linear" else torch.nn.functional.layer_norm(
            x, (n_in,), mod.layer_norm_weight.detach(), mod.layer_norm_bias.detach(), mod.eps)
        w = mod.weight.detach()
        out[f"{kind} y"] = _rel(y.detach(), gemm_plan.linear_forward(inp, w, mod.bias.detach(), q))
        out[f"{kind} main_grad"] = _rel(mod.weight.main_grad - preset, gemm_plan.linear_wgrad(dy, inp, q))
        out[f"{kind} bias grad"] = _rel(mod.bias.grad, dy.sum(0))
        if kind == "Linear":
            out[f"{kind} dx"] = _rel(xi.grad, gemm_plan.linear_dgrad(dy, w, q))
    return out


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fmt", default="mxfp8", help="a quant.FORMATS name (default mxfp8)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("te_gpu_check: no CUDA GPU here", file=sys.stderr)
        return 2
    worst = 0.0
    for name, rel in check(args.fmt).items():
        print(f"{args.fmt:>8} {name:<28} max |diff| / max |ref| = {rel:.2e}")
        worst = max(worst, rel)
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
