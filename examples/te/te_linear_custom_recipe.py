"""Our formats inside a Transformer Engine Linear: TE's custom recipe with our factory.

    CUSTOM_QUANT_TYPE=nvfp4 python examples/te/te_linear_custom_recipe.py [--format FMT]

Needs a CUDA GPU and transformer-engine >= 2.16. Runs one TE Linear forward + backward under
``CustomRecipe(qfactory=...)`` and prints how far its output is from our emulation of the same
GEMM (quant.gemm_plan with quant.quantize): ~0 means TE ran our numerics.
"""
from __future__ import annotations

import os

from lowp_common import CommandParser, UserError, cli_entry


@cli_entry("te_linear_custom_recipe")
def main(argv=None) -> int:
    p = CommandParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default=os.environ.get("CUSTOM_QUANT_TYPE", "mxfp8"),
                   help="a quant.FORMATS name (default: CUSTOM_QUANT_TYPE, else mxfp8)")
    args = p.parse_args(argv)
    import torch

    from quant import gemm_plan
    from te_integration import factory

    factory.check_te_version(factory.installed_te_version())
    if not torch.cuda.is_available():
        raise UserError("this example needs a CUDA GPU (Transformer Engine runs on one)")
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import CustomRecipe

    torch.manual_seed(0)
    layer = te.Linear(2048, 8192, bias=False, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    recipe = CustomRecipe(qfactory=factory.make_factory(args.format))
    with te.autocast(enabled=True, recipe=recipe):
        y = layer(x)
    y.float().square().mean().backward()
    want = gemm_plan.linear_forward(x.detach(), layer.weight.detach(), None,
                                    gemm_plan.format_quantizer(args.format))
    err = (y.detach().float() - want.float()).abs().max().item()
    print(f"{args.format}: max |TE custom recipe - our emulation| = {err:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
