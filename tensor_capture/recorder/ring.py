"""The flight recorder's books: slots in first-seen order, the per-iteration buffer, the ring.

Why its own module: where a tensor's statistics go (a slot per site x micro-batch, allocated
the first time the pair is seen, which is execution order, so a reader finds the first
non-finite tensor by slot order) and what the host keeps (a ring of the last W iterations, per
micro-batch) are independent of when triggers fire (tensor_capture.recorder.triggers) and of
the files written (tensor_capture.recorder.out).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import schema
from ..schema import CaptureSite
from .stats import EMPTY_ROW, INF, N_STATS, NAN, Judged

#: a slot's host values in one iteration: the statistics, then its element count and a seen
#: flag (1.0), side by side so that one call of the CPU kernel writes all of them
WIDTH = N_STATS + 2
COUNT, SEEN = N_STATS, N_STATS + 1
#: host bytes of one slot in one iteration
SLOT_BYTES = WIDTH * 8


def ring_bytes(slots: int, window: int, every: int) -> int:
    """Memory the recorder holds for ``slots`` site x micro-batch pairs: the ring of ``window``
    iterations on the host plus the buffer of ``every`` iterations being filled (on the host
    and, for device tensors, once more on the device). The one estimate: the preflight and the
    recorder's own bound (config recorder_memory) both use it."""
    return slots * SLOT_BYTES * (window + 2 * every)


@dataclass
class SiteInfo:
    """What a slot's records say beside the statistics (fixed at first sight)."""

    site: CaptureSite
    index: int                 # the site's first-seen order (summary rows' ``site``)
    quant_type: str            # the records' quant_type label (the saver's rule)
    fmt: Judged | None
    dtype: str
    shape: list[int]


@dataclass
class IterStats:
    """One iteration's statistics on the host: rows of every slot known then."""

    iteration: int
    stats: np.ndarray          # [slots, N_STATS]
    count: np.ndarray          # [slots] elements
    seen: np.ndarray           # [slots] bool: recorded in this iteration
    loss: float


class SlotBook:
    """Slots, the buffer of the iterations in flight (host numpy, plus a device tensor for
    device statistics), and the ring."""

    def __init__(self, window: int, every: int, capacity: int = 256) -> None:
        self.every = every
        self.slots: dict[tuple[CaptureSite, int | None], int] = {}
        self.slot_site: list[int] = []          # slot -> site index
        self.slot_sample: list[int | None] = []  # slot -> micro-batch
        self.sites: list[SiteInfo] = []
        self._site_index: dict[CaptureSite, int] = {}
        self._alloc(capacity)
        self.dev: torch.Tensor | None = None      # [every, capacity, N_STATS] on the device
        self.ring: deque[IterStats] = deque(maxlen=window)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.buf = np.zeros((self.every, capacity, WIDTH))
        self.buf[..., :N_STATS] = EMPTY_ROW
        self.host = self.buf[..., :N_STATS]        # views of buf: statistics, count, seen
        self.count = self.buf[..., COUNT]
        self.seen = self.buf[..., SEEN]
        self.on_dev = np.zeros((self.every, capacity), dtype=bool)
        self._host_address = self.buf.ctypes.data     # where the CPU kernel writes a slot

    def host_address(self, plane: int, slot: int) -> int:
        """The address of ``buf[plane, slot]`` (WIDTH float64 values, C order)."""
        return self._host_address + (plane * self.capacity + slot) * SLOT_BYTES

    def _grow(self) -> None:
        old, old_dev, n = self.buf, self.on_dev, self.capacity
        self._alloc(self.capacity * 2)
        self.buf[:, :n], self.on_dev[:, :n] = old, old_dev
        if self.dev is not None:
            extra = torch.zeros((self.every, n, N_STATS), dtype=self.dev.dtype,
                                device=self.dev.device)
            self.dev = torch.cat([self.dev, extra], dim=1)

    def __len__(self) -> int:
        return len(self.slot_site)

    def new_slot(self, site: CaptureSite, sample: int | None, info: dict[str, Any]) -> int:
        """A slot for (site, micro-batch), its site described by ``info`` on first sight."""
        idx = self._site_index.get(site)
        if idx is None:
            idx = self._site_index[site] = len(self.sites)
            self.sites.append(SiteInfo(site=site, index=idx, **info))
        slot = len(self.slot_site)
        if slot >= self.capacity:
            self._grow()
        self.slots[(site, sample)] = slot
        self.slot_site.append(idx)
        self.slot_sample.append(sample)
        return slot

    def device_buffer(self, device: torch.device) -> torch.Tensor:
        if self.dev is None or self.dev.device != device:
            self.dev = torch.zeros((self.every, self.capacity, N_STATS), dtype=torch.float64,
                                   device=device)
        return self.dev

    def collect(self, iterations: list[int], losses: list[float]) -> list[IterStats]:
        """The buffer's iterations on the host (one copy of the device buffer when any slot
        was computed there), pushed into the ring and returned; the buffer starts afresh."""
        n = len(self)
        if self.on_dev[:, :n].any() and self.dev is not None:
            dev = self.dev[:, :n].cpu().numpy()
            mask = self.on_dev[:, :n]
            self.host[:, :n][mask] = dev[mask]
        out = []
        for p, (it, loss) in enumerate(zip(iterations, losses)):
            plane = self.buf[p, :n].copy()               # one copy; the fields are views of it
            entry = IterStats(it, plane[:, :N_STATS], plane[:, COUNT], plane[:, SEEN] > 0, loss)
            self.ring.append(entry)
            out.append(entry)
        self.buf[..., :N_STATS] = EMPTY_ROW
        self.buf[..., N_STATS:] = 0.0
        self.on_dev[:] = False
        return out

    def merged(self, entry: IterStats) -> dict[str, np.ndarray]:
        """One iteration's statistics per site, merged over micro-batches with
        each schema.REC_STAT_ROWS row's merge from its identity (sums add, min / max take
        theirs, counts add); ``micro_batches``:
        how many were seen."""
        sites = len(self.sites)
        seen = entry.seen
        idx = np.asarray(self.slot_site[:len(seen)], dtype=np.int64)[seen]
        out: dict[str, np.ndarray] = {"micro_batches": np.bincount(idx, minlength=sites)}
        columns = [(schema.REC_COUNT, entry.count[seen]),
                   *((r, entry.stats[seen, i]) for i, r in enumerate(schema.REC_STAT_ROWS))]
        for row, values in columns:
            acc = np.full(sites, row.identity)
            _UFUNC[row.merge].at(acc, idx, values)
            out[row.name] = acc
        return out

    def first_nonfinite(self, entry: IterStats) -> int | None:
        """The first slot (execution order) with a NaN or Inf in ``entry``, or None."""
        bad = entry.seen & ((entry.stats[:, NAN] + entry.stats[:, INF]) > 0)
        hits = np.flatnonzero(bad)
        return int(hits[0]) if hits.size else None


_UFUNC = {"sum": np.add, "min": np.minimum, "max": np.maximum}
