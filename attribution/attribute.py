"""lowp-attribute's library: run the reference, the format and the ablations; attribute the gap.

Phases (each run repeated over the seeds, paired by seed):
1. calibration (a few steps per worker: the total-time estimate printed first);
2. the reference, the format and the standard ablations (attribution.ablations), in one batch;
3. bisection from the cheapest set that closes the target share toward a smaller one;
4. the plan that closes the target share at the least high-precision compute, written as a
   precision plan and run again through CUSTOM_QUANT_PLAN on fresh seeds (does it reproduce?).
A gap within seed noise stops after phase 2's first two runs: "no significant gap".
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from lowp_common import UserError, atomic_write_text

from . import ablations as ab
from . import stats
from .runner import RunResult, RunSetup, RunTask, WorkerPool

CALIBRATION_STEPS = 10


@dataclass
class Measured:
    """Per-seed final losses of one configuration."""

    name: str
    atoms: Optional[frozenset]          # None: the format or the reference themselves
    losses: dict = field(default_factory=dict)
    seconds: list = field(default_factory=list)
    errors: list = field(default_factory=list)


@dataclass
class Attribution:
    fmt: str
    reference: str
    steps: int
    seeds: list
    shape: ab.ModelShape
    target: float
    ref: Measured
    low: Measured
    ablations: list = field(default_factory=list)       # Measured, in run order
    plan_atoms: Optional[frozenset] = None
    plan_path: Optional[str] = None
    verify: Optional[Measured] = None
    verify_ref: Optional[Measured] = None
    verify_seeds: list = field(default_factory=list)
    seconds: float = 0.0
    run_seconds: list = field(default_factory=list)
    workers: int = 1

    @property
    def gap(self) -> stats.Summary:
        return stats.gap_summary(self.low.losses, self.ref.losses)

    @property
    def significant(self) -> bool:
        return self.gap.significant

    def closure(self, m: Measured) -> stats.Closure:
        return stats.closure(self.low.losses, self.ref.losses, m.losses)


class Orchestrator:
    """Drives a WorkerPool through the phases; ``say`` prints lines, ``bar`` makes progress bars."""

    def __init__(self, setup: RunSetup, shape: ab.ModelShape, fmt: str, reference: str,
                 seeds: list, out_dir: Path, workers: int, target: float = 0.9,
                 bisect_rounds: int = 3, verify: bool = True,
                 say: Callable[[str], None] = print, bar=None) -> None:
        self.setup, self.shape, self.fmt, self.reference = setup, shape, fmt, reference
        self.seeds, self.out_dir, self.workers = list(seeds), out_dir, workers
        self.target, self.bisect_rounds, self.verify = target, bisect_rounds, verify
        self.say, self.bar = say, bar
        self.plans_dir = out_dir / "plans"
        self._by_atoms: dict[frozenset, Measured] = {}

    # -- plans ------------------------------------------------------------------------------------
    def _plan_file(self, name: str, atoms: frozenset) -> str:
        from quant.precision_plan import dump_plan

        self.plans_dir.mkdir(parents=True, exist_ok=True)
        slug = "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")[:60]
        path = self.plans_dir / f"{len(list(self.plans_dir.glob('*.yaml'))):02d}_{slug}.yaml"
        plan = ab.plan_for(atoms, self.fmt, self.reference, self.shape, str(path))
        atomic_write_text(path, dump_plan(plan, f"lowp-attribute ablation: {name}: "
                                                f"kept in {self.reference}, the rest "
                                                f"{self.fmt}"))
        return str(path)

    def _tasks(self, m: Measured, seeds: list, quant: str, plan: Optional[str]) -> list:
        return [RunTask(m.name, s, quant, plan) for s in seeds]

    # -- running ----------------------------------------------------------------------------------
    def _run(self, pool: WorkerPool, jobs: list[tuple[Measured, list]], label: str) -> None:
        by_name = {m.name: m for m, _ in jobs}
        tasks = [t for _, ts in jobs for t in ts]
        tasks.sort(key=lambda t: t.seed)      # the same seed runs close together
        progress = self.bar(total=len(tasks), desc=label) if self.bar else None

        def done(r: RunResult) -> None:
            m = by_name[r.key]
            m.losses[r.seed] = r.loss
            m.seconds.append(r.seconds)
            if r.error:
                m.errors.append(r.error)
            if progress is not None:
                progress.update(1)

        try:
            pool.map(tasks, done)
        finally:
            if progress is not None:
                progress.close()
        for m, _ in jobs:
            if m.errors and all(not math.isfinite(v) for v in m.losses.values()):
                raise UserError(f"{m.name}: {m.errors[0]}")

    def estimate(self, pool: WorkerPool) -> float:
        """Seconds per training step of the format (a few steps on each worker)."""
        t = [RunTask("calibrate", self.seeds[0], self.fmt, None, CALIBRATION_STEPS)
             for _ in range(self.workers)]
        res = pool.map(t)
        bad = [r.error for r in res if r.error]
        if bad:
            raise UserError(bad[0])
        return min(r.step_seconds for r in res)

    def run(self, pool: WorkerPool) -> Attribution:
        t0 = time.perf_counter()
        per_step = self.estimate(pool)
        n = len(self.seeds)
        std = ab.standard_ablations(self.shape)
        max_runs = n * (2 + len(std) + 2 * self.bisect_rounds + (2 if self.verify else 0))
        est = max_runs * self.setup.steps * per_step * 1.2 / self.workers
        self.say(f"estimate: up to {max_runs} runs of {self.setup.steps} steps, "
                 f"~{per_step * 1e3:.0f} ms/step, {self.workers} worker(s): about "
                 f"{est / 60:.1f} min")
        ref = Measured(f"reference {self.reference}", None)
        low = Measured(f"format {self.fmt}", None)
        res = Attribution(self.fmt, self.reference, self.setup.steps, self.seeds, self.shape,
                          self.target, ref, low, workers=self.workers)
        measured = [Measured(a.name, a.atoms) for a in std]
        self._run(pool, [(ref, self._tasks(ref, self.seeds, self.reference, None)),
                         (low, self._tasks(low, self.seeds, self.fmt, None))], "gap")
        if res.significant:
            jobs = [(m, self._tasks(m, self.seeds, self.fmt, self._plan_file(m.name, m.atoms)))
                    for m in measured]
            self._run(pool, jobs, "ablations")
            res.ablations = measured
            self._by_atoms = {m.atoms: m for m in measured}
            self._bisect(pool, res)
            self._choose_plan(res)
            if self.verify and res.plan_atoms is not None:
                self._verify(pool, res)
        res.seconds = time.perf_counter() - t0
        res.run_seconds = [s for m in [ref, low, *res.ablations] for s in m.seconds]
        return res

    def _closes(self, res: Attribution, m: Measured) -> bool:
        c = res.closure(m)
        return math.isfinite(c.share) and c.share >= self.target

    def _bisect(self, pool: WorkerPool, res: Attribution) -> None:
        """From the cheapest set closing the target share, halve it (by role, by layers, by
        unit kind, in that order) while a half still closes it; ``bisect_rounds`` bounds the
        halvings measured (a half measured before costs nothing)."""
        good = [m for m in res.ablations if self._closes(res, m)]
        current = (min(good, key=lambda m: ab.cost(m.atoms, self.shape)).atoms if good
                   else self.shape.atoms())
        rounds = self.bisect_rounds
        while True:
            moved = False
            for halves in ab.splits(current, self.shape):
                todo = [h for h in halves if h not in self._by_atoms]
                if todo and rounds <= 0:
                    return
                if todo:
                    rounds -= 1
                    self._measure(pool, res, todo)
                ok = [h for h in halves if self._closes(res, self._by_atoms[h])]
                if ok:
                    current = min(ok, key=lambda h: ab.cost(h, self.shape))
                    moved = True
                    break
            if not moved:
                return

    def _measure(self, pool: WorkerPool, res: Attribution, sets: list) -> None:
        jobs = []
        for h in sets:
            m = Measured(f"bisect: {ab.name_of(h, self.shape)}", h)
            self._by_atoms[h] = m
            jobs.append((m, self._tasks(m, self.seeds, self.fmt, self._plan_file(m.name, h))))
        self._run(pool, jobs, "bisection")
        res.ablations.extend(m for m, _ in jobs)

    def _choose_plan(self, res: Attribution) -> None:
        good = [m for m in res.ablations if self._closes(res, m)]
        if good:
            best = min(good, key=lambda m: (ab.cost(m.atoms, self.shape),
                                            -res.closure(m).share))
            res.plan_atoms = best.atoms
        else:
            res.plan_atoms = self.shape.atoms()   # nothing cheaper closes it: all of it
        from quant.precision_plan import dump_plan

        path = self.out_dir / "precision_plan.yaml"
        plan = ab.plan_for(res.plan_atoms, self.fmt, self.reference, self.shape, str(path))
        share = next((res.closure(m) for m in res.ablations if m.atoms == res.plan_atoms), None)
        header = (f"lowp-attribute: {self.fmt} against {self.reference}, {self.setup.steps} "
                  f"steps, seeds {self.seeds}\nkeeps {ab.name_of(res.plan_atoms, self.shape)} "
                  f"in {self.reference} ({ab.cost(res.plan_atoms, self.shape):.1%} of GEMM "
                  "FLOPs)" + (f"; closes {share.share:.0%} +- {share.share_std:.0%} of the gap"
                              if share else "")
                  + f"\nuse: CUSTOM_QUANT_TYPE={self.fmt} CUSTOM_QUANT_PLAN={path.name}")
        atomic_write_text(path, dump_plan(plan, header))
        res.plan_path = str(path)

    def _verify(self, pool: WorkerPool, res: Attribution) -> None:
        """The written plan file through CUSTOM_QUANT_PLAN on fresh seeds, with the reference
        on the same seeds: its gap, to compare with the gap the plan claims."""
        seeds = [s + 1000 for s in self.seeds]
        ref = Measured(f"verify reference {self.reference}", None)
        m = Measured("verify: written plan", res.plan_atoms)
        self._run(pool, [(ref, self._tasks(ref, seeds, self.reference, None)),
                         (m, self._tasks(m, seeds, self.fmt, res.plan_path))], "verify")
        res.verify = m
        res.verify_seeds = seeds
        res.verify_ref = ref


def tqdm_bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True,
                leave=True)
