"""The device side of ``@watch_training``: watched layers, hooks and the buffers steps fill.

Why this shape (cost): a step that is neither a statistics step (every ``layer_stats_every``)
nor a gradient-norm step (every ``grad_norm_every``, by default the statistics steps) costs one
small device copy (the loss): the layer hooks are installed only for statistics steps, and the
global gradient norm, which reads every gradient, is taken from the training step when it
returns one. On statistics steps each hook writes the tensor's min, max and an evenly strided
sample into preallocated device buffers; the ratios of all layers are then computed in one
batched pass. Nothing is copied to the host until every ``sync_every`` steps, when the buffers
are read at once (:meth:`MonitorState.host_rows`). Only numbers are kept, never tensors.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from quant.analysis import dtype_limits as quant_dtype_limits
from training_profiler._tensors import first_tensor

# Columns of the per-layer statistics row of a statistics step: on the device absmax and the
# counts (overflowing, underflowing, sum |x|) over the sample; on the host the counts become
# ratios and the sum the mean (divided by the sample size).
ABSMAX, OVERFLOW, UNDERFLOW, MEANABS = range(4)
_NSTATS = 4
#: The two watched tensors of a layer, in the order of the buffers' first axis.
KINDS = ("act", "grad")


@dataclass(frozen=True)
class MonitorCadence:
    """How often the monitor measures and reports: what the watched run pays for it.

    ``layer_stats_every``: steps between per-layer statistics (hooks on); ``grad_norm_every``:
    steps between global gradient-norm measurements when the step does not return one (None:
    the statistics steps, which read every gradient anyway); ``sync_every``: steps buffered on
    the device between host reads; ``log_every``: steps between status lines;
    ``sample_size``: elements sampled per tensor for the ratios and mean|x|.
    """

    log_every: int = 100
    sync_every: int = 10
    layer_stats_every: int = 10
    sample_size: int = 4096
    grad_norm_every: int | None = None

    def __post_init__(self) -> None:
        if min(self.sync_every, self.log_every, self.layer_stats_every, self.sample_size) < 1:
            raise ValueError("sync_every, log_every, layer_stats_every and sample_size must be >= 1")

    @property
    def grad_norm_steps(self) -> int:
        """Steps between measured global norms. The norm reads every gradient (memory-bound:
        ~0.6 ms/step for 13 MB of gradients on one CPU core), so by default it is taken on the
        statistics steps, which read every gradient for the per-layer norms anyway."""
        if self.grad_norm_every is None:
            return self.layer_stats_every
        return max(1, self.grad_norm_every)


def capture_iteration() -> int | None:
    """The process-wide capture saver's iteration when a capture is configured on. Read from
    sys.modules: a process that never loaded the saver captures nothing, and importing it here
    would cost every monitored run the capture package."""
    mod = sys.modules.get("tensor_capture.saver")
    saver = mod.current_saver() if mod is not None else None
    if saver is None or not saver.config.enabled:
        return None
    return saver.iteration


def stats_rows(stats: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Device statistics rows [kind, layer, (absmax, #over, #under, sum|x|)] and the sample
    sizes -> (absmax, overflow ratio, underflow ratio, mean|x|); a tensor not seen this step
    has NaN ratios (no data) and absmax 0 (not a non-finite alarm)."""
    seen = counts > 0
    with np.errstate(all="ignore"):
        out = stats / np.maximum(counts, 1)[..., None]
    out = np.where(seen[..., None], out, np.nan)
    out[..., ABSMAX] = np.where(seen, stats[..., ABSMAX], 0.0)
    return out


def _default_layer(name: str, module: torch.nn.Module) -> bool:
    """Leaf modules that own parameters: the layers a user means by "each layer"."""
    return not list(module.children()) and any(True for _ in module.parameters(recurse=False))


class MonitorState:
    """Watched layers, their hooks, and ``sync_every`` slots of device buffers (one per
    buffered step) with the host-side facts of each slot."""

    def __init__(self, cadence: MonitorCadence, thresholds: Any,
                 layer_filter: Callable[[str, torch.nn.Module], bool] | None = None) -> None:
        self.sample_size = cadence.sample_size
        self.sync_every = S = cadence.sync_every
        self.watch_dtype, self.overflow_margin = thresholds.watch_dtype, thresholds.overflow_margin
        self.layer_filter = layer_filter
        # Per buffered step (slot), host side: statistics taken, gradient norm measured, the
        # sample sizes of the statistics, the global norm the step returned (a number), the
        # capture iteration.
        self.slot_has_stats = [False] * S
        self.slot_gnorm = [False] * S
        self.slot_given: list[float | None] = [None] * S
        self.slot_iteration: list[int | None] = [None] * S
        self._slot_counts = np.zeros((S, 2, 0))
        self.model: torch.nn.Module | None = None
        self.layers: list[str] = []
        self._modules: list[torch.nn.Module] = []
        self._capture_sites: dict[int, tuple[str | None, int | None]] | None = None
        self._handles: list[Any] = []
        self.buffers: dict[str, torch.Tensor] | None = None
        self._limits: dict[torch.dtype, tuple[float, float]] = {}

    # ---- setup -------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> None:
        """Choose the watched layers and preallocate the buffers (hooks go on per statistics step)."""
        self.hooks_off()
        self.model = model
        keep = self.layer_filter or _default_layer
        chosen = [(n, m) for n, m in model.named_modules() if keep(n, m)]
        self.layers = [n for n, _ in chosen]
        self._modules = [m for _, m in chosen]
        self._capture_sites = None
        self._params = [p for p in model.parameters() if p.requires_grad]
        owner = {id(p): i for i, (_, m) in enumerate(chosen) for p in m.parameters(recurse=False)}
        L = len(chosen)
        # Parameters outside watched layers count in the global norm only (index L = "rest").
        self._param_layer_host = [owner.get(id(p), L) for p in self._params]
        dev = next(iter(model.parameters()), torch.empty(0)).device
        self.alloc(dev, L)
        self._param_layer = torch.tensor(self._param_layer_host, dtype=torch.long, device=dev)

    def alloc(self, dev: torch.device, L: int) -> None:
        S, N = self.sync_every, self.sample_size
        self.buffers = {
            "loss": torch.zeros(S, device=dev),
            "gnorm": torch.zeros(S, L + 2, device=dev),  # [global, layer 0..L-1, rest]
            "stats": torch.zeros(S, 2, L, _NSTATS, device=dev),
        }
        # One statistics step's scratch: each hook writes its tensor's min and max into columns
        # N, N+1 and an evenly strided sample into columns 0..n-1 (the rest stays zero, which
        # counts as neither overflow nor underflow and adds nothing to sum |x|).
        self._scratch = torch.zeros(2, L, N + 2, device=dev)
        self._sample_rows = [[self._scratch[k, i, :N] for i in range(L)] for k in range(2)]
        self._minmax = [[(self._scratch[k, i, N], self._scratch[k, i, N + 1], self._scratch[k, i, N:])
                         for i in range(L)] for k in range(2)]
        self._n = np.zeros((2, L))                       # sample sizes of this step
        self._slot_counts = np.zeros((S, 2, L))
        self._bounds = np.zeros((2, 2, L))               # [overflow, underflow] bound per row
        self._bounds_dev = torch.zeros(2, 2, L, 1, device=dev)
        self._bounds_dirty = True

    def hooks_on(self) -> None:
        if not self._handles:
            self._handles = [m.register_forward_hook(self._make_hook(i))
                             for i, m in enumerate(self._modules)]

    def hooks_off(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def hooked(self) -> bool:
        return bool(self._handles)

    # ---- statistics steps --------------------------------------------------------------
    def _limits_for(self, dtype: torch.dtype) -> tuple[float, float]:
        d = self.watch_dtype or dtype
        if d not in self._limits:   # quant.analysis' overflow / underflow, compared in float32
            lim = quant_dtype_limits(d)
            self._limits[d] = (lim.overflow_bound(torch.float32) * self.overflow_margin,
                               lim.underflow_bound(torch.float32))
        return self._limits[d]

    def record(self, k: int, i: int, t: torch.Tensor) -> None:
        """Write one tensor's min, max and sample into the scratch buffer (no host sync).

        The min and max (whose absolute max also exposes NaN/Inf, since both propagate through
        them) are taken over the whole tensor; the overflow/underflow ratios and mean|x| later
        (:meth:`finish_stats`, all layers at once) over an evenly strided sample of at most
        ``sample_size`` elements, which keeps the cost flat in the tensor size. Values are
        compared in float32, as the bounds are.
        """
        flat = t.detach().reshape(-1)
        numel = flat.numel()
        if numel == 0:
            return
        over, tiny = self._limits_for(t.dtype)
        b = self._bounds
        if b[0, k, i] != over or b[1, k, i] != tiny:
            b[0, k, i], b[1, k, i] = over, tiny
            self._bounds_dirty = True
        mn, mx, both = self._minmax[k][i]
        if flat.dtype == torch.float32:   # straight into the buffer (inf-norm is ~20x slower on CPU)
            torch.aminmax(flat, out=(mn, mx))
        else:
            both.copy_(torch.stack(torch.aminmax(flat)))
        sample = flat[::-(-numel // self.sample_size)]
        n = sample.numel()
        self._sample_rows[k][i][:n].copy_(sample)
        self._n[k, i] = n

    def _make_hook(self, i: int):
        def on_grad(g: torch.Tensor | None) -> None:
            if g is not None:
                self.record(1, i, g)

        def hook(module, args, output):
            t = first_tensor(output)
            if t is None or not t.is_floating_point():
                return
            self.record(0, i, t)
            if t.requires_grad:
                t.register_hook(on_grad)
        return hook

    def finish_stats(self, slot: int) -> None:
        """All layers' statistics rows from the scratch buffer in one batched pass."""
        assert self.buffers is not None
        if self._bounds_dirty:
            self._bounds_dev.copy_(torch.from_numpy(self._bounds).float().unsqueeze(-1))
            self._bounds_dirty = False
        N = self.sample_size
        a = self._scratch[..., :N].abs()
        over, tiny = self._bounds_dev[0], self._bounds_dev[1]
        absmax = torch.maximum(self._scratch[..., N + 1], -self._scratch[..., N])
        n_over = (a >= over).sum(-1)                    # integer sums: cheaper than float32
        n_under = ((a < tiny) & (a > 0)).sum(-1)        # ones on CPU; zeros (padding) excluded
        torch.stack((absmax, n_over.float(), n_under.float(), a.sum(-1)),
                    dim=-1, out=self.buffers["stats"][slot])
        self._scratch.zero_()
        self._slot_counts[slot] = self._n
        self._n[:] = 0

    # ---- every step --------------------------------------------------------------------
    def put_loss(self, slot: int, loss: Any) -> None:
        b = self.buffers
        if b is None:   # no model: buffers where the loss lives (no transfer per step)
            self.alloc(loss.device if isinstance(loss, torch.Tensor) else torch.device("cpu"), 0)
            b = self.buffers
            assert b is not None
        if isinstance(loss, torch.Tensor):
            b["loss"][slot].copy_(loss.detach().float().mean() if loss.numel() != 1 else loss.detach().reshape(()))
        else:
            b["loss"][slot] = float(loss) if loss is not None else float("nan")
        self.slot_given[slot] = None

    def put_grad_norm(self, slot: int, grad_norm: Any) -> None:
        """The loop's global norm: a tensor stays on its device, a number on the host."""
        if isinstance(grad_norm, torch.Tensor):
            assert self.buffers is not None
            self.buffers["gnorm"][slot, 0].copy_(grad_norm.detach().float().reshape(()))
        else:
            self.slot_given[slot] = float(grad_norm)

    def grad_norms(self, slot: int, per_layer: bool, keep_global: bool) -> None:
        """Global (and on statistics steps per-layer) gradient norms into the slot's row."""
        assert self.buffers is not None
        grads = [p.grad for p in self._params]
        row = self.buffers["gnorm"][slot]
        if grads and all(g is not None for g in grads):
            norms = torch.stack(torch._foreach_norm(grads))
            idx = self._param_layer
        else:
            keep = [(g, j) for g, j in zip(grads, self._param_layer_host) if g is not None]
            norms = torch.stack(torch._foreach_norm([g for g, _ in keep])) if keep else None
            idx = torch.tensor([j for _, j in keep], dtype=torch.long).to(row.device)
        if norms is None:   # no gradients this step (not the same as NaN gradients)
            (row[1:] if keep_global else row).fill_(-1.0)
            return
        sq = norms.float().square()
        if per_layer:
            row[1:].zero_()
            row[1:].index_add_(0, idx, sq)
            row[1:].sqrt_()
        if not keep_global:
            row[0] = sq.sum().sqrt()

    # ---- the host side -----------------------------------------------------------------
    def host_rows(self, n: int, has_norm: bool) -> list[dict[str, Any]]:
        """The first ``n`` slots read to the host (one transfer per buffer), one row each:
        loss, capture iteration, and where measured the norms [global, per layer...] and the
        per-layer statistics rows (:func:`stats_rows`)."""
        assert self.buffers is not None
        host = {k: v[:n].cpu().numpy().astype(np.float64) for k, v in self.buffers.items()}
        rows = []
        for r in range(n):
            row: dict[str, Any] = {"loss": host["loss"][r], "iteration": self.slot_iteration[r]}
            if has_norm:
                g = host["gnorm"][r] if self.slot_gnorm[r] else np.array([-1.0])
                if self.slot_given[r] is not None:
                    g = g.copy()
                    g[0] = self.slot_given[r]
                row["gnorm"] = g if self.slot_has_stats[r] else g[:1]
            if self.slot_has_stats[r]:
                row["stats"] = stats_rows(host["stats"][r], self._slot_counts[r])
            rows.append(row)
        return rows

    def capture_link(self, idx: int, iteration: int | None) -> dict[str, Any] | None:
        """Where the captured files of watched layer ``idx`` at ``iteration`` are: the capture
        directory, the iteration, a glob of that layer's files (this rank) built by the capture
        schema, and the module path the manifest records carry. None when the process-wide
        capture saved nothing at that iteration."""
        mod = sys.modules.get("tensor_capture.saver")
        saver = mod.current_saver() if mod is not None else None
        if iteration is None or saver is None or iteration not in saver.saved_iterations:
            return None
        from tensor_capture import ranks, schema, sites

        if self._capture_sites is None:   # capture's own module paths and 0-based layer index
            assert self.model is not None
            sites.register_model(self.model)
            self._capture_sites = {i: (sites.site_of(m).module_path, sites.site_of(m).layer_idx)
                                   for i, m in enumerate(self._modules)}
        path, layer_idx = self._capture_sites[idx]
        return {"dir": str(saver.directory), "iteration": iteration, "module_path": path,
                "layer_idx": layer_idx,
                "glob": schema.filename_glob(iteration=iteration, layer_idx=layer_idx,
                                             rank=ranks.global_rank())}
