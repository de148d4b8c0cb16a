"""What lowp-attribute writes: the JSON, the report table, the figure (one fact, one place)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from . import ablations as ab
from . import stats
from .attribute import Attribution, Measured

#: a share closed below this (or not above noise) is "closes little"
LITTLE = 0.2


def _num(x: float, nd: int = 4) -> Optional[float]:
    return round(x, nd) if isinstance(x, (int, float)) and math.isfinite(x) else None


def verdict(res: Attribution, m: Measured) -> str:
    c = res.closure(m)
    if not c.significant:
        return "within noise"
    if c.share < 0:
        return "widens the gap"
    if c.share >= res.target:
        return f"closes >= {res.target:.0%}"
    return "closes little" if c.share < LITTLE else "closes part"


def plan_summary(res: Attribution) -> Optional[dict]:
    if res.plan_atoms is None:
        return None
    from quant.precision_plan import load_plan

    m = next((a for a in res.ablations if a.atoms == res.plan_atoms), None)
    gap_left = stats.summarize(stats.paired(m.losses, res.ref.losses)) if m else None
    out: dict[str, Any] = {
        "file": res.plan_path,
        "keeps_high_precision": ab.Ablation("", res.plan_atoms).describe(res.shape),
        "high_precision_flops_share": _num(ab.cost(res.plan_atoms, res.shape)),
        "rules": load_plan(res.plan_path).to_dict() if res.plan_path else None,
    }
    if m is not None:
        c = res.closure(m)
        out.update(gap_closed=_num(c.share), gap_closed_std=_num(c.share_std),
                   gap={"mean": _num(gap_left.mean), "std": _num(gap_left.std)})
    if res.verify is not None and res.verify_ref is not None:
        v = stats.summarize(stats.paired(res.verify.losses, res.verify_ref.losses))
        out["verified"] = {"seeds": res.verify_seeds, "gap": {"mean": _num(v.mean),
                                                              "std": _num(v.std)},
                           "within_noise": bool(gap_left is not None
                                                and stats.within_noise(v, gap_left))}
    return out


def to_json(res: Attribution) -> dict:
    g = res.gap
    abl = []
    for m in res.ablations if res.significant else []:
        c = res.closure(m)
        abl.append({"name": m.name,
                    "high_precision": ab.Ablation(m.name, m.atoms).describe(res.shape),
                    "gap_closed": _num(c.share), "gap_closed_std": _num(c.share_std),
                    "significant": c.significant,
                    "high_precision_flops_share": _num(ab.cost(m.atoms, res.shape)),
                    "losses": {str(k): _num(v) for k, v in sorted(m.losses.items())}})
    return {"format": res.fmt, "reference": res.reference, "steps": res.steps,
            "seeds": res.seeds, "gap": {"mean": _num(g.mean), "std": _num(g.std), "n": g.n},
            "significant": res.significant,
            "losses": {"reference": {str(k): _num(v) for k, v in sorted(res.ref.losses.items())},
                       "format": {str(k): _num(v) for k, v in sorted(res.low.losses.items())}},
            "ablations": abl, "plan": plan_summary(res) if res.significant else None,
            "seconds": _num(res.seconds, 1), "workers": res.workers,
            "seconds_per_run": _num(sum(res.run_seconds) / len(res.run_seconds), 2)
            if res.run_seconds else None}


def table(res: Attribution) -> str:
    """The report: the gap, then one row per ablation, then the plan."""
    g = res.gap
    lines = [f"lowp-attribute: {res.fmt} against {res.reference}, {res.steps} steps, "
             f"{len(res.seeds)} seeds {res.seeds}",
             f"final loss (mean of the last steps): reference {_mean(res.ref):.4f}, "
             f"{res.fmt} {_mean(res.low):.4f}",
             f"gap {g.mean:+.4f} +- {g.std:.4f} nats (seed std; 95% t-test "
             f"{'significant' if res.significant else 'NOT significant'})"]
    if not res.significant:
        lines.append(f"no significant gap: {res.fmt} trains like {res.reference} within seed "
                     "noise here; nothing to attribute (more --seeds or --steps resolve "
                     "smaller gaps)")
        return "\n".join(lines)
    w = max(len(m.name) for m in res.ablations)
    lines += ["", f"{'kept in ' + res.reference:<{w}}  {'closes':>7}  {'+-':>6}  "
                  f"{'FLOPs':>6}  verdict",
              f"{'-' * w}  {'-' * 7}  {'-' * 6}  {'-' * 6}  {'-' * 14}"]
    for m in res.ablations:
        c = res.closure(m)
        lines.append(f"{m.name:<{w}}  {c.share:>7.0%}  {c.share_std:>6.0%}  "
                     f"{ab.cost(m.atoms, res.shape):>6.1%}  {verdict(res, m)}")
    p = plan_summary(res)
    if p:
        lines += ["", f"plan: keep {ab.name_of(res.plan_atoms, res.shape)} in {res.reference} "
                      f"({p['high_precision_flops_share']:.1%} of GEMM FLOPs) -> {p['file']}"]
        if "gap" in p:
            lines.append(f"  closes {p['gap_closed']:.0%} +- {p['gap_closed_std']:.0%}; gap "
                         f"left {p['gap']['mean']:+.4f} +- {p['gap']['std']:.4f} nats")
        if "verified" in p:
            v = p["verified"]
            lines.append(f"  fed back through CUSTOM_QUANT_PLAN on seeds {v['seeds']}: gap "
                         f"{v['gap']['mean']:+.4f} +- {v['gap']['std']:.4f} nats "
                         f"({'reproduces it within noise' if v['within_noise'] else 'DIFFERS beyond noise'})")
    return "\n".join(lines)


def _mean(m: Measured) -> float:
    return stats.summarize(list(m.losses.values())).mean


def figure(res: Attribution, path: Path) -> Optional[Path]:
    """Bar chart: share of the gap each ablation closes, with the seed spread as error bars."""
    if not res.significant or not res.ablations:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m.name for m in res.ablations]
    cl = [res.closure(m) for m in res.ablations]
    shares = [100 * (c.share if math.isfinite(c.share) else 0) for c in cl]
    errs = [100 * (c.share_std if math.isfinite(c.share_std) else 0) for c in cl]
    colors = ["tab:green" if m.atoms == res.plan_atoms else
              ("tab:gray" if not c.significant else "tab:orange" if c.share < 0 else "tab:blue")
              for m, c in zip(res.ablations, cl)]
    fig, axis = plt.subplots(figsize=(9, 0.42 * len(names) + 1.8))
    y = range(len(names))
    axis.barh(list(y), shares, xerr=errs, color=colors, capsize=3)
    axis.set_yticks(list(y), names, fontsize=8)
    axis.invert_yaxis()
    axis.axvline(100 * res.target, color="tab:red", ls="--", lw=1,
                 label=f"target {res.target:.0%}")
    axis.axvline(0, color="black", lw=0.8)
    axis.set_xlabel(f"share of the {res.fmt} - {res.reference} loss gap closed (%), "
                    f"error bars: seed std ({len(res.seeds)} seeds)")
    g = res.gap
    axis.set_title(f"Which part of the model costs the loss: {res.fmt} vs {res.reference}\n"
                   f"gap {g.mean:+.3f} +- {g.std:.3f} nats after {res.steps} steps",
                   fontsize=10)
    from matplotlib.patches import Patch

    handles, _ = axis.get_legend_handles_labels()
    handles += [Patch(color=c, label=t) for c, t in (
        ("tab:green", "the plan"), ("tab:blue", "closes (above noise)"),
        ("tab:orange", "widens (above noise)"), ("tab:gray", "within noise"))]
    axis.legend(handles=handles, loc="best", fontsize=8)
    fig.tight_layout()
    from lowp_common import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path
