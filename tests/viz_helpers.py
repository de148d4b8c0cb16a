"""Test data for the viz tests: capture directories written by the real saver
(tensor_capture.saver.TensorSaver, standalone with an explicit directory), plus files the
way older runs and the seeds wrote them (no manifest, no stored statistics).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from tensor_capture import schema
from tensor_capture.saver import TensorSaver

ATTN = (("query", (8, 2, 4, 16)), ("key", (8, 2, 4, 16)), ("value", (8, 2, 4, 16)), ("context", (8, 2, 64)))
LINEAR_FWD = (("input", (8, 2, 64)), ("weight", (64, 64)), ("output", (8, 2, 64)))
LINEAR_BWD = (("grad_output", (8, 2, 64)), ("grad_input", (8, 2, 64)))
RANGE_FORMATS = ("fp8_e4m3", "hifp8")


def saver_for(directory: Path, **config) -> TensorSaver:
    return TensorSaver(enabled=True, save_dir=str(directory), range_formats=RANGE_FORMATS, **config)


def _save(saver: TensorSaver, t: torch.Tensor, *, layer_type="linear", operation="forward",
          tensor_name="input", quant_type="hifp8", layer_idx=0, phase="pre", component=None,
          iteration=0, rank=0, sample_idx=0, variant="hp") -> Path:
    sub = "linear_fc1" if layer_type == "linear" else "core_attention"
    path = saver.save_tensor(
        t, layer_type, operation, quant_type=quant_type, tensor_name=tensor_name, layer_idx=layer_idx,
        phase=phase, component=component or ("FA" if layer_type == "attention" else "linear"), rank=rank,
        sample_idx=sample_idx, iteration=iteration, module_path=f"decoder.layers.{layer_idx}.{sub}",
        submodule=sub, variant=variant)
    assert path, "the saver did not capture the tensor"
    return Path(path)


def write_tensor(directory: Path, t: torch.Tensor, **fields) -> Path:
    """One tensor through the real saver (file + metadata + stats + manifest record)."""
    saver = saver_for(directory)
    try:
        return _save(saver, t, **fields)
    finally:
        saver.close()


def write_plain(directory: Path, t: torch.Tensor, counter: int = 1, **fields) -> Path:
    """A file as an older run wrote it: current name, {"tensor", "metadata"} without stats, no manifest."""
    defaults = dict(layer_type="linear", operation="forward", tensor_name="input", quant_type="hifp8",
                    layer_idx=0, phase="pre", component="linear", iteration=0, rank=0, sample_idx=0,
                    timestamp="20250908_092156", counter=counter)
    defaults.update(fields)
    name = schema.TensorName(**defaults)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / schema.build_filename(name)
    torch.save({"tensor": t, "metadata": name.to_dict()}, path)
    return path


def make_capture(directory: Path, *, quant_types=("hifp8", "mxfp8", "fp8_e4m3", "bf16"), iterations=(0, 1),
                 layers=(0, 1), ranks=(0,), pairs: bool = True, seed: int = 0) -> list[Path]:
    """A small capture run: attention + linear, forward + backward, several formats/iterations."""
    g = torch.Generator().manual_seed(seed)
    paths = []
    saver = saver_for(directory)
    try:
        for qt in quant_types:
            dtype = torch.bfloat16 if qt == "bf16" else torch.float32
            for it in iterations:
                for layer in layers:
                    for rank in ranks:
                        specs = [("attention", "forward", n, s) for n, s in ATTN]
                        specs += [("linear", "forward", n, s) for n, s in LINEAR_FWD]
                        specs += [("linear", "backward", n, s) for n, s in LINEAR_BWD]
                        for layer_type, op, tname, shape in specs:
                            scale = (1e-4 if op == "backward" else 1.0) * (1 + layer + 0.5 * it)
                            t = torch.randn(shape, generator=g) * scale
                            if tname == "output":
                                t[0, 0, :4] = 600.0 * (1 + it)    # outliers beyond E4M3's 448
                            common = dict(layer_type=layer_type, operation=op, tensor_name=tname, quant_type=qt,
                                          layer_idx=layer, iteration=it, rank=rank)
                            paths.append(_save(saver, t.to(dtype), **common))
                            if pairs and tname == "input" and op == "forward":
                                q = t.to(torch.bfloat16).to(dtype)
                                common["tensor_name"] = "input_quantized"    # the capture's naming
                                paths.append(_save(saver, q, variant="quantized", **common))
    finally:
        saver.close()
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


class DevTools:
    """Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe:
    commands on the child's fd 3, replies on fd 4, each a JSON text ended by NUL), so a test can
    move the real mouse pointer and read what the page then shows; no websocket library needed.
    Collects exceptions, console errors and log errors (e.g. a failed image load) as ``errors``."""

    def __init__(self, chromium: str, profile: Path, timeout: float = 60.0):
        import subprocess

        self.timeout = timeout
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def fds():  # in the child, before exec: the pipe ends at 3 and 4 (inheritable)
            import fcntl

            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_child_r, from_child_w)]
            for target, fd in zip((3, 4), high):
                os.dup2(fd, target)

        self.proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             "--disable-background-networking", "--disable-component-update", "--no-first-run",
             f"--user-data-dir={profile}", "--allow-file-access-from-files", "about:blank"],
            preexec_fn=fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._id = 0
        self.errors: list[str] = []
        self.session = None
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"],
                                 flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")

    def _read(self) -> dict:
        import json
        import select

        while b"\0" not in self._buf:
            ready, _, _ = select.select([self._from_child], [], [], self.timeout)
            assert ready, "Chromium did not answer over the DevTools pipe"
            chunk = os.read(self._from_child, 1 << 16)
            assert chunk, "Chromium closed the DevTools pipe"
            self._buf += chunk
        text, self._buf = self._buf.split(b"\0", 1)
        msg = json.loads(text)
        method = msg.get("method")
        params = msg.get("params", {})
        if method == "Runtime.exceptionThrown":
            self.errors.append("exception: " + str(params["exceptionDetails"].get("text")))
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value")) for a in params["args"]))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            self.errors.append("log: " + params["entry"].get("text", ""))
        return msg

    def call(self, method: str, **params) -> dict:
        import json

        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if self.session:
            msg["sessionId"] = self.session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply.get("result", {})

    def wait_event(self, method: str) -> dict:
        while True:
            msg = self._read()
            if msg.get("method") == method:
                return msg.get("params", {})

    def open(self, path: Path) -> None:
        self.call("Page.navigate", url=path.resolve().as_uri())
        self.wait_event("Page.loadEventFired")

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def hover(self, x: float, y: float) -> None:
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except AssertionError:
            pass
        try:
            self.proc.wait(timeout=20)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_child)
        os.close(self._from_child)
