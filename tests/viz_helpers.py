"""Test data for the viz tests: capture directories shaped like real capture output.

Files are written the way the saver writes them ({"tensor", "metadata"} via torch.save,
names from schema.build_filename, one manifest line per file with whole-tensor stats).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from tensor_capture import schema
from tensor_viz.formats import format_limits
from tensor_viz.stats import stats_from_values

ATTN = (("query", (8, 2, 4, 16)), ("key", (8, 2, 4, 16)), ("value", (8, 2, 4, 16)), ("context", (8, 2, 64)))
LINEAR_FWD = (("input", (8, 2, 64)), ("weight", (64, 64)), ("output", (8, 2, 64)))
LINEAR_BWD = (("grad_output", (8, 2, 64)), ("grad_input", (8, 2, 64)))


def write_tensor(directory: Path, t: torch.Tensor, *, manifest: bool = True, counter: int = 1,
                 variant: str = "hp", extra_meta: dict | None = None, **fields) -> Path:
    """Save one tensor like the saver: file, metadata, and (optionally) a manifest record."""
    defaults = dict(layer_type="linear", operation="forward", tensor_name="input", quant_type="hifp8",
                    layer_idx=0, phase="pre", component="linear", iteration=0, rank=0, sample_idx=0,
                    timestamp="20250908_092156", counter=counter)
    defaults.update(fields)
    name = schema.TensorName(**defaults)
    fname = schema.build_filename(name)
    limits = {k: lim for k in {name.quant_type, str(t.dtype), "fp8_e4m3"} if (lim := format_limits(k))}
    stats = stats_from_values(t, limits)
    meta = name.to_dict()
    meta.update({schema.META_SHAPE: list(t.shape), schema.META_DTYPE: str(t.dtype), schema.META_VARIANT: variant,
                 schema.META_MODULE_PATH: f"decoder.layers.{name.layer_idx}.{name.layer_type}",
                 schema.META_SUBMODULE: "linear_fc1" if name.layer_type == "linear" else "core_attention",
                 schema.META_STATS: stats})
    meta.update(extra_meta or {})
    directory.mkdir(parents=True, exist_ok=True)
    torch.save({"tensor": t, "metadata": meta}, directory / fname)
    if manifest:
        schema.append_manifest(directory, name.rank, dict(meta, **{schema.MANIFEST_FILE: fname}))
    return directory / fname


def make_capture(directory: Path, *, quant_types=("hifp8", "mxfp8", "fp8_e4m3", "bf16"), iterations=(0, 1), layers=(0, 1),
                 ranks=(0,), manifest: bool = True, pairs: bool = True, seed: int = 0) -> list[Path]:
    """A small capture run: attention + linear, forward + backward, several formats/iterations."""
    g = torch.Generator().manual_seed(seed)
    paths = []
    counter = 0
    for qt in quant_types:
        dtype = torch.bfloat16 if qt == "bf16" else torch.float32
        for it in iterations:
            for layer in layers:
                for rank in ranks:
                    specs = [("attention", "forward", n, s) for n, s in ATTN]
                    specs += [("linear", "forward", n, s) for n, s in LINEAR_FWD]
                    specs += [("linear", "backward", n, s) for n, s in LINEAR_BWD]
                    for layer_type, op, tname, shape in specs:
                        counter += 1
                        scale = (1e-4 if op == "backward" else 1.0) * (1 + layer + 0.5 * it)
                        t = (torch.randn(shape, generator=g) * scale)
                        if tname == "output":
                            t[0, 0, :4] = 600.0 * (1 + it)    # outliers beyond E4M3's 448
                        paths.append(write_tensor(
                            directory, t.to(dtype), manifest=manifest, counter=counter, layer_type=layer_type,
                            operation=op, tensor_name=tname, quant_type=qt, layer_idx=layer, iteration=it,
                            rank=rank, component="FA" if layer_type == "attention" else "linear"))
                        if pairs and tname == "input" and op == "forward":
                            counter += 1
                            q = t.to(torch.bfloat16).to(dtype)
                            paths.append(write_tensor(
                                directory, q, manifest=manifest, counter=counter, layer_type=layer_type,
                                operation=op, tensor_name=tname, quant_type=qt, layer_idx=layer, iteration=it,
                                rank=rank, variant="quantized"))
    return paths


class Evil:
    """A pickle that would run code when loaded without weights_only."""

    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/viz_test_pwned",))


CHECK_SCRIPT = """<script>
window.__errs = [];
window.addEventListener('error', function (e) {
  var t = e.target; window.__errs.push('error: ' + ((t && (t.src || t.href)) || e.message));
}, true);
var __ce = console.error;
console.error = function () { window.__errs.push('console: ' + Array.prototype.join.call(arguments, ' ')); };
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var bad = imgs.filter(function (i) { return !(i.complete && i.naturalWidth > 0); })
                .map(function (i) { return i.getAttribute('src'); });
  var out = document.createElement('pre');
  out.id = 'viz-check';
  out.textContent = JSON.stringify({images: imgs.length, bad: bad, errors: window.__errs});
  document.body.appendChild(out);
});
</script>"""


def browser_check(index: Path, chromium: str, profile: Path, timeout: float = 90.0) -> dict:
    """Open a copy of ``index`` (same folder, so relative paths hold) with a checking script in
    headless Chromium; returns {"images", "bad", "errors"} that the page itself reported."""
    import json
    import re
    import subprocess

    page = index.read_text(encoding="utf-8")
    assert "<script" not in page.lower(), "the report must not need scripts"
    probe = index.with_name("_browser_check.html")
    probe.write_text(page.replace("<head>", "<head>" + CHECK_SCRIPT, 1), encoding="utf-8")
    try:
        proc = subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--no-first-run", f"--user-data-dir={profile}",
             "--allow-file-access-from-files", "--virtual-time-budget=20000", "--dump-dom",
             probe.resolve().as_uri()],
            capture_output=True, text=True, timeout=timeout)
    finally:
        probe.unlink()
    m = re.search(r'<pre id="viz-check">(.*?)</pre>', proc.stdout, re.S)
    assert m, f"page did not finish loading: rc={proc.returncode} stderr={proc.stderr[-500:]}"
    import html as _html

    return json.loads(_html.unescape(m.group(1)))
