"""Fingerprints of every public numeric entry point of ``quant`` (a refactor's bit-identity check).

Run it before and after a change to the numerics: every output (quantize for every format,
rounding, scale mode and backend; the analysis; the what-if numbers; the scale sweep; every
recipe and Transformer Engine arithmetic step; capture's statistics and what-if metadata) is
reduced to a sha256 of its exact bits, so two runs match only when nothing changed by one bit.
The inputs hold normals, float32 and format subnormals, exact ties of every format grid,
NaN, +-Inf, huge values and zeros, from fixed seeds.

    PYTHONPATH=. python bench/golden_numerics.py --out before.json
    PYTHONPATH=. python bench/golden_numerics.py --out after.json --compare before.json

The Triton part runs the kernels in Triton's CPU interpreter (a child process with
TRITON_INTERPRET=1, which must be set before the kernels load); ``--no-triton`` skips it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

import torch

from lowp_common import CommandParser


def _digest_tensor(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    shape = tuple(t.shape)
    t = t.reshape(-1)
    raw = t.view(torch.uint8) if t.dtype.is_floating_point else t
    h = hashlib.sha256(f"{t.dtype}{shape}".encode())
    h.update(raw.numpy().tobytes())
    return h.hexdigest()


def _plain(v):
    if isinstance(v, torch.Tensor):
        return {"tensor": _digest_tensor(v)}
    if isinstance(v, float):
        return repr(v)          # exact, NaN / Inf included
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _digest(v) -> str:
    if isinstance(v, torch.Tensor):
        return _digest_tensor(v)
    return hashlib.sha256(json.dumps(_plain(v), sort_keys=True).encode()).hexdigest()


def inputs() -> dict[str, torch.Tensor]:
    """Float32 [8, 96] tensors (a multiple of 32 and 16, and not of 128) plus odd shapes."""
    g = torch.Generator().manual_seed(1234)
    base = torch.randn(8, 96, generator=g)
    wide = base * torch.exp2(torch.randint(-40, 40, (8, 96), generator=g).float())
    special = wide.clone().reshape(-1)
    vals = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e38, -3e38, 1e-40, -1e-45,
            2.0 ** -149, 2.0 ** -126, 448.0, 464.0, 480.0, 6.0, 5.0, 0.25, 0.75, 57344.0,
            61440.0, 2.0 ** 15, 2.0 ** -22, 2.0 ** -23, 1.5 * 2.0 ** -9, 2.5 * 2.0 ** -7]
    idx = torch.randperm(special.numel(), generator=g)[:len(vals) * 3]
    special[idx] = torch.tensor(vals * 3)
    special = special.reshape(8, 96)
    # exact ties: midpoints between neighbours of several grids, times powers of two
    ties = (torch.randint(0, 64, (8, 96), generator=g).float() + 0.5) * torch.exp2(
        torch.randint(-12, 6, (8, 96), generator=g).float())
    tiny = torch.randn(8, 96, generator=g) * 1e-39          # float32 subnormals
    blocknan = base.clone()
    blocknan[1, 40] = float("nan")
    blocknan[3, 70] = float("inf")
    return {"normal": base, "wide": wide, "special": special, "ties": ties, "tiny": tiny,
            "blocknan": blocknan, "odd": torch.randn(5, 37, generator=g) * 3,
            "scalar": torch.tensor(3.3), "zeros": torch.zeros(4, 32)}


def _roundings(spec) -> list[str]:
    from quant.formats import HIF8_ROUNDING_MODES, ROUNDING_MODES
    return list(HIF8_ROUNDING_MODES if spec.tapered else ROUNDING_MODES)


def quantize_cases(backend: str, light: bool = False):
    """(key, output) of quantize over formats x roundings x scale modes x saturate x axes."""
    from quant import FORMATS, SCALE_MODES, quantize
    from quant.formats import SCALING_MX
    xs = inputs()
    if light:
        xs = {k: xs[k] for k in ("special", "ties", "odd", "blocknan")}
    for fname, spec in FORMATS.items():
        roundings = _roundings(spec) if not light else [spec.default_rounding, "stochastic"]
        modes = SCALE_MODES if spec.scaling == SCALING_MX else ("floor",)
        for xname, x in xs.items():
            for rounding in roundings:
                for mode in modes:
                    for saturate in (True, False):
                        if light and not saturate and rounding == "stochastic":
                            continue
                        for axis in ((-1, 0) if x.dim() == 2 else (-1,)):
                            for dtype in ((torch.float32, torch.bfloat16) if not light
                                          or axis == -1 else (torch.float32,)):
                                g = torch.Generator().manual_seed(7)
                                key = (f"quantize/{backend}/{fname}/{xname}/{rounding}/{mode}/"
                                       f"sat{int(saturate)}/ax{axis}/{dtype}")
                                try:
                                    y = quantize(x.to(dtype), fname, rounding=rounding,
                                                 scale_mode=mode, saturate=saturate, axis=axis,
                                                 generator=g, backend=backend)
                                except Exception as exc:
                                    y = f"error: {exc}"
                                yield key, y
                if light:
                    continue
        if light:
            continue
        # block sizes other than the default
        if spec.is_block:
            for b in (8, 64):
                yield (f"quantize/{backend}/{fname}/block{b}",
                       quantize(xs["special"], fname, block_size=b, backend=backend))


def analysis_cases():
    from quant import FORMATS, SCALE_MODES, analyze_quantization
    from quant.formats import SCALING_MX
    for fname, spec in FORMATS.items():
        for xname, x in inputs().items():
            for mode in (SCALE_MODES if spec.scaling == SCALING_MX else ("floor",)):
                for rounding in (None, "toward_zero"):
                    for axis in ((-1, 0) if x.dim() == 2 else (-1,)):
                        an = analyze_quantization(x, fname, scale_mode=mode, rounding=rounding,
                                                  axis=axis)
                        yield (f"analysis/{fname}/{xname}/{mode}/{rounding}/ax{axis}",
                               an.to_dict(include_blocks=True))


def whatif_cases():
    from quant import FORMATS
    from quant.formats import WHATIF_FORMATS
    from quant.whatif import whatif, whatif_set
    from quant.whatif_onepass import whatif_onepass
    for xname, x in inputs().items():
        for axis in ((-1, 0) if x.dim() == 2 else (-1,)):
            for fname in FORMATS:
                try:
                    out = whatif(x, fname, axis)
                except Exception as exc:
                    out = f"error: {exc}"
                yield f"whatif/{fname}/{xname}/ax{axis}", out
            yield f"whatif_set/{xname}/ax{axis}", whatif_set(x, list(FORMATS), axis)
            yield f"whatif_onepass/{xname}/ax{axis}", whatif_onepass(x, list(WHATIF_FORMATS)
                                                                     + ["fp8_e5m2", "mxint8"],
                                                                     axis)


def sweep_cases():
    from quant import scaling_sweep as sw
    xs = inputs()
    for fmt in sw.ELEMENT_FORMATS:
        for xname in ("normal", "wide", "special", "tiny", "zeros", "ties"):
            try:
                out = sw.run_sweep(xs[xname], fmt, num_levels=9, workers=1).to_dict()
            except Exception as exc:
                out = f"error: {type(exc).__name__}: {exc}"
            yield f"sweep/{fmt}/{xname}", out
        r = sw.run_sweep(xs["wide"], fmt, num_levels=7, min_scale_exp=-3.5, max_scale_exp=4.25,
                         workers=2, chunk=256)
        yield f"sweep/{fmt}/fractional", r.to_dict()
        grid = sw.get_element_grid(fmt)
        f = sw.scale_factors([-3, 0, 2.5, 7])
        yield f"cast_levels/{fmt}", sw.cast_levels(xs["ties"].reshape(-1), f, grid)
        yield f"cast_elements/{fmt}", sw.cast_elements(xs["special"], grid)


def recipe_cases():
    from quant import recipes
    from quant import role_quantizers as rq
    from quant.family_mx import e8m0_round_up
    from quant.family_tensor import TENSOR
    from quant.quantizer import Quantizer
    g0 = torch.Generator().manual_seed(99)
    x = torch.randn(128, 128, generator=g0) * torch.exp2(
        torch.randint(-20, 20, (128, 128), generator=g0).float())
    x[3, 5], x[7, 9], x[100, 1] = float("nan"), float("inf"), 0.0
    x[50, 50:60] = torch.tensor([448.0, 464.0, 6.0, 5.0, 1e-40, -1e38, 0.75, 2.0 ** -9,
                                 57344.0, 61440.0])
    for name in recipes.RECIPES:
        for tensor, gemm in recipes.ROLES:
            for dtype in (torch.float32, torch.bfloat16):
                g = torch.Generator().manual_seed(5)
                state = recipes.DelayedScalingState(history_len=2)
                key = f"recipe/{name}/{tensor}/{gemm}/{dtype}"
                try:
                    y1 = recipes.quantize_operand(x.to(dtype), name, tensor, gemm, generator=g,
                                                  state=state, key="k")
                    state.update()
                    y2 = recipes.quantize_operand(x.to(dtype) * 3, name, tensor, gemm,
                                                  generator=g, state=state, key="k")
                    yield key, [y1, y2]
                except Exception as exc:
                    yield key, f"error: {exc}"
    v = x.reshape(-1)
    for el in ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1"):     # TE's element casts: our Quantizer's
        yield f"te/cast/{el}", Quantizer.of(el)(v)
    yield "te/e8m0", e8m0_round_up(v.abs())
    yield "te/mxfp8", rq.MXFP8Scaling(Quantizer.of("fp8_e4m3"), (1, 32)).blocks(
        x.reshape(128, 4, 32))
    yield "te/nvfp4", rq.NVFP4Scaling(Quantizer.of("fp4_e2m1"), (16, 16)).tiles(
        x, rq.amax_ignoring_nan(x))
    for pow2 in (False, True):
        yield f"te/scale/{pow2}", TENSOR.te_scale(
            rq.amax_ignoring_nan(x.reshape(16, -1), 1), 448.0, pow2)
    yield "te/rht", rq.rht(x)


def capture_cases():
    from quant.analysis import cast_limits
    from quant.formats import WHATIF_FORMATS
    from tensor_capture import stats
    from tensor_capture import whatif as cw
    xs = inputs()
    ranges = [cast_limits(n) for n in ("fp8_e4m3", "fp8_e5m2", "hifp8", "bf16")]
    for xname, x in xs.items():
        # the torch host path: the C kernel's mean and std are float64 sums in another order
        # (tests/test_capture_stats_vector_c.py holds it to this path: other slots equal)
        yield f"capture/stats/{xname}", stats.decode(stats.compute(x, ranges, c_kernel=False),
                                                     ranges)
        p = cw.plan(tuple(WHATIF_FORMATS), x, "hp", 0 if x.dim() == 2 else None)
        if p is not None:
            yield f"capture/whatif/{xname}", cw.compute(x, p, x.numel())


SECTIONS = {"quantize": lambda: quantize_cases("torch"), "analysis": analysis_cases,
            "whatif": whatif_cases, "sweep": sweep_cases, "recipes": recipe_cases,
            "capture": capture_cases}


def run_sections(names) -> dict[str, str]:
    out = {}
    for name in names:
        for key, value in SECTIONS[name]():
            if isinstance(value, str):
                out[key] = value[:300]
            else:
                out[key] = _digest(value)
    return out


def run_triton() -> dict[str, str]:
    """The Triton backend's outputs, in a child process running Triton's interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1", QUANT_COMPILE="0")
    res = subprocess.run([sys.executable, __file__, "--triton-child"], env=env,
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"triton child failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout)


def main() -> None:
    ap = CommandParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the fingerprints (JSON) here")
    ap.add_argument("--compare", help="a fingerprint file to compare with (exit 1 on a mismatch)")
    ap.add_argument("--no-triton", action="store_true", help="skip the Triton interpreter part")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated sections")
    ap.add_argument("--triton-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.triton_child:
        out = {}
        for key, value in quantize_cases("triton", light=True):
            out[key] = value[:300] if isinstance(value, str) else _digest(value)
        print(json.dumps(out))
        return
    os.environ.setdefault("QUANT_COMPILE", "0")
    out = run_sections([s for s in args.sections.split(",") if s])
    if not args.no_triton:
        out.update(run_triton())
    print(f"{len(out)} fingerprints; summary sha256 "
          f"{hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()}")
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump(out, f, indent=0, sort_keys=True)
        os.replace(args.out + ".tmp", args.out)
    if args.compare:
        with open(args.compare) as f:
            ref = json.load(f)
        diff = sorted(k for k in set(ref) | set(out) if ref.get(k) != out.get(k))
        for k in diff[:40]:
            print(f"MISMATCH {k}: {ref.get(k)} -> {out.get(k)}")
        print(f"{len(diff)} mismatches of {len(set(ref) | set(out))}")
        sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
