"""Our quantizer factory inside Transformer Engine's own Linear, LayerNormLinear and
GroupedLinear: TE's published Python (2.16, 2.18, the newest release), run on a CPU with only
its compiled extension replaced (tests/te_real: the stub, the named CPU shims, the driver).

Each TE version runs once in its own process (tests/te_real/drive.py, ~5 s); the tests here
recompute every expected number with quant.gemm_plan, our emulation of megatron-core linears,
from the tensors the driver used. The wheel (~1 MB) is downloaded once into pytest's cache
(``transformer-engine-wheels``); the tests skip, saying so, only when PyPI is unreachable.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from error_bounds import gamma

from quant import gemm_plan

for _mod in ("onnxscript", "einops", "nvdlfw_inspect"):   # TE's own imports; the test extra
    pytest.importorskip(_mod, reason=f"{_mod} (TE's Python imports it; pip install -e .[test])")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from te_real import drive, wheels  # noqa: E402

FMT = "mxfp8"


def _cache(config) -> Path:
    if getattr(config, "cache", None) is not None:
        return Path(config.cache.mkdir("transformer-engine-wheels"))
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "transformer-engine-wheels"
    cache.mkdir(parents=True, exist_ok=True)
    return cache


@pytest.fixture(scope="module", params=wheels.TE_VERSIONS, ids=lambda v: f"te{v}")
def run(request, tmp_path_factory) -> dict:
    """Every case of tests/te_real/drive.py, under one TE version."""
    try:
        root = wheels.te_root(request.param, _cache(request.config))
    except wheels.Unreachable as exc:
        pytest.skip(str(exc))
    out = tmp_path_factory.mktemp("te") / "result.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUSTOM_QUANT_TYPE": FMT}
    env.pop("LOWP_TE_ROLE_FORMATS", None)
    proc = subprocess.run([sys.executable, str(HERE / "te_real" / "drive.py"), str(root), str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = torch.load(out, weights_only=True)
    assert result["version"] == request.param
    return result


def _case(run: dict, name: str) -> dict:
    case = run[name]
    assert "error" not in case, f"TE {run['version']} {name}: {case.get('traceback', '')}"
    return case


def _q():
    return gemm_plan.format_quantizer(FMT)


def _close(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> None:
    """Same fake-quantized operands, float32 GEMMs that may sum in another order: equal within
    ``bound``, elementwise (see :func:`_expected`)."""
    gap = (actual.double() - expected.double()).abs()
    assert bool((gap <= bound).all()), f"{float((gap - bound).max())} beyond the bound"


def _abs_gemms(x, w, dy, b=None) -> dict:
    """The three GEMMs (and the bias gradient) of |operands|: the formats round sign and
    magnitude apart with scales from |x|, so q(|x|) = |q(x)| and these are sum |a||b| of the
    quantized operands, the magnitude each GEMM's rounding error is bounded by."""
    ax, aw, ady = x.abs(), w.abs(), dy.abs()
    g2, x2 = gemm_plan.wgrad_2d(ady, ax)
    out = {"y": gemm_plan.linear_forward(ax, aw, None if b is None else b.abs(), _q()),
           "dx": gemm_plan.linear_dgrad(ady, aw, _q()), "dw": gemm_plan.linear_wgrad(g2, x2, _q())}
    if b is not None:
        out["db"] = ady.reshape(-1, ady.shape[-1]).sum(0)
    return out


def _layer_norm_backward_bound(c: dict, dgrad_bound: torch.Tensor) -> torch.Tensor:
    """How far two float32 LayerNorm backwards (TE's stub, torch's) may differ when their
    incoming gradients differ by ``dgrad_bound``. The backward is
    dx = (g - mean(g) - xh mean(g xh)) / sigma with g = gamma * dy and xh the normalized input:
    linear in dy, so the incoming difference passes through its absolute-value form
    A(e) = (|gamma e| + mean|gamma e| + |xh| mean|gamma e xh|) / sigma; each side's own
    rounding (three chained reductions of IN terms, a few operations per element, the
    statistics included) is at most gamma(3 (IN + 8)) A(|dy|)."""
    x = c["x"].double()
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    sigma = (var + c["eps"]).sqrt()
    xh, gam = ((x - mu) / sigma).abs(), c["gamma"].double().abs()

    def magnitude(e: torch.Tensor) -> torch.Tensor:
        ge = gam * e
        return (ge + ge.mean(-1, keepdim=True) + xh * (ge * xh).mean(-1, keepdim=True)) / sigma

    incoming = gemm_plan.linear_dgrad(c["dy"].abs(), c["w"].abs(), _q()).double()
    own = gamma(3 * (drive.IN + 8)) * magnitude(incoming)
    return magnitude(dgrad_bound) + 2 * own


def _expected(x, w, dy, b=None) -> tuple[dict, dict]:
    """Our emulation's results and, per result, how far a float32 computation of it in any
    order may be from ours: twice gamma(k + 1) sum |a||b| (k the GEMM's reduction length, one
    more rounding for a bias; the sum of |a||b| itself computed in float32, hence (1 + gamma))."""
    g2, x2 = gemm_plan.wgrad_2d(dy, x)
    out = {"y": gemm_plan.linear_forward(x, w, b, _q()), "dx": gemm_plan.linear_dgrad(dy, w, _q()),
           "dw": gemm_plan.linear_wgrad(g2, x2, _q())}
    if b is not None:
        out["db"] = dy.reshape(-1, dy.shape[-1]).sum(0)    # unquantized, as megatron-core's
    reduction = {"y": drive.IN, "dx": drive.OUT, "dw": g2.shape[0], "db": g2.shape[0]}
    bound = {}
    for key, mag in _abs_gemms(x, w, dy, b).items():
        g = gamma(reduction[key] + 1)
        bound[key] = 2 * g * (1 + g) * mag.double()
    return out, bound


def test_te_linear_fprop_dgrad_wgrad_equal_our_emulation(run):
    c = _case(run, "linear")
    exp, bound = _expected(c["x"], c["w"], c["dy"])
    for key in ("y", "dx", "dw"):
        _close(c[key], exp[key], bound[key])
    # the emulation changed the numbers (a GEMM left in high precision would not)
    assert not torch.equal(exp["dw"], c["dy"].reshape(-1, drive.OUT).t() @ c["x"].reshape(-1, drive.IN))


@pytest.mark.parametrize("case", ["linear_bias", "layernorm_linear"])
def test_te_bias_gradient_exact_with_grad_output_emulated(run, case):
    """Problem 2: TE fuses the bias gradient into tex.bgrad_quantize, which the C++ refuses
    for a custom quantizer (a crash in the first backward on unfixed code)."""
    c = _case(run, case)
    x = c["x"]
    if case == "layernorm_linear":
        x = torch.nn.functional.layer_norm(x, (drive.IN,), c["gamma"], c["beta"], c["eps"])
    exp, bound = _expected(x, c["w"], c["dy"], c["b"])
    for key in ("y", "dw", "db"):
        _close(c[key], exp[key], bound[key])
    if case == "linear_bias":
        _close(c["dx"], exp["dx"], bound["dx"])
    else:   # through TE's LayerNorm backward (the stub's, float32) from our dgrad
        xl = c["x"].clone().requires_grad_(True)
        ln = torch.nn.functional.layer_norm(xl, (drive.IN,), c["gamma"], c["beta"], c["eps"])
        ln.backward(gemm_plan.linear_dgrad(c["dy"], c["w"], _q()))
        _close(c["dx"], xl.grad, _layer_norm_backward_bound(c, bound["dx"]))


@pytest.mark.parametrize("case", ["fused_wgrad", "fused_wgrad_bias"])
def test_te_fused_wgrad_accumulation_adds_into_main_grad(run, case):
    """Problem 1: with Megatron's gradient-accumulation fusion TE asks the wgrad GEMM to add
    into main_grad and tells DDP it did; unfixed, main_grad kept only its preset."""
    c = _case(run, case)
    exp, bound = _expected(c["x"], c["w"], c["dy"])
    assert c["added"] is True
    # one more rounding: the addition into main_grad
    added = bound["dw"] + 2 * gamma(1) * (c["preset"].double().abs() + exp["dw"].double().abs())
    _close(c["main_grad"], c["preset"] + exp["dw"], added)
    _close(c["dx"], exp["dx"], bound["dx"])


def test_te_two_forwards_before_two_backwards_reuse_the_weight_workspace(run):
    """Problem 3: is_first_microbatch True then False (pipeline warm-up); unfixed, the second
    forward found the cached workspace emptied by the first forward's save."""
    c = _case(run, "microbatches")
    q = _q()
    dw = torch.zeros_like(c["w"])
    dw_bound = torch.zeros_like(c["w"], dtype=torch.float64)
    for i in ("1", "2"):
        exp, bound = _expected(c["x" + i], c["w"], c["dy" + i])
        _close(c["y" + i], exp["y"], bound["y"])
        _close(c["dx" + i], exp["dx"], bound["dx"])
        dw += exp["dw"]
        dw_bound += bound["dw"]
    # the two micro-batches' wgrads added (one rounding each side)
    _close(c["dw"], dw, dw_bound + 2 * gamma(1) * dw.double().abs())
    assert q is not None


def test_te_weight_workspace_cached_without_its_columnwise_copy_is_rebuilt(run):
    """Problem 7: a workspace first built under no_grad (no columnwise copy) and reused by a
    training forward (is_first_microbatch False); unfixed, its backward could not rebuild it."""
    c = _case(run, "nograd_workspace")
    exp, bound = _expected(c["x"], c["w"], c["dy"])
    for key in ("y", "dx", "dw"):
        _close(c[key], exp[key], bound[key])


def test_te_grouped_linear_is_refused_in_one_line(run):
    """Problem 5: TE's grouped GEMM has no path for custom tensors (the C++ grouped quantize
    refuses ours); the factory refuses the grouped_linear role, naming the flag."""
    err = run["grouped_linear"].get("error", "")
    assert err.startswith("FactoryError: ") and "--moe-grouped-gemm" in err and "\n" not in err


def test_te_role_rules_match_megatron_layer_names(run):
    """Problem 6: Megatron names TE layers by full module path (or not at all); a name rule
    matches a dotted suffix or a regex, and with no name it refuses instead of never matching."""
    got = _case(run, "role_formats")
    assert got["path"] == {"input": FMT, "weight": "hp", "grad_output": FMT, "other": "hp"}
    assert got["fc1"] == {"input": "mxfp4", "weight": "mxfp4", "grad_output": "mxfp4", "other": "hp"}
    # nvdlfw-inspect counts layers from 1: its layers.2 is the module path's layers.1, which
    # role rules match as plans do (factory.module_path)
    assert got["inspect_name"] == got["path"]
    # layers.2 is not layers.1: a suffix matches at a dot, whole components only
    assert got["layer2"] == {"input": FMT, "weight": FMT, "grad_output": FMT, "other": "hp"}
    err = got["none"].get("error", "")
    assert err.startswith("FactoryError: LOWP_TE_ROLE_FORMATS selects layers by name")
    # TE names an unnamed layer Layer_N; te_integration.megatron_lm renames it by module path
    named = _case(run, "entry_named")
    assert named["te_default_name"].startswith("Layer_")
    assert named["entry_named"] == got["path"]


def test_our_debug_features_run_in_te_real_debug_namespace(run):
    """Our what-if feature beside TE's real debug/features folder (TE's namespace routing, not
    tests/te_standin's), called by TE's real Linear: the logged SQNR of each GEMM operand
    equals quant.quantize's along the operand's GEMM axis (activation, weight and gradient
    are fprop / dgrad operands: the last axis)."""
    import math

    from error_bounds import sqnr_db_bound

    import quant

    c = _case(run, "debug_features")
    v = c["values"]
    for tname, t in (("activation", c["x"]), ("weight", c["w"]), ("gradient", c["dy"])):
        t2 = t.reshape(-1, t.shape[-1])
        for fmt in ("mxfp8", "nvfp4"):
            q = quant.quantize(t2, fmt, axis=-1).double()
            sqnr = 10 * math.log10(float((t2.double() ** 2).sum() / ((t2.double() - q) ** 2).sum()))
            assert v[f"{drive.DEBUG_LAYER}_{tname}_{fmt}_sqnr_db"] == pytest.approx(
                sqnr, abs=sqnr_db_bound(t2.numel()))
    # the layer itself still computes in high precision: an unquantized float32 GEMM
    _close(c["dx"], c["dy"] @ c["w"],
           2 * gamma(drive.OUT) * (c["dy"].abs() @ c["w"].abs()).double() * (1 + gamma(drive.OUT)))


def test_debug_api_with_the_custom_recipe_is_refused_in_one_line(run):
    """TE's debug path hands debug-wrapped custom tensors to its native cuBLAS GEMM (which
    refuses them): the factory refuses first, in one line, before any GEMM."""
    err = run["debug_with_custom_recipe"].get("error", "")
    assert err.startswith("FactoryError: ") and "debug API" in err and "\n" not in err
