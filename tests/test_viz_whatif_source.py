"""The report shows the what-if numbers capture stored, and recomputes only what capture did not
store, on the axis capture used, saying so (issue 42 item 1).

Two captures of the same tensors by the real saver: one stores what-if numbers at every
iteration (the truth), the other at every second iteration only (whatif_every: 2), as a run
over its what-if budget does. The report of the second must show the numbers of its manifest
where it has them and, for the iteration capture skipped, exactly the numbers the first capture
stored: the same computation along the same GEMM reduction axis (axis 0 for the dgrad weight).
"""
from __future__ import annotations

import csv
import math
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from viz_helpers import saver_for

from quant.formats import WHATIF_FORMATS
from tensor_capture import schema
from tensor_viz import numerics_data, pipeline

#: (layer type, pass, tensor, shape, GEMM reduction axis as the capture hooks pass it)
SPECS = (("linear", "forward", "input", (8, 2, 64), -1),
         ("linear", "backward", "weight", (64, 48), 0),     # dgrad's weight: along out-features
         ("attention", "forward", "value", (16, 2, 2, 32), 0))
ITERATIONS, LAYERS = (0, 1), (0, 1)


def _capture(directory: Path, every: int) -> None:
    g = torch.Generator().manual_seed(3)
    saver = saver_for(directory, whatif_formats=WHATIF_FORMATS, whatif_every=every,
                      whatif_budget="unlimited")
    try:
        for it in ITERATIONS:
            for layer in LAYERS:
                for layer_type, op, name, shape, axis in SPECS:
                    t = torch.randn(shape, generator=g) * (1 + layer)
                    t.view(-1)[:: 29 + it] *= 40.0
                    sub = "linear_fc1" if layer_type == "linear" else "core_attention"
                    assert saver.save_tensor(
                        t, layer_type, op, quant_type="bf16", tensor_name=name, layer_idx=layer,
                        phase="pre", component="linear" if layer_type == "linear" else "FA",
                        rank=0, sample_idx=0, iteration=it, submodule=sub,
                        module_path=f"decoder.layers.{layer}.{sub}", whatif_axis=axis)
    finally:
        saver.close()


def _key(r: dict) -> tuple:
    return (r["layer_type"], r["operation"], r["tensor_name"], r["layer_idx"], r["iteration"])


def _manifest(directory: Path) -> dict[tuple, dict]:
    return {_key(r): r for r in schema.read_manifest(directory)}


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    root = tmp_path_factory.mktemp("whatif_source")
    _capture(root / "truth", every=1)
    _capture(root / "cap", every=2)
    opts = pipeline.Options(workers=1, progress=False, sample_size=256)   # --whatif: default
    result = pipeline.build(root / "cap", root / "out", ("whatif_numerics",), opts)
    return root, result


def test_report_shows_the_manifest_numbers_and_recomputes_the_rest_on_capture_s_axis(reported):
    root, result = reported
    truth, manifest = _manifest(root / "truth"), _manifest(root / "cap")
    assert {k[-1] for k, r in manifest.items() if schema.META_WHATIF in r} == {0}   # every 2nd
    table = result.dataset.numerics
    assert numerics_data.formats(table) == list(WHATIF_FORMATS)     # the capture's own set
    seen = set()
    for r in table:
        k = _key(r)
        stored = manifest[k].get(schema.META_WHATIF)
        if stored is not None:          # shown as capture stored it
            assert r["source"] == numerics_data.SOURCE_CAPTURE
            want = stored[schema.WHATIF_FORMATS][r["format"]]
        else:                           # recomputed: exactly what capture computes there
            assert r["source"] == numerics_data.SOURCE_RECOMPUTED
            want = truth[k][schema.META_WHATIF][schema.WHATIF_FORMATS][r["format"]]
        assert r["axis"] == dict((s[:3], s[4]) for s in SPECS)[k[:3]]
        assert r["sqnr_db"] == float(want["sqnr_db"]), (k, r["format"])
        assert r["rel_error"] == float(want["rel_error"]), (k, r["format"])
        seen.add((k, r["format"]))
    assert len(seen) == len(manifest) * len(WHATIF_FORMATS)


def test_per_layer_sqnr_is_the_manifest_s_and_recomputed_cells_say_so(reported):
    root, result = reported
    from tensor_viz.report import largest_error_per_layer

    truth, manifest = _manifest(root / "truth"), _manifest(root / "cap")
    worst: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(lambda: math.inf))
    origin: dict[tuple[str, str], dict[float, bool]] = defaultdict(dict)
    for k, rec in manifest.items():
        layer = f"L{rec['layer_idx']} {rec[schema.META_SUBMODULE]}"
        whatif = rec.get(schema.META_WHATIF) or truth[k][schema.META_WHATIF]
        for fmt, num in whatif[schema.WHATIF_FORMATS].items():
            v = float(num["sqnr_db"])
            worst[layer][fmt] = min(worst[layer][fmt], v)
            origin[(layer, fmt)][v] = schema.META_WHATIF not in rec
    got = numerics_data.worst_per_layer(result.dataset.numerics)
    assert sorted(got) == sorted(worst)
    for layer, fmts in worst.items():
        for fmt, v in fmts.items():
            assert got[layer][fmt]["sqnr_db"] == v, (layer, fmt)
    cells = largest_error_per_layer(result.dataset)
    for row in cells["rows"]:
        for fmt, cell in zip(cells["formats"], row["cells"]):
            w = worst[row["layer"]][fmt]
            assert cell["text"].startswith(f"{w:.1f} dB") or not math.isfinite(w)
            assert cell["recomputed"] == origin[(row["layer"], fmt)][w], (row["layer"], fmt)
    page = (root / "out" / "index.html").read_text()
    assert ("(recomputed)" in page) == any(c["recomputed"] for r in cells["rows"] for c in r["cells"])
    with open(root / "out" / "numerics.csv", newline="") as fh:
        sources = {(r["iteration"], r["source"]) for r in csv.DictReader(fh)}
    assert sources == {("0", "capture"), ("1", "recomputed")}
