"""The writer thread appends the records it finished since its queue was last empty in one
manifest write (tensor_capture.writer.MANIFEST_BATCH): lines whole and in submission order,
each record's callbacks only once its line is in the manifest, flush waiting for the lines."""
from __future__ import annotations

import threading

import torch

from tensor_capture import schema, stats, writer
from tensor_capture.writer import BackgroundWriter, WriteItem


def _item(tmp_path, i: int, done=None) -> WriteItem:
    x = torch.arange(4, dtype=torch.float32) + i
    ranges = (stats.dtype_range(torch.float32),)
    return WriteItem(tmp_path, 0, None, None, None, ranges, {"i": i}, done=done,
                     stats_src=x)


def test_a_backlog_goes_to_the_manifest_in_one_write_in_order(tmp_path, monkeypatch):
    writes: list[int] = []
    real = schema.append_manifest

    def counted(directory, rank, *records):
        writes.append(len(records))
        real(directory, rank, *records)

    monkeypatch.setattr(schema, "append_manifest", counted)
    entered, release, published = threading.Event(), threading.Event(), []
    lines_at_callback: list[int] = []

    def first_done():             # holds the writer until the backlog is queued
        entered.set()
        release.wait(timeout=30)

    def on_record(record):
        published.append(record["i"])
        lines_at_callback.append(len(list(schema.read_manifest(tmp_path))))

    w = BackgroundWriter(queue_size=64, on_record=on_record)
    w.submit(_item(tmp_path, 0, first_done))
    assert entered.wait(timeout=30)
    for i in range(1, 21):
        w.submit(_item(tmp_path, i))
    release.set()
    w.flush()                      # returns only once every line is written
    records = list(schema.read_manifest(tmp_path))
    w.close()
    assert [r["i"] for r in records] == list(range(21)) == published
    assert records[5]["stats"]["max"] == 5 + 3 and records[5][schema.MANIFEST_FILE] is None
    # 5, 6, 7 in binade 2, 8 in binade 3: the histogram's nonzero span, as integers
    hist = records[5]["stats"]["log2_hist"]
    assert hist == {"min_exp": 2, "counts": [3, 1]} and {type(c) for c in hist["counts"]} == {int}
    assert writes[0] == 1 and sum(writes) == 21 and len(writes) < 21   # the backlog batched
    assert all(n >= k + 1 for k, n in enumerate(lines_at_callback))   # line before callback


def test_batches_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "MANIFEST_BATCH", 3)
    writes: list[int] = []
    real = schema.append_manifest
    monkeypatch.setattr(schema, "append_manifest",
                        lambda d, r, *recs: (writes.append(len(recs)), real(d, r, *recs)))
    release = threading.Event()
    w = BackgroundWriter(queue_size=64)
    w.submit(_item(tmp_path, 0, lambda: release.wait(timeout=30)))
    for i in range(1, 11):
        w.submit(_item(tmp_path, i))
    release.set()
    w.close()
    assert max(writes) == 3 and sum(writes) == 11
    assert [r["i"] for r in schema.read_manifest(tmp_path)] == list(range(11))
