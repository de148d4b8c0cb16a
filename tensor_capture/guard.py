"""The auto-guard (``TENSOR_SAVE_GUARD=on`` or ``guard:`` in TENSOR_SAVE_CONFIG): the run
protects itself by rescaling or upcasting the GEMM its format is failing.

Why here: the emulation already holds each GEMM operand before and after quantization, so the
guard reads what the run's own format does to it (flushed and saturated elements, NaN / Inf made,
SQNR against the format's Gaussian baseline: tensor_capture.guard_rules), at no extra
quantization. At the step boundary the per-operand sums of every rank are added in one
all-reduce, so every tensor- and data-parallel rank judges the same numbers and takes the same
decisions; a decision (a condition held ``hold`` iterations) moves that GEMM of that module one
rung up its ladder (a scaled variant of the format, then high precision within a FLOPs budget)
from the next iteration, through the precision plan the emulation already reads (STATE.plan,
what CUSTOM_QUANT_PLAN sets). Until it acts the guard only reads: a healthy run's numbers are
unchanged, bit for bit.

Output in ``<save_dir>/guard/``: ``decisions.jsonl`` (one line per decision, rank 0; each rank
also ``decisions_rank<r>.jsonl``), ``plan.yaml`` (a CUSTOM_QUANT_PLAN that reproduces the final
decisions from step 0), ``summary.json`` (decisions, hp_flops_share). A run resumed with the same
TENSOR_SAVE_DIR continues with the decisions taken before its first iteration.
"""
from __future__ import annotations

import json
import math
import re
import zlib
from pathlib import Path
from typing import Any, Callable

import torch

from lowp_common import atomic_write_text, json_dumps
from quant.vocabulary import ENV_GUARD, HIGH_PRECISION, HIGH_PRECISION_NAMES

from .guard_rules import (
    ELEMENTS,
    FLUSHED,
    MADE_NONFINITE,
    NONZERO,
    SATURATED,
    STATS,
    GuardSettings,
    ladder,
    row_sqnr_db,
)

GUARD_DIR = "guard"
DECISIONS = "decisions.jsonl"
PLAN_FILE = "plan.yaml"
SUMMARY_FILE = "summary.json"

#: GEMM -> the precision plan's role that selects its format (attention's two are its fprop)
PLAN_ROLE = {"fprop": "fprop", "dgrad": "dgrad", "wgrad": "wgrad", "qk": "fprop", "pv": "fprop"}
#: GEMM -> its FLOPs from its two operands' shapes (quant.gemm_plan's operand order)
_FLOPS: dict[str, Callable[[tuple, tuple], float]] = {
    "fprop": lambda x, w: 2.0 * math.prod(x) * w[0],          # x [.., in] @ W[out, in].T
    "dgrad": lambda dy, w: 2.0 * math.prod(dy) * w[1],        # dy [.., out] @ W[out, in]
    "wgrad": lambda dy, x: 2.0 * math.prod(dy) * x[-1],       # dy[t, out].T @ x[t, in]
    "qk": lambda q, k: 2.0 * math.prod(q) * k[0],             # Q [sq, b, h, d] . K [sk, ..]
    "pv": lambda p, v: 2.0 * math.prod(p) * v[-1],            # P [bh, sq, sk] . V [.., d]
}


def operand_row(x: torch.Tensor, q: torch.Tensor, overflow: float | None) -> torch.Tensor:
    """The guard's statistics (guard_rules.STATS) of operand ``x`` quantized to ``q``, a float64
    vector on x's device (no host sync on a device). ``overflow``: the magnitude from which the
    unscaled format saturates (quant.analysis.cast_limits), None for a scaled one.

    On the CPU, branching on a value is free: a finite tensor whose quantization is finite (the
    usual case) takes five reductions, the same numbers as the general path (a quantizer keeps 0
    at 0, so the flushed elements are nnz(x) - nnz(q))."""
    a = x.detach().reshape(-1).float()
    b = q.detach().reshape(-1).float()
    if a.device.type == "cpu":
        signal = float(torch.dot(a, a))
        if math.isfinite(signal):
            d = a - b
            noise = float(torch.dot(d, d))
            if math.isfinite(noise):
                nonzero = int(torch.count_nonzero(a))
                flushed = nonzero - int(torch.count_nonzero(b))
                saturated = int((a.abs() >= overflow).sum()) if overflow is not None else 0
                return torch.tensor([a.numel(), nonzero, flushed, 0, saturated, signal, noise],
                                    dtype=torch.float64)
    return _general_row(a, b, overflow)


def _general_row(a: torch.Tensor, b: torch.Tensor, overflow: float | None) -> torch.Tensor:
    """:func:`operand_row` of flat float32 ``a`` and ``b`` without branching on values (any
    device; NaN / Inf in either)."""
    finite = torch.isfinite(a)
    nonzero = finite & (a != 0)
    fa = torch.where(finite, a, 0.0)
    err = torch.where(finite & torch.isfinite(b), fa - b, 0.0)
    parts = [torch.tensor(float(a.numel()), device=a.device), nonzero.sum(),
             (nonzero & (b == 0)).sum(), (finite & ~torch.isfinite(b)).sum(),
             ((fa.abs() >= overflow).sum() if overflow is not None
              else torch.zeros((), device=a.device)),
             torch.dot(fa, fa), torch.dot(err, err)]
    return torch.stack([p.to(torch.float64) for p in parts])


class Guard:
    """One capture session's guard (owned by its TensorSaver; STATE.guard while it runs)."""

    def __init__(self, settings: GuardSettings, quant_type: str, base_plan: Any,
                 directory: Path, rank: Callable[[], int],
                 announce: Callable[[str], None]) -> None:
        self.settings = settings
        self.quant_type = quant_type
        self.base_plan = base_plan              # the user's CUSTOM_QUANT_PLAN (or None)
        self.out_dir = Path(directory) / GUARD_DIR
        self._rank = rank
        self._announce = announce
        self.keys: list[tuple[str, str, str]] = []        # (site, gemm, operand), first seen
        self._index: dict[tuple[str, str, str], int] = {}
        self.rows: list[torch.Tensor | None] = []
        self.meta: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.streak: dict[tuple[str, str, str], int] = {}
        self.moved: dict[tuple[str, str], str] = {}       # (site, plan role) -> format
        self.decisions: list[dict[str, Any]] = []
        self.exhausted: set[tuple[str, str]] = set()
        self.layers: dict[str, int | None] = {}           # site -> its layer (plan rules)
        self.judged = 0
        self.resumed_from: int | None = None
        self.disabled: str | None = None

    # -- what the emulation tells it ------------------------------------------------------------
    def observe(self, site: str, gemm: str, operand: str, x: torch.Tensor, q: torch.Tensor, *,
                fmt: str | None, axis: int, layer: int | None = None) -> None:
        """Operand ``operand`` of ``gemm`` of the module at ``site`` (transformer layer
        ``layer``) was quantized to ``fmt``."""
        if fmt is None or self.disabled:
            return
        self.layers[site] = layer
        key = (site, gemm, operand)
        i = self._index.get(key)
        if i is None:
            i = self._index[key] = len(self.keys)
            self.keys.append(key)
            self.rows.append(None)
        meta = self.meta.get(key)
        if meta is None or meta["format"] != fmt:
            meta = self.meta[key] = _operand_meta(fmt, tuple(x.shape), axis)
        row = operand_row(x, q, meta["overflow"])
        self.rows[i] = row if self.rows[i] is None else self.rows[i].add_(row)

    def format_of(self, site: str, role: str) -> str:
        """The format ``role`` of the module at ``site`` computes in now."""
        moved = self.moved.get((site, role))
        if moved is not None:
            return moved
        if self.base_plan is not None:
            return self.base_plan.format_for(site, self.layers.get(site), role,
                                             default=self.quant_type)
        return self.quant_type

    def plan(self) -> Any:
        """The precision plan the emulation reads: one rule per decision (that module's role),
        before the user's own rules."""
        if not self.moved:
            return self.base_plan
        from quant.precision_plan import PlanRule, PrecisionPlan

        rules = tuple(PlanRule(fmt, modules=f"^{re.escape(site)}$", roles=(role,))
                      for (site, role), fmt in self.moved.items())
        base = self.base_plan
        return PrecisionPlan(rules + (base.rules if base is not None else ()),
                             base.default if base is not None else self.quant_type,
                             "tensor capture guard",
                             {"description": "the auto-guard's decisions (tensor_capture.guard)",
                              "made_by": ENV_GUARD})

    # -- the step boundary ----------------------------------------------------------------------
    def end_iteration(self, iteration: int) -> list[dict[str, Any]]:
        """Add every rank's sums, judge, decide; the decisions taken (applied from the next
        iteration)."""
        if self.disabled or not self.keys:
            return []
        table = self._reduced()
        self.rows = [None] * len(self.keys)
        if table is None:
            return []
        self.judged += 1
        if self.judged <= self.settings.warmup:
            return []
        failing = self._failing(table)
        taken = [d for d in (self._decide(iteration, target, evidence)
                             for target, evidence in failing.items()) if d is not None]
        if taken:
            from .state import STATE

            STATE.plan = self.plan()
            self._write()
        return taken

    def _reduced(self) -> torch.Tensor | None:
        """The [operands, STATS] sums of every rank (host, float64); None when the ranks do not
        see the same operands (the guard then stops, saying why)."""
        n = len(self.keys)
        rows = [r if r is not None else torch.zeros(len(STATS), dtype=torch.float64)
                for r in self.rows]
        table = torch.stack([r.cpu() for r in rows])
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return table
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
        sig = zlib.crc32("\n".join("|".join(k) for k in self.keys).encode()) & 0x7FFFFFFF
        check = torch.tensor([float(n), float(sig), -float(n), -float(sig)], dtype=torch.float64,
                             device=device)
        dist.all_reduce(check, op=dist.ReduceOp.MAX)
        if check.tolist() != [float(n), float(sig), -float(n), -float(sig)]:
            self.disabled = ("the ranks quantize different operands (pipeline stages?); the "
                             "guard judges only when every rank sees the same GEMMs")
            self._announce(f"tensor capture: guard: off from here: {self.disabled}")
            return None
        table = table.to(device)
        dist.all_reduce(table, op=dist.ReduceOp.SUM)
        return table.cpu()

    def _failing(self, table: torch.Tensor) -> dict[tuple[str, str], dict[str, Any]]:
        """(site, plan role) -> the evidence of its first operand whose condition has held
        ``hold`` iterations."""
        out: dict[tuple[str, str], dict[str, Any]] = {}
        for i, key in enumerate(self.keys):
            row = table[i].tolist()
            if row[ELEMENTS] == 0:
                continue
            meta = self.meta[key]
            hit = next(((c, t, v) for c, t in self.settings.active() if c.judges(key[2])
                        and (v := c.value(row, meta["baseline_db"])) >= t), None)
            self.streak[key] = self.streak.get(key, 0) + 1 if hit is not None else 0
            target = (key[0], PLAN_ROLE[key[1]])
            if hit is None or self.streak[key] < self.settings.hold or target in out \
                    or target in self.exhausted:
                continue
            cond, threshold, value = hit
            out[target] = {"operand": key[2], "gemm": key[1], "rule": cond.name,
                           "meaning": cond.meaning, "value": value, "threshold": threshold,
                           "held": self.streak[key], "format": meta["format"],
                           "sqnr_db": row_sqnr_db(row), "baseline_db": meta["baseline_db"],
                           "flush_share": row[FLUSHED] / row[NONZERO] if row[NONZERO] else 0.0,
                           "saturation_share": row[SATURATED] / row[ELEMENTS],
                           "made_nonfinite": row[MADE_NONFINITE]}
        return out

    def _decide(self, iteration: int, target: tuple[str, str],
                evidence: dict[str, Any]) -> dict[str, Any] | None:
        site, role = target
        current = self.format_of(site, role)
        for step in ladder(current, self.settings.actions):
            if step == HIGH_PRECISION and not self._fits_budget(target):
                continue
            decision = {"iteration": iteration, "module": site, "gemm": role,
                        "operand": evidence["operand"], "from": current, "to": step,
                        "rule": evidence["rule"], "evidence": evidence}
            self.moved[target] = step
            self.decisions.append(decision)
            for key in self.keys:                 # the new format earns its own streak
                if key[0] == site and PLAN_ROLE[key[1]] == role:
                    self.streak[key] = 0
            self._say(decision)
            return decision
        self.exhausted.add(target)
        if self._rank() == 0:
            self._announce(f"tensor capture: guard: {site} {role} still fails "
                           f"({evidence['rule']} {evidence['value']:.4g}) in {current} and "
                           f"no cheaper rung is left within the budget "
                           f"({self.settings.budget:.0%} of GEMM FLOPs in high precision)")
        return None

    # -- FLOPs ------------------------------------------------------------------------------------
    def flops(self) -> dict[tuple[str, str], float]:
        """(site, plan role) -> GEMM FLOPs per micro-batch, from the operands' shapes."""
        shapes: dict[tuple[str, str], list[tuple]] = {}
        for key in self.keys:
            shapes.setdefault(key[:2], []).append(self.meta[key]["shape"])
        out: dict[tuple[str, str], float] = {}
        for (site, gemm), pair in shapes.items():
            if len(pair) == 2:
                target = (site, PLAN_ROLE[gemm])
                out[target] = out.get(target, 0.0) + _FLOPS[gemm](pair[0], pair[1])
        return out

    def _hp_flops(self, flops: dict[tuple[str, str], float], only_moved: bool) -> float:
        return sum(f for t, f in flops.items()
                   if (self.moved.get(t) if only_moved else self.format_of(*t))
                   in HIGH_PRECISION_NAMES)

    def hp_share(self, only_moved: bool = False) -> float:
        """Share of the GEMM FLOPs computed in high precision (``only_moved``: by the guard)."""
        flops = self.flops()
        total = sum(flops.values())
        return self._hp_flops(flops, only_moved) / total if total else 0.0

    def _fits_budget(self, target: tuple[str, str]) -> bool:
        """Whether moving ``target`` to high precision keeps the guard's moves within budget."""
        flops = self.flops()
        total = sum(flops.values())
        moved = self._hp_flops(flops, only_moved=True) + flops.get(target, 0.0)
        return total > 0 and moved / total <= self.settings.budget + 1e-12

    # -- output ---------------------------------------------------------------------------------
    def _say(self, d: dict[str, Any]) -> None:
        e = d["evidence"]
        line = json_dumps(d, nonfinite="null")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        rank = self._rank()
        with open(self.out_dir / f"decisions_rank{rank}.jsonl", "a", encoding="utf-8") as f:
            f.write(line + "\n")
        if rank != 0:
            return
        with open(self.out_dir / DECISIONS, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        self._announce(
            f"tensor capture: guard: iteration {d['iteration']}: {d['module']} {d['gemm']} "
            f"{d['from']} -> {d['to']} from iteration {d['iteration'] + 1} ({e['operand']}: "
            f"{d['rule']} {e['value']:.4g} >= {e['threshold']:.4g} for {e['held']} iterations; "
            f"SQNR {e['sqnr_db']:.1f} dB, baseline {e['baseline_db']:.1f} dB)")

    def _write(self) -> None:
        if self._rank() != 0:
            return
        from quant.precision_plan import dump_plan

        plan = self.plan()
        if plan is not None:
            atomic_write_text(self.out_dir / PLAN_FILE, dump_plan(
                plan, "written by the auto-guard: its final decisions as a CUSTOM_QUANT_PLAN;\n"
                      f"reuse: CUSTOM_QUANT_TYPE={self.quant_type} CUSTOM_QUANT_PLAN=<this file>"),
                make_parents=True)
        summary = {"quant_type": self.quant_type, "decisions": len(self.decisions),
                   "hp_flops_share": self.hp_share(),
                   "hp_flops_share_moved": self.hp_share(only_moved=True),
                   "budget": self.settings.budget, "iterations_judged": self.judged,
                   "gemms": len(self.flops()), "resumed_from": self.resumed_from,
                   "final": {f"{s} {r}": fmt for (s, r), fmt in sorted(self.moved.items())}}
        atomic_write_text(self.out_dir / SUMMARY_FILE, json_dumps(summary, indent=2),
                          make_parents=True)

    def close(self) -> None:
        """The summary and plan as they stand at the end of the run."""
        if self.keys or self.decisions:
            self._write()

    def resume(self, first_iteration: int) -> None:
        """A run resumed at ``first_iteration`` with this save folder: the decisions taken before
        it (decisions.jsonl) hold again, so the run continues as it was (unless a checkpoint
        already gave them back: :meth:`restore`)."""
        if first_iteration <= 0 or self.resumed_from is not None:
            return
        found = read_decisions(self.out_dir.parent)
        if found:
            self.restore(found, first_iteration, str(self.out_dir / DECISIONS))

    def restore(self, decisions: list[dict[str, Any]], first_iteration: int,
                source: str = "the checkpoint") -> None:
        """The decisions taken before ``first_iteration`` (a checkpoint's, or the folder's)
        hold again from it."""
        kept = [d for d in decisions if d["iteration"] < first_iteration]
        self.resumed_from = first_iteration
        if not kept:
            return
        from .state import STATE

        for d in kept:
            self.moved[(d["module"], d["gemm"])] = d["to"]
        self.decisions = kept
        STATE.plan = self.plan()
        if self._rank() == 0:
            self._announce(f"tensor capture: guard: resumed at iteration {first_iteration} "
                           f"with {len(kept)} earlier decision(s) from {source}")


def read_decisions(folder: str | Path) -> list[dict[str, Any]]:
    """The guard's decisions in a capture folder (``guard/decisions.jsonl``), in order; [] when
    the run had no guard or it never acted. The one reader of that file."""
    path = Path(folder) / GUARD_DIR / DECISIONS
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and {"iteration", "module", "gemm", "to"} <= set(d):
            out.append(d)
    return out


def checkpoint_state() -> list[dict[str, Any]] | None:
    """What a checkpoint keeps of the running guard (its decisions), None without one."""
    from .state import STATE

    guard = STATE.guard
    return None if guard is None else json.loads(json_dumps(guard.decisions, nonfinite="null"))



def _operand_meta(fmt: str, shape: tuple, axis: int) -> dict[str, Any]:
    """What judging an operand of ``fmt`` needs once: its baseline SQNR, its saturation bound
    (an unscaled format only), its shape (for FLOPs)."""
    from quant.analysis import cast_limits
    from quant.format_loss import baseline_sqnr
    from quant.formats import SCALING_NONE, get_format

    spec = get_format(fmt)
    overflow = (cast_limits(fmt).overflow_bound(torch.float32)
                if spec.scaling == SCALING_NONE else None)
    return {"format": fmt, "baseline_db": baseline_sqnr(fmt, shape, axis), "overflow": overflow,
            "shape": shape}
