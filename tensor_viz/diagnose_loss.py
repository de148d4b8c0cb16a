"""The loss kinds of ``lowp-diagnose --loss``: the training log read (Megatron-LM's or
llama-train's lines, or a TensorBoard folder), spikes (``loss_spike``) and the loss by level
(``loss_divergence``), each tied to the finding that precedes it. docs/diagnose.md states the
rules; the numbers are here, once.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path

from lowp_common import UserError
from tensor_viz.diagnose_rules import HIGH, LOW, MEDIUM, Finding, _label

#: picks the finding a loss finding follows from the candidates (None: there are none)
Cause = Callable[[list[Finding]], "Finding | None"]

#: loss spike: above mean + LOSS_SIGMAS x std of the previous LOSS_WINDOW iterations (or
#: non-finite); a finding of another kind that starts at most LOSS_LEAD iterations before the
#: spike is named as its likely cause
LOSS_WINDOW, LOSS_SIGMAS, LOSS_LEAD = 100, 6.0, 50
#: loss divergence by level: above DIVERGE_FACTOR x the lowest of the first LOSS_EARLY losses
#: or x ln(vocabulary); not decreasing: judged with at least 4 x LOSS_FLAT losses
DIVERGE_FACTOR, LOSS_EARLY, LOSS_FLAT = 1.5, 5, 4
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


def spikes(losses: list[tuple[int, float]], others: list[Finding], first: Cause) -> list[Finding]:
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
            out.append(Finding(
                "loss_spike", HIGH if not math.isfinite(v) else MEDIUM,
                f"Loss spike at iteration {it} ({v:.4g})"
                + (f"; it follows {cause.kind} at iteration {cause.onset} "
                   f"({_label(cause.where)})" if cause else
                   "; no captured finding precedes it") + ".",
                {"iteration": it}, {"loss": v, "window": len(window),
                                    "follows": cause.to_dict() if cause else None},
                "the training log / TensorBoard", "Start from the finding it follows."
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


def divergence(losses: list[tuple[int, float]], others: list[Finding], vocab: int | None,
               first: Cause) -> list[Finding]:
    """The loss by level (docs/diagnose.md): from the first iteration whose loss is above
    DIVERGE_FACTOR x the lowest of its first LOSS_EARLY values or above DIVERGE_FACTOR x
    ln(vocabulary); else, with 4 x LOSS_FLAT values or more, a last quarter whose mean is not
    below the first quarter's (not decreasing). Non-finite losses are loss_spike's."""
    seq = [(it, v) for it, v in sorted(losses) if math.isfinite(v)]
    if len(seq) < 2:
        return []
    ln_v = math.log(vocab) if vocab and vocab > 1 else None
    hit, rule = None, ""
    for k, (it, v) in enumerate(seq):
        early = min(x for _, x in seq[:max(min(k, LOSS_EARLY), 1)])
        if k and v > DIVERGE_FACTOR * early:
            hit, rule = (it, v, early), f"above {DIVERGE_FACTOR:g} x its early minimum {early:.4g}"
        elif ln_v is not None and v > DIVERGE_FACTOR * ln_v:
            hit, rule = (it, v, early), (f"above {DIVERGE_FACTOR:g} x ln(vocabulary {vocab}) = "
                                         f"{DIVERGE_FACTOR * ln_v:.4g}")
        if hit:
            break
    q = len(seq) // 4
    flat = None
    if len(seq) >= 4 * LOSS_FLAT:
        head = sum(v for _, v in seq[:q]) / q
        tail = sum(v for _, v in seq[-q:]) / q
        if tail >= head:
            flat = (head, tail)
    if hit is None and flat is None:
        return []
    if hit is None:
        it, v, early = seq[-q][0], seq[-q][1], min(x for _, x in seq[:LOSS_EARLY])
        rule = f"not decreasing: mean of the last quarter {flat[1]:.4g} >= first quarter's {flat[0]:.4g}"
    else:
        it, v, early = hit
    near = [f for f in others if f.onset is not None and it - LOSS_LEAD <= f.onset <= it
            and f.severity != LOW]
    cause = first(near)
    after = [x for i, x in seq if i >= it]
    summary = (f"The loss diverges from iteration {it}: {v:.4g}, {rule}; it stays "
               f"{min(after):.4g}..{max(after):.4g} to iteration {seq[-1][0]}"
               + (f"; it follows {cause.kind} at iteration {cause.onset} "
                  f"({_label(cause.where)})" if cause else
                  "; no captured finding precedes it") + ".")
    return [Finding(
        "loss_divergence", MEDIUM if hit is None else HIGH, summary, {"iteration": it},
        {"loss": v, "rule": rule, "early_minimum": early, "ln_vocabulary": ln_v,
         "vocabulary": vocab, "max_after": max(after), "last": seq[-1][1],
         "not_decreasing": flat is not None, "follows": cause.to_dict() if cause else None},
        "the training log / TensorBoard",
        (f"Start from the finding it follows ({cause.kind}: {cause.action})" if cause else
         "Lower the learning rate or clip the gradients; capture the iterations before it "
         "(stats_only: true)."), onset=it)]
