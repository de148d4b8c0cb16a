"""Drive Transformer Engine's real Linear / LayerNormLinear / GroupedLinear under
``CustomRecipe(qfactory=te_integration.factory.quantizer_factory)`` on a CPU.

``python tests/te_real/drive.py TE_ROOT OUT.pt`` (run by tests/test_te_real.py, one process per
TE version: TE registers torch ops at import, so two versions cannot share a process). Each
case records its tensors, or the one-line error it raised, in OUT.pt; the test recomputes the
expected numbers with quant.gemm_plan in its own process. CUSTOM_QUANT_TYPE and
LOWP_TE_ROLE_FORMATS come from the environment the test sets.
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from te_real import boot

IN, OUT, TOKENS = 64, 48, (4, 8)     # 32 tokens: whole blocks of 32 along every GEMM axis


def _data(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-3, 4, shape, generator=g).float())


def _bias() -> torch.Tensor:
    """Values bfloat16 holds exactly: with float32 activations TE hands a quantized GEMM its
    bias in bfloat16 (what cuBLAS's FP8 GEMM takes), our qgemm included."""
    return _data(2, OUT).bfloat16().float()


def _linear(te, recipe, bias: bool, name: str | None = None, **kw) -> Any:
    torch.manual_seed(0)
    lin = te.Linear(IN, OUT, bias=bias, device="cpu", params_dtype=torch.float32, **kw)
    if name is not None:
        lin.name = name
    with torch.no_grad():
        lin.weight.copy_(_data(1, OUT, IN))
        if bias:
            lin.bias.copy_(_bias())
    return lin


def _fwd(te, recipe, mod, *args, **kw):
    with te.autocast(enabled=True, recipe=recipe):
        return mod(*args, **kw)


def _x(seed: int) -> torch.Tensor:
    return boot.cuda_labelled(_data(seed, *TOKENS, IN).requires_grad_(True))


def case_linear(te, recipe, bias: bool) -> dict:
    lin = _linear(te, recipe, bias)
    x, dy = _x(3), _data(4, *TOKENS, OUT)
    y = _fwd(te, recipe, lin, x)
    y.backward(dy)
    out = {"x": x.detach().clone(), "w": lin.weight.detach().clone(), "dy": dy, "y": y.detach(),
           "dx": x.grad.detach(), "dw": lin.weight.grad.detach()}
    if bias:
        out.update(b=lin.bias.detach().clone(), db=lin.bias.grad.detach())
    return out


def case_fused_wgrad(te, recipe, bias: bool) -> dict:
    """Megatron's DDP: a preset main_grad, grad_added_to_main_grad False before backward."""
    lin = _linear(te, recipe, bias, fuse_wgrad_accumulation=True)
    preset = _data(5, OUT, IN)
    lin.weight.main_grad = preset.clone()
    lin.weight.grad_added_to_main_grad = False
    x, dy = _x(3), _data(4, *TOKENS, OUT)
    _fwd(te, recipe, lin, x).backward(dy)
    return {"x": x.detach().clone(), "w": lin.weight.detach().clone(), "dy": dy,
            "preset": preset, "main_grad": lin.weight.main_grad.detach().clone(),
            "added": bool(lin.weight.grad_added_to_main_grad), "dx": x.grad.detach()}


def case_microbatches(te, recipe) -> dict:
    """is_first_microbatch True then False: two forwards before two backwards."""
    lin = _linear(te, recipe, False)
    x1, x2, dy1, dy2 = _x(6), _x(7), _data(8, *TOKENS, OUT), _data(9, *TOKENS, OUT)
    y1 = _fwd(te, recipe, lin, x1, is_first_microbatch=True)
    y2 = _fwd(te, recipe, lin, x2, is_first_microbatch=False)
    y2.backward(dy2)
    y1.backward(dy1)
    return {"w": lin.weight.detach().clone(), "x1": x1.detach().clone(), "x2": x2.detach().clone(),
            "dy1": dy1, "dy2": dy2, "y1": y1.detach(), "y2": y2.detach(),
            "dx1": x1.grad.detach(), "dx2": x2.grad.detach(), "dw": lin.weight.grad.detach()}


def case_nograd_workspace(te, recipe) -> dict:
    """A weight workspace cached under no_grad (no columnwise copy), then a training step."""
    lin = _linear(te, recipe, False)
    with torch.no_grad():
        _fwd(te, recipe, lin, _x(10), is_first_microbatch=True)
    x, dy = _x(3), _data(4, *TOKENS, OUT)
    y = _fwd(te, recipe, lin, x, is_first_microbatch=False)
    y.backward(dy)
    return {"x": x.detach().clone(), "w": lin.weight.detach().clone(), "dy": dy, "y": y.detach(),
            "dx": x.grad.detach(), "dw": lin.weight.grad.detach()}


def case_layernorm_linear(te, recipe) -> dict:
    torch.manual_seed(0)
    mod = te.LayerNormLinear(IN, OUT, bias=True, device="cpu", params_dtype=torch.float32)
    with torch.no_grad():
        mod.weight.copy_(_data(1, OUT, IN))
        mod.bias.copy_(_bias())
        mod.layer_norm_weight.copy_(1 + 0.1 * _data(11, IN))
        mod.layer_norm_bias.copy_(0.1 * _data(12, IN))
    x, dy = _x(3), _data(4, *TOKENS, OUT)
    y = _fwd(te, recipe, mod, x)
    y.backward(dy)
    return {"x": x.detach().clone(), "w": mod.weight.detach().clone(), "b": mod.bias.detach().clone(),
            "gamma": mod.layer_norm_weight.detach().clone(), "beta": mod.layer_norm_bias.detach().clone(),
            "eps": float(mod.eps), "dy": dy, "y": y.detach(), "dx": x.grad.detach(),
            "dw": mod.weight.grad.detach(), "db": mod.bias.grad.detach()}


def case_grouped_linear(te, recipe) -> dict:
    torch.manual_seed(0)
    mod = te.GroupedLinear(2, IN, OUT, bias=False, device="cpu", params_dtype=torch.float32)
    x = boot.cuda_labelled(_data(3, 32, IN).requires_grad_(True))
    y = _fwd(te, recipe, mod, x, [16, 16])
    y.backward(torch.ones_like(y))
    return {"ran": True}


#: rules the role case runs under (the test checks which slot got which format)
ROLE_RULES = "name=layers.1.mlp.linear_fc2,tensor_type=weight:hp;name~=linear_fc1$:mxfp4"
#: layer names as Megatron gives them: a module path, nvdlfw-inspect's name, none
ROLE_NAMES = {"path": "decoder.layers.1.mlp.linear_fc2", "fc1": "decoder.layers.1.mlp.linear_fc1",
              "inspect_name": "model.module.decoder.layers.2.mlp.linear_fc2",
              "layer2": "decoder.layers.2.mlp.linear_fc2", "none": None}


def case_role_formats(te, recipe) -> dict:
    """The format each quantizer slot of a Linear got under ROLE_RULES, per layer name."""
    from transformer_engine.common.recipe import CustomRecipe

    from te_integration import factory

    ruled = CustomRecipe(qfactory=factory.make_factory("mxfp8", factory.parse_rules(ROLE_RULES)))
    out = {}
    for key, name in ROLE_NAMES.items():
        lin = _linear(te, ruled, False, name=name)
        try:
            _fwd(te, ruled, lin, _x(3)).sum().backward()
        except Exception as exc:
            out[key] = {"error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"}
            continue
        out[key] = _slot_formats(lin)
    return out


def case_entry_named(te, recipe) -> dict:
    """A model tree whose TE layer TE itself called Layer_N, named by our Megatron-LM entry
    point, under ROLE_RULES: the formats its slots got."""
    from transformer_engine.common.recipe import CustomRecipe

    from te_integration import factory
    from te_integration.megatron_lm import name_te_layers

    ruled = CustomRecipe(qfactory=factory.make_factory("mxfp8", factory.parse_rules(ROLE_RULES)))
    out = {}
    tree = torch.nn.Module()
    tree.decoder = torch.nn.Module()
    tree.decoder.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
    tree.decoder.layers[1].mlp = torch.nn.Module()
    tree.decoder.layers[1].mlp.linear_fc2 = _linear(te, ruled, False)
    fc2 = tree.decoder.layers[1].mlp.linear_fc2
    out["te_default_name"] = fc2.name
    name_te_layers(tree)
    _fwd(te, ruled, fc2, _x(3)).sum().backward()
    out["entry_named"] = _slot_formats(fc2)
    return out


def _slot_formats(lin) -> dict:
    fmts = {}
    for q in (q for qs in lin.quantizers.values() for q in qs if q is not None):
        fmts.setdefault(getattr(q, "tensor_type", "") or "other", getattr(q, "fmt", "?"))
    return fmts


#: our what-if feature on one layer, through TE's real debug namespace (its debug/features)
DEBUG_YAML = """
fc1:
  enabled: True
  layers:
    layer_name_regex_pattern: .*linear_fc1$
  transformer_engine:
    LowpWhatIf:
      enabled: True
      tensors: [activation, weight, gradient]
      formats: [mxfp8, nvfp4]
"""
DEBUG_LAYER = "decoder.layers.0.mlp.linear_fc1"


def _debug_api(root: Path, tmp: Path):
    """nvdlfw-inspect initialized with our feature folder and TE's real one; a recording logger."""
    import nvdlfw_inspect.api as debug_api
    from nvdlfw_inspect.logging import BaseLogger

    from te_integration.check_cli import FEATURE_DIR

    class Recorder(BaseLogger):
        def __init__(self):
            super().__init__()
            self.values = {}

        def log_scalar(self, name, value, iteration, **kwargs):
            self.values[name] = float(value)

    logger = Recorder()
    (tmp / "inspect.yaml").write_text(DEBUG_YAML)
    debug_api.initialize(config_file=str(tmp / "inspect.yaml"), statistics_logger=logger,
                         feature_dirs=[str(FEATURE_DIR), str(root / "transformer_engine/debug/features")],
                         log_dir=str(tmp / "logs"))
    return debug_api, logger


def case_debug_features(te, recipe, root: Path, tmp: Path) -> dict:
    """A high-precision TE Linear (TE's own GEMM path: the stub's float32 GEMM) with our
    what-if feature through TE's real debug namespace; the logged numbers."""
    debug_api, logger = _debug_api(root, tmp)
    try:
        lin = te.Linear(IN, OUT, bias=False, device="cpu", params_dtype=torch.float32,
                        name=DEBUG_LAYER)
        with torch.no_grad():
            lin.weight.copy_(_data(1, OUT, IN))
        x, dy = _x(3), _data(4, *TOKENS, OUT)
        lin(x).backward(dy)
        debug_api.step()
        return {"x": x.detach().clone(), "w": lin.weight.detach().clone(), "dy": dy,
                "values": dict(logger.values), "dx": x.grad.detach()}
    finally:
        debug_api.end_debug()


def case_debug_with_custom_recipe(te, recipe, root: Path, tmp: Path) -> dict:
    """The debug API and the custom recipe together (TE sends debug-wrapped custom tensors to
    its native GEMM): the factory's one line, before any GEMM."""
    debug_api, _ = _debug_api(root, tmp)
    try:
        lin = _linear(te, recipe, False, name=DEBUG_LAYER)
        _fwd(te, recipe, lin, _x(3)).sum().backward()
        return {"ran": True}
    finally:
        debug_api.end_debug()


CASES: dict[str, Callable] = {
    "linear": lambda te, r: case_linear(te, r, False),
    "linear_bias": lambda te, r: case_linear(te, r, True),
    "fused_wgrad": lambda te, r: case_fused_wgrad(te, r, False),
    "fused_wgrad_bias": lambda te, r: case_fused_wgrad(te, r, True),
    "microbatches": case_microbatches,
    "nograd_workspace": case_nograd_workspace,
    "layernorm_linear": case_layernorm_linear,
    "grouped_linear": case_grouped_linear,
    "role_formats": case_role_formats,
    "entry_named": case_entry_named,
}
#: cases that also take the TE root and a scratch folder
DEBUG_CASES: dict[str, Callable] = {
    "debug_features": case_debug_features,
    "debug_with_custom_recipe": case_debug_with_custom_recipe,
}


def main(root: str, out_path: str, only: list[str]) -> None:
    te = boot.load(Path(root))
    import transformer_engine
    from transformer_engine.common.recipe import CustomRecipe

    from te_integration import factory

    recipe = CustomRecipe(qfactory=factory.quantizer_factory)
    results: dict[str, Any] = {"version": transformer_engine.__version__}
    scratch = Path(out_path).parent
    cases = {**CASES, **{k: (lambda te_, r, f=f: f(te_, r, Path(root), scratch))
                         for k, f in DEBUG_CASES.items()}}
    for name, case in cases.items():
        if only and name not in only:
            continue
        try:
            results[name] = case(te, recipe)
        except Exception as exc:
            line = (str(exc).splitlines() or [""])[0]
            results[name] = {"error": f"{type(exc).__name__}: {line}",
                             "traceback": traceback.format_exc()[-3000:]}
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
