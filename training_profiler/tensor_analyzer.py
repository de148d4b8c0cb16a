"""P2: ``analyze_tensor`` — why would this tensor suffer in low precision?

The classic case: one channel of a tensor lives at 1e3, another at 1e0; in a bf16 reduction the
small one is below half an ulp of the big one and vanishes ("big numbers eat small ones"). The
report measures exactly that (per-channel statistics and the ratio between channels), plus the
two things that decide whether a block-scaled format can hold the tensor: the dynamic range
inside blocks of 32, and the overflow / flush-to-zero fractions per quant/ format.

    analyze-tensor capture/*.pt --format text
"""
from __future__ import annotations

import math
import os
import sys
from typing import Any, Sequence

import torch

import quant
from lowp_common import EXIT_USER_ERROR, CommandParser, UserError, cli_entry, json_dumps
from quant.formats import FORMATS, SCALING_MX, SURVEY_FORMATS
from quant.vocabulary import FormatNameError, check_format_name
from training_profiler.tensor_verdict import HIGH_RATIO, MEDIUM_RATIO, judge  # noqa: F401

DEFAULT_FORMATS = SURVEY_FORMATS
#: the MX formats whose element span block_dynamic_range compares with (from quant.FORMATS)
_MX_SPANS = tuple(n for n in SURVEY_FORMATS if FORMATS[n].scaling == SCALING_MX)


def _channels_last(x: torch.Tensor, channel_axis: int) -> torch.Tensor:
    """[rows, channels] view of x with ``channel_axis`` as the column axis."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.movedim(channel_axis, -1).reshape(-1, x.shape[channel_axis])


def block_dynamic_range(x: torch.Tensor, block_size: int = 32,
                        mx_formats: Sequence[str] = _MX_SPANS) -> dict[str, Any]:
    """log2(absmax / smallest nonzero |x|) per block of ``block_size`` along the last axis.

    That is how many binades a shared-scale block must span; an MX element format keeps about
    log2(max_normal / min_subnormal) of them, the rest saturates or flushes to zero. The
    fraction of blocks beyond that is given for each of ``mx_formats``.
    """
    rows = x.float().reshape(-1, x.shape[-1]) if x.dim() else x.float().reshape(1, 1)
    n = rows.shape[-1]
    pad = (-n) % block_size
    a = torch.nn.functional.pad(rows.abs(), (0, pad)).reshape(-1, block_size)
    a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype))
    amax = a.amax(dim=1)
    amin = torch.where(a > 0, a, torch.full((), math.inf)).amin(dim=1)
    live = amax > 0
    bits = torch.log2(amax[live] / amin[live]) if live.any() else torch.zeros(1)
    out = {"block_size": block_size, "blocks": int(a.shape[0]), "all_zero_blocks": int((~live).sum()),
           "median_bits": float(bits.median()), "p99_bits": float(torch.quantile(bits.double(), 0.99)),
           "max_bits": float(bits.max())}
    for name in mx_formats:
        spec = quant.get_format(name)
        span = math.log2(spec.max_normal / spec.min_subnormal)
        out[f"fraction_beyond_{name}"] = float((bits > span).double().mean())
    return out


def format_risks(x: torch.Tensor, formats: Sequence[str] = DEFAULT_FORMATS) -> dict[str, dict[str, float]]:
    """Overflow / underflow / flush-to-zero fractions of x in each format and its SQNR against the
    format's Gaussian baseline (quant.format_loss), via quant/."""
    from quant.format_loss import judge as format_loss

    out = {}
    for name in formats:
        xf = x.float()
        q = quant.quantize(xf, name)
        a = quant.analyze_quantization(xf, name, quantized=q, summaries=False)
        loss = format_loss(xf, name, -1, quantized=q)
        out[name] = {"overflow_ratio": float(a.overflow_ratio), "underflow_ratio": float(a.underflow_ratio),
                     "flush_to_zero_ratio": float(a.flush_to_zero_ratio),
                     "sqnr_db": loss.sqnr_db, "baseline_db": loss.baseline_db,
                     "deficit_db": loss.deficit_db}
    return out


def analyze_tensor(tensor: torch.Tensor, name: str = "tensor", *, channel_axis: int = -1,
                   block_size: int = 32, formats: Sequence[str] | None = DEFAULT_FORMATS) -> dict[str, Any]:
    """The original analyzer's report (shape, per-dimension min/max/mean, dim_ratio, risk_level, suggestion)
    plus per-channel absmax, block-wise dynamic range and per-format overflow/flush fractions.

    "Dimension" means an index along ``channel_axis`` (the last axis by default: the features
    of a [tokens, features] activation, the columns of a [N, 2] box-coordinate tensor).
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise ValueError(f"{name}: analyze_tensor needs a floating-point tensor, got "
                         f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
    if tensor.numel() == 0:
        raise ValueError(f"{name}: the tensor is empty (shape {tuple(tensor.shape)})")
    x = tensor.detach().float().cpu()
    finite = torch.isfinite(x)
    nan_count, inf_count = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
    cols = _channels_last(x, channel_axis)
    cf = torch.where(torch.isfinite(cols), cols, torch.full((), math.nan))
    cmin = torch.where(torch.isnan(cf), torch.full((), math.inf), cf).amin(0)
    cmax = torch.where(torch.isnan(cf), torch.full((), -math.inf), cf).amax(0)
    cmean = cf.nanmean(0)
    cabs = torch.maximum(cmax.abs(), cmin.abs())
    cabs = torch.where(torch.isfinite(cabs), cabs, torch.zeros(()))
    dim_stats = {i: {"min": float(cmin[i]), "max": float(cmax[i]), "mean": float(cmean[i]),
                     "absmax": float(cabs[i])} for i in range(cols.shape[1])}
    nz = cabs[cabs > 0]
    if len(nz) >= 2:
        big, small = int(torch.argmax(cabs)), int(torch.argmin(torch.where(cabs > 0, cabs, torch.full((), math.inf))))
        dim_ratio = float(cabs[big] / cabs[small])
    else:
        big = small = 0
        dim_ratio = 1.0
    report: dict[str, Any] = {
        "name": name, "shape": tuple(tensor.shape), "dtype": str(tensor.dtype), "numel": tensor.numel(),
        "nan_count": nan_count, "inf_count": inf_count, "finite_count": int(finite.sum()),
        "nonzero_finite": int((finite & (x != 0)).sum()),
        "absmax": float(x[finite].abs().max()) if finite.any() else math.nan,
        "dim_stats": dim_stats, "dim_ratio": dim_ratio, "dim_big": big, "dim_small": small,
        "per_channel_absmax": cabs.tolist(),
        "channel_axis": channel_axis,
        "block_dynamic_range": block_dynamic_range(
            x.movedim(channel_axis, -1) if x.dim() else x, block_size,
            [f for f in (formats or ()) if quant.get_format(f).scaling == SCALING_MX]),
    }
    report["formats"] = format_risks(x, formats) if formats else {}
    report.update(judge(report))   # risk_level, reasons, suggestion, ... (tensor_verdict.RULES)
    return report


def format_report(r: dict[str, Any], top: int = 8) -> str:
    """Readable text version of an analyze_tensor report."""
    lines = [f"Tensor: {r['name']}  shape {list(r['shape'])}  dtype {r['dtype']}  "
             f"absmax {r['absmax']:.4g}  NaN {r['nan_count']}  Inf {r['inf_count']}",
             f"Risk: {r['risk_level']}",
             *[f"  {f['level']:<6} {f['reason']}" for f in r["findings"]],
             *[f"  cannot judge: {c}" for c in r["cannot_judge"]],
             f"dim_ratio (largest / smallest channel absmax, axis {r['channel_axis']}): {r['dim_ratio']:.4g}"]
    stats = r["dim_stats"]
    order = sorted(stats, key=lambda i: stats[i]["absmax"], reverse=True)
    shown = order if len(order) <= top else order[: top // 2] + order[-(top // 2):]
    lines.append(f"  {'dim':>6} {'min':>12} {'max':>12} {'mean':>12} {'absmax':>12}")
    for i in shown:
        s = stats[i]
        lines.append(f"  {i:>6} {s['min']:>12.4g} {s['max']:>12.4g} {s['mean']:>12.4g} {s['absmax']:>12.4g}")
    if len(order) > len(shown):
        lines.append(f"  ... {len(order) - len(shown)} more dimensions (largest and smallest shown)")
    b = r["block_dynamic_range"]
    lines.append(f"Block dynamic range (blocks of {b['block_size']}, binades): median {b['median_bits']:.2f}, "
                 f"p99 {b['p99_bits']:.2f}, max {b['max_bits']:.2f}"
                 + "".join(f", beyond {k[len('fraction_beyond_'):]}: {v:.3g}" for k, v in b.items()
                           if k.startswith("fraction_beyond_")))
    if r["formats"]:
        lines.append(f"  {'format':>12} {'overflow':>10} {'underflow':>10} {'flushed':>10} "
                     f"{'SQNR dB':>8} {'Gaussian':>8}")
        for name, f in r["formats"].items():
            lines.append(f"  {name:>12} {f['overflow_ratio']:>10.3g} {f['underflow_ratio']:>10.3g} "
                         f"{f['flush_to_zero_ratio']:>10.3g} {f['sqnr_db']:>8.1f} "
                         f"{f['baseline_db']:>8.1f}")
    if r["findings"] and r["safe_formats"]:
        lines.append(f"No rule fired for: {', '.join(r['safe_formats'])}")
    lines.append(f"Suggestion: {r['suggestion']}")
    return "\n".join(lines)


@cli_entry("analyze-tensor")
def main(argv: Sequence[str] | None = None) -> int:
    p = CommandParser(prog="analyze-tensor", description="Analyze saved tensor files for "
                      "dimension imbalance and low-precision overflow/underflow risk.")
    p.add_argument("files", nargs="+", help="tensor files written by the capture (or plain torch.save tensors)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                   help="comma-separated quant formats to test (default: %(default)s); '' for none")
    p.add_argument("--channel-axis", type=int, default=-1, help="axis whose indices are the 'dimensions'")
    p.add_argument("--block-size", type=int, default=32)
    args = p.parse_args(argv)
    from tqdm import tqdm

    from tensor_capture.schema import load_tensor_file

    try:
        formats = [check_format_name(f, "--formats", high_precision=False)
                   for f in args.formats.split(",") if f.strip()]
    except FormatNameError as exc:
        raise UserError(str(exc)) from None
    missing = [f for f in args.files if not os.path.isfile(f)]
    if missing:
        raise UserError(f"{missing[0]}: no such file; pass tensor files the capture wrote")
    reports, failed = [], 0
    for path in tqdm(args.files, desc="analyzing", unit="file", disable=len(args.files) < 3, file=sys.stderr):
        try:
            tensor, meta = load_tensor_file(path)
            reports.append(analyze_tensor(tensor, str(path), channel_axis=args.channel_axis,
                                          block_size=args.block_size, formats=formats))
        except (ValueError, IndexError) as exc:
            print(f"analyze-tensor: error: {exc}", file=sys.stderr)
            failed += 1
    if args.format == "json":
        print(json_dumps(reports, indent=2))  # NaN/Inf as "nan"/"inf"
    else:
        print("\n\n".join(format_report(r) for r in reports))
    return EXIT_USER_ERROR if failed else 0     # the files were the problem, not the tool


if __name__ == "__main__":
    sys.exit(main())
