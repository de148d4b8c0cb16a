"""The flight recorder's summary file: the writer gathers one array per iteration (not Python
values per site), and the file it writes is the file of the row-by-row definition (one row per
iteration and site seen, micro-batches merged, the site's naming columns, counts as integers),
column types included: a naming column with no value in any of the file's rows stays of type null."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tensor_capture import schema
from tensor_capture.recorder.out import SummaryWriter, write_summary_table
from tensor_capture.recorder.ring import SlotBook
from tensor_capture.recorder.stats import N_STATS


def _site(i: int) -> schema.CaptureSite:
    """Sites 0 and 1 have no layer index and no module path (an unknown module), the rest do."""
    known = i >= 2
    return schema.CaptureSite(layer_type="linear", operation="forward", phase="pre",
                              tensor_name=f"t{i}", component="linear",
                              layer_idx=i if known else None,
                              module_path=f"decoder.layers.{i}.mlp" if known else None)


def _reference(book: SlotBook, entries: list, rank: int) -> pa.Table:
    """The definition, one row at a time: each site seen in an iteration, its micro-batches
    merged (schema.REC_MERGE), as Python values."""
    rows: dict[str, list] = {k: [] for k in schema.REC_SUMMARY_COLUMNS}
    for entry in entries:
        for site_index, info in enumerate(book.sites):
            slots = [s for s in range(len(entry.seen))
                     if entry.seen[s] and book.slot_site[s] == site_index]
            if not slots:
                continue
            s = info.site
            named = {"iteration": entry.iteration, "rank": rank, "site": info.index,
                     "module_path": s.module_path, "layer_type": s.layer_type,
                     "layer_idx": s.layer_idx, "operation": s.operation, "phase": s.phase,
                     "tensor_name": s.tensor_name, "variant": s.variant,
                     "quant_type": info.quant_type, "micro_batches": len(slots),
                     "count": int(sum(entry.count[slots]))}
            for i, key in enumerate(schema.REC_STATS):
                values = [float(entry.stats[slot, i]) for slot in slots]
                how = {"sum": sum, "min": min, "max": max}[schema.REC_MERGE[key]]
                named[key] = int(how(values)) if key.endswith("_count") else how(values)
            for key, value in named.items():
                rows[key].append(value)
    return pa.table(rows)


def _iteration(book: SlotBook, it: int, seen: list[tuple[int, int]],
               rng: np.random.Generator) -> list:
    """One iteration with (site, micro-batch) pairs ``seen`` given random rows; its entry."""
    for site, mb in seen:
        slot = book.slots.get((_site(site), mb))
        if slot is None:
            slot = book.new_slot(_site(site), mb, {"quant_type": "fp32", "fmt": None,
                                                   "dtype": "torch.float32", "shape": [8]})
        row = rng.standard_normal(N_STATS)
        row[4:] = rng.integers(0, 9, N_STATS - 4)          # the counts are whole numbers
        book.host[0, slot] = row
        book.count[0, slot] = float(rng.integers(1, 1000))
        book.seen[0, slot] = True
    return book.collect([it], [float(it)])


def test_the_summary_file_is_the_row_by_row_definition(tmp_path):
    rng = np.random.default_rng(0)
    book = SlotBook(window=3, every=1)
    writer = SummaryWriter(tmp_path, rank=3, every=3, keep=1000)
    # file 1: only the unknown sites (layer_idx and module_path null in every row), one of
    # them in one micro-batch only, none in iteration 2; file 2: new sites with a layer index
    plan = {0: [(0, 0), (0, 1), (1, 0)], 1: [(1, 0), (1, 1), (0, 1)], 2: [],
            3: [(2, 0), (3, 0), (3, 1)], 4: [(0, 0), (3, 1), (4, 0), (4, 1)]}
    files, entries = [], {0: [], 1: []}
    for it, seen in plan.items():
        for entry in _iteration(book, it, seen, rng):
            writer.add(book, entry)
            entries[0 if it < 3 else 1].append(entry)
        if writer.due() or it == max(plan):
            files.append(writer.write())
    assert len(files) == 2
    for path, part in zip(files, (0, 1)):
        want = write_summary_table(_reference(book, entries[part], 3), tmp_path / "ref.parquet")
        got, ref = pq.read_table(path), pq.read_table(want)
        assert got.schema.equals(ref.schema), (got.schema, ref.schema)
        assert got.equals(ref)
    assert pq.read_table(files[0]).schema.field("layer_idx").type == pa.null()
    assert pq.read_table(files[1]).schema.field("layer_idx").type == pa.int64()


def test_iterations_without_a_site_seen_write_no_summary_file_but_their_losses(tmp_path):
    """A rank that records nothing (its pipeline stage holds none of the selected layers)
    writes no summary file, and no error; its losses still go to the loss file."""
    book = SlotBook(window=3, every=1)
    writer = SummaryWriter(tmp_path, rank=0, every=2, keep=1000)
    for it in range(2):
        for entry in _iteration(book, it, [], np.random.default_rng(it)):
            writer.add(book, entry)
    assert writer.due() and writer.write() is None
    assert list(tmp_path.glob("*.parquet")) == []
    assert len((tmp_path / schema.recorder_loss_name(0)).read_text().splitlines()) == 2


def test_a_recorder_statistic_is_one_row_its_index_identity_and_merge_derived():
    """schema.REC_STAT_ROWS is the one definition: the row of an empty tensor is each row's
    identity (what every path and the slot buffer start from), a merge over micro-batches starts
    from it (an unseen micro-batch changes nothing), and every path addresses a statistic by its
    row's index, on a tensor whose statistics are known exactly."""
    import math

    import torch

    from tensor_capture.recorder import stats as rec_stats

    rows = schema.REC_STAT_ROWS
    assert rec_stats.EMPTY_ROW == tuple(r.identity for r in rows)
    assert schema.REC_MERGE == {"count": "sum", **{r.name: r.merge for r in rows}}
    merge = {"sum": lambda a, b: a + b, "min": min, "max": max}
    values = [3.0, -2.0, 5.0, 7.0, 1.0, 0.0, 4.0, 2.0]
    assert [merge[r.merge](r.identity, v) for r, v in zip(rows, values)] == values
    x = torch.tensor([1.0, -2.0, 3.0, float("inf"), float("nan"), 1e-30])
    fmt = rec_stats.judged_format("fp8_e4m3", torch.float32)
    want = {"sum": 2.0 + 1e-30, "sumsq": 14.0 + 1e-60, "min": -2.0, "max": 3.0,
            "nan_count": 1.0, "inf_count": 1.0, "flush_count": 1.0, "saturation_count": 1.0}
    for row in (rec_stats.host_row(x, fmt), rec_stats.device_row(x, fmt).tolist()):
        assert {r.name: row[i] for i, r in enumerate(rows)} == want     # exact: 1e-30 < ulp(2)
    named = {"SUM": "sum", "SUMSQ": "sumsq", "MIN": "min", "MAX": "max", "NAN": "nan_count",
             "INF": "inf_count", "FLUSH": "flush_count", "SAT": "saturation_count"}
    assert {k: schema.REC_STATS[getattr(rec_stats, k)] for k in named} == named
    assert not any(math.isnan(v) for v in rec_stats.EMPTY_ROW)
