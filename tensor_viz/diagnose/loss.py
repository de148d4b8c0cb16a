"""The loss kinds of ``lowp-diagnose``: the loss read (the training log given with ``--loss``:
Megatron-LM's or llama-train's lines, or a TensorBoard folder; else the losses a flight
recorder wrote beside its summaries), spikes (``loss_spike``) and the loss by level
(``loss_divergence``: a divergence, or a plateau against the run's own early minimum), each
tied to the finding that precedes it. docs/diagnose.md states the rules; the numbers are here,
once.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path

from lowp_common import UserError
from tensor_viz.diagnose.rules import HIGH, LOW, MEDIUM, RunFinding, _label

#: picks the finding a loss finding follows from the candidates (None: there are none)
Cause = Callable[[list[RunFinding]], "RunFinding | None"]

#: loss spike: above mean + LOSS_SIGMAS x std of the previous LOSS_WINDOW iterations (or
#: non-finite); a finding of another kind that starts at most LOSS_LEAD iterations before the
#: spike is named as its likely cause
LOSS_WINDOW, LOSS_SIGMAS, LOSS_LEAD = 100, 6.0, 50
#: loss divergence by level: above DIVERGE_FACTOR x the lowest of the first LOSS_EARLY losses
#: or x ln(vocabulary); a plateau: judged with at least 4 x LOSS_FLAT losses
DIVERGE_FACTOR, LOSS_EARLY, LOSS_FLAT = 1.5, 5, 4
#: a plateau: the losses cut into PLATEAU_PARTS consecutive parts; the median of the last is not
#: below the lowest median of the first half's parts (the run's early minimum) by more than
#: PLATEAU_Z standard errors of the two medians
PLATEAU_PARTS, PLATEAU_Z = 8, 2.0
#: the standard deviation of Gaussian noise per median absolute deviation, and the standard
#: error of a median of n draws per sigma / sqrt(n) (sqrt(pi / 2))
_SIGMA_PER_MAD, _MEDIAN_SE = 1.4826, math.sqrt(math.pi / 2)
#: where the losses came from (a finding's ``source``)
LOG_SOURCE, RECORDER_SOURCE = "the training log / TensorBoard", "the flight recorder's losses"
_LOSS_LINE = re.compile(r"iter(?:ation)?\s*[:=]?\s*(\d+).*?\b(?:lm[ _]loss|loss)\s*[:=]?\s*"
                        r"([-+0-9.eE]+|nan|inf|-inf)", re.IGNORECASE)

def read_losses(path: str | os.PathLike[str]) -> list[tuple[int, float]]:
    """(iteration, loss) from a training log (lines naming an iteration and a loss) or a
    TensorBoard folder (the first scalar tag with "loss" in its name)."""
    p = Path(path)
    if p.is_dir():
        try:
            from tensorboard.backend.event_processing.event_accumulator import (
                EventAccumulator,
            )
        except ImportError:
            raise UserError(f"--loss {p}: reading TensorBoard needs the tensorboard package; "
                            "pip install tensorboard, or pass the training log") from None
        acc = EventAccumulator(str(p), size_guidance={"scalars": 0})
        acc.Reload()
        tags = [t for t in acc.Tags().get("scalars", []) if "loss" in t.lower()]
        if not tags:
            raise UserError(f"--loss {p}: no scalar with 'loss' in its name in these events")
        return [(int(e.step), float(e.value)) for e in acc.Scalars(tags[0])]
    try:
        text = p.read_text(errors="replace")
    except OSError as exc:
        raise UserError(f"--loss {p}: cannot read it ({exc.strerror})") from None
    out = [(int(m.group(1)), float(m.group(2))) for m in map(_LOSS_LINE.search, text.splitlines())
           if m]
    if not out:
        raise UserError(f"--loss {p}: no line with an iteration and a loss in it")
    return out


def spikes(losses: list[tuple[int, float]], others: list[RunFinding], first: Cause,
           source: str = LOG_SOURCE) -> list[RunFinding]:
    """The loss above mean + LOSS_SIGMAS x std of the previous LOSS_WINDOW values (after 8), or
    non-finite; each names the finding it follows (``first``: the top-ranked of a list)."""
    out = []
    seen: list[float] = []
    for it, v in sorted(losses):
        window = seen[-LOSS_WINDOW:]
        spike = not math.isfinite(v)
        if not spike and len(window) >= 8:
            mean = sum(window) / len(window)
            std = math.sqrt(sum((x - mean) ** 2 for x in window) / len(window))
            spike = v > mean + LOSS_SIGMAS * max(std, 1e-12)
        if spike:
            near = [f for f in others if f.onset is not None and it - LOSS_LEAD <= f.onset <= it]
            cause = first(near)
            out.append(RunFinding(
                "loss_spike", HIGH if not math.isfinite(v) else MEDIUM,
                f"Loss spike at iteration {it} ({v:.4g})"
                + (f"; it follows {cause.kind} at iteration {cause.onset} "
                   f"({_label(cause.where)})" if cause else
                   "; no captured finding precedes it") + ".",
                {"iteration": it}, {"loss": v, "window": len(window),
                                    "follows": cause.to_dict() if cause else None},
                source, "Start from the finding it follows."
                if cause else "Capture the iterations before it (stats_only: true).",
                onset=it))
            if len(out) >= 10:
                break
        if math.isfinite(v):
            seen.append(v)
    return out


def vocab_size(con, src: str) -> int | None:
    """The vocabulary, from the output layer's captured logits (their last axis: under tensor
    parallelism one shard, so ln of it is lower by ln(tp)); None without an output layer."""
    row = con.execute(f"""SELECT max(last_dim) FROM {src}
        WHERE module_path LIKE '%output_layer' AND operation = 'forward'
          AND tensor_name = 'output'""").fetchone()
    return int(row[0]) if row and row[0] else None


def _median(values: list[float]) -> float:
    v = sorted(values)
    m = len(v) // 2
    return v[m] if len(v) % 2 else (v[m - 1] + v[m]) / 2


def plateau(seq: list[tuple[int, float]]) -> dict | None:
    """The plateau of a finite loss sequence (sorted by iteration), or None: its last part's
    median is not below the run's early minimum (the lowest median of the first half's parts)
    by more than PLATEAU_Z standard errors. The loss's noise is estimated from the differences
    of successive losses over the second half (robust to a trend and to spikes); a run whose
    loss keeps falling is below its early minimum by many standard errors."""
    n = len(seq)
    if n < 4 * LOSS_FLAT:
        return None
    bounds = [round(k * n / PLATEAU_PARTS) for k in range(PLATEAU_PARTS + 1)]
    parts = [seq[bounds[k]:bounds[k + 1]] for k in range(PLATEAU_PARTS)]
    medians = [_median([v for _, v in part]) for part in parts]
    half = [v for _, v in seq[n // 2:]]
    sigma = _SIGMA_PER_MAD * _median([abs(b - a) for a, b in zip(half, half[1:])]) / math.sqrt(2)
    j = min(range(PLATEAU_PARTS // 2), key=lambda k: medians[k])
    se = [_MEDIAN_SE * sigma / math.sqrt(len(parts[k])) for k in (j, -1)]
    tolerance = PLATEAU_Z * math.hypot(*se)
    if medians[-1] < medians[j] - tolerance:
        return None
    return {"early_median": medians[j], "early_iterations": [parts[j][0][0], parts[j][-1][0]],
            "last_median": medians[-1], "last_iterations": [parts[-1][0][0], parts[-1][-1][0]],
            "noise_std": sigma, "tolerance": tolerance,
            "since": next(it for it, v in seq if v <= medians[j])}


def _diverged(seq: list[tuple[int, float]], ln_v: float | None,
              vocab: int | None) -> tuple[tuple[int, float, float] | None, str]:
    """((iteration, loss, early minimum), the rule) of the first loss above its level that holds:
    above DIVERGE_FACTOR x the lowest of the values before it (at most LOSS_EARLY of them) or
    DIVERGE_FACTOR x ln(vocabulary), with most losses from it on above that line too (a jump
    the run recovers from within a few iterations is a spike, not a level); (None, "") else."""
    values = [v for _, v in seq]
    early_all = min(values[:LOSS_EARLY])
    lines = [DIVERGE_FACTOR * early_all] + ([DIVERGE_FACTOR * ln_v] if ln_v is not None else [])
    steady = min(lines)                       # the line from LOSS_EARLY on: counted once, suffixes
    above = [0] * (len(values) + 1)
    for k in range(len(values) - 1, -1, -1):
        above[k] = above[k + 1] + (values[k] > steady)
    for k, (it, v) in enumerate(seq):
        early = min(values[:max(min(k, LOSS_EARLY), 1)])
        by_early = k > 0 and v > DIVERGE_FACTOR * early
        by_vocab = ln_v is not None and v > DIVERGE_FACTOR * ln_v
        if not (by_early or by_vocab):
            continue
        line = min(([DIVERGE_FACTOR * early] if k else []) +
                   ([DIVERGE_FACTOR * ln_v] if ln_v is not None else []))
        held = (above[k] if k >= LOSS_EARLY else sum(x > line for x in values[k:]))
        if 2 * held > len(values) - k:
            return (it, v, early), (f"above {DIVERGE_FACTOR:g} x its early minimum {early:.4g}"
                                    if by_early else f"above {DIVERGE_FACTOR:g} x ln(vocabulary "
                                    f"{vocab}) = {DIVERGE_FACTOR * ln_v:.4g}")
    return None, ""


def divergence(losses: list[tuple[int, float]], others: list[RunFinding], vocab: int | None,
               first: Cause, source: str = LOG_SOURCE) -> list[RunFinding]:
    """The loss by level (docs/diagnose.md): from the first iteration whose loss is above
    DIVERGE_FACTOR x the lowest of its first LOSS_EARLY values or above DIVERGE_FACTOR x
    ln(vocabulary) (HIGH); else, with 4 x LOSS_FLAT values or more, a :func:`plateau` (MEDIUM,
    from the first iteration at its level). Non-finite losses are loss_spike's."""
    seq = [(it, v) for it, v in sorted(losses) if math.isfinite(v)]
    if len(seq) < 2:
        return []
    ln_v = math.log(vocab) if vocab and vocab > 1 else None
    hit, rule = _diverged(seq, ln_v, vocab)
    flat = plateau(seq) if hit is None else None
    if hit is None and flat is None:
        return []
    if hit is None:
        it = flat["since"]
        v, early = dict(seq)[it], min(x for _, x in seq[:LOSS_EARLY])
        rule = (f"a plateau: the median of iterations {flat['last_iterations'][0]}.."
                f"{flat['last_iterations'][1]} ({flat['last_median']:.4g}) is not below the "
                f"run's early minimum ({flat['early_median']:.4g}, the median of iterations "
                f"{flat['early_iterations'][0]}..{flat['early_iterations'][1]}) by more than "
                f"{PLATEAU_Z:g} standard errors ({flat['tolerance']:.2g})")
    else:
        it, v, early = hit
    near = [f for f in others if f.onset is not None and it - LOSS_LEAD <= f.onset <= it
            and f.severity != LOW]
    cause = first(near)
    after = [x for i, x in seq if i >= it]
    verb = "diverges" if hit is not None else "stops decreasing"
    summary = (f"The loss {verb} from iteration {it}: {v:.4g}, {rule}; it stays "
               f"{min(after):.4g}..{max(after):.4g} to iteration {seq[-1][0]}"
               + (f"; it follows {cause.kind} at iteration {cause.onset} "
                  f"({_label(cause.where)})" if cause else
                  "; no captured finding precedes it") + ".")
    return [RunFinding(
        "loss_divergence", MEDIUM if hit is None else HIGH, summary, {"iteration": it},
        {"loss": v, "rule": rule, "early_minimum": early, "ln_vocabulary": ln_v,
         "vocabulary": vocab, "max_after": max(after), "last": seq[-1][1],
         "not_decreasing": flat is not None, "plateau": flat,
         "follows": cause.to_dict() if cause else None},
        source,
        (f"Start from the finding it follows ({cause.kind}: {cause.action})" if cause else
         "Lower the learning rate or clip the gradients; capture the iterations before it "
         "(stats_only: true)."), onset=it)]
