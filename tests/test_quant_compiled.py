"""The torch.compile path gives bit-identical results to the eager kernels.

Compiles a handful of kernels once (static shapes); skipped only where torch.compile cannot work
on this machine (then quantize itself falls back to eager, which the other tests cover).
"""
import numpy as np
import pytest
import torch

import quant
from quant import accel, cpu_blocks

CASES = [("fp8_e4m3", {}), ("hifp8", {}), ("mxfp8", {"scale_mode": "rceil"}),
         ("nvfp4", {}), ("fp8_e5m2_tensor", {})]


@pytest.fixture(autouse=True)
def _inductor_kernels(monkeypatch):
    """These tests are of the Inductor kernels: the C block kernels (quant.cpu_blocks, tested
    in test_quant_cpu_blocks.py) would take the MX and NVFP4 tensors; they stand aside."""
    monkeypatch.setattr(cpu_blocks.CPU_BLOCKS, "error", RuntimeError("Inductor tested here"))


def _inputs():
    g = np.random.default_rng(0)
    bits = g.integers(0, 2 ** 32, size=64 * 1024, dtype=np.uint32).view(np.float32)
    x = torch.from_numpy(bits.copy()).reshape(64, 1024)
    normal = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))
    normal[3, 7] = float("inf")
    normal[5, 100] = float("nan")
    return {"bits": x, "normal": normal * 3}


@pytest.mark.parametrize("name,kw", CASES)
def test_compiled_equals_eager(name, kw, monkeypatch):
    monkeypatch.setenv("QUANT_COMPILE", "0")
    data = _inputs()
    eager = {k: quant.quantize(v, name, **kw) for k, v in data.items()}
    monkeypatch.setenv("QUANT_COMPILE", "1")
    comp = {k: quant.quantize(v, name, **kw) for k, v in data.items()}
    if accel.compile_error() is not None:
        pytest.skip(f"torch.compile unavailable here: {accel.compile_error()!r}")
    for k in data:
        a, b = eager[k], comp[k]
        assert torch.equal(a.isnan(), b.isnan()), k
        m = ~a.isnan()
        assert torch.equal(a[m].view(torch.int32), b[m].view(torch.int32)), k


def _compiled_keys(name):
    spec = quant.get_format(name)
    return [k for k in accel.COMPILE.kernels if k[1][0].spec == spec]


def test_background_compile_takes_over_without_recompiling(monkeypatch):
    """auto mode: eager until the kernel is hot, then one background compile whose graph serves
    every shape (a recompile would raise under fail_on_recompile and disable compiling), with
    the eager kernel's bits."""
    monkeypatch.setenv("QUANT_COMPILE", "auto")
    monkeypatch.setenv("QUANT_COMPILE_MIN_NUMEL", "100")
    monkeypatch.setenv("QUANT_COMPILE_AFTER", "2")
    for name, fresh in (("kernels", {}), ("queued", set()), ("calls", {})):
        monkeypatch.setattr(accel.COMPILE, name, fresh)
    g = torch.Generator().manual_seed(4)
    first = torch.randn(40, 64, generator=g)
    for name in ("fp8_e5m2", "mxfp6_e3m2"):
        quant.quantize(first, name)
        assert accel.wait_for_background(600)
        assert not _compiled_keys(name)                      # one call: not hot yet
        quant.quantize(first, name)
        assert accel.wait_for_background(600)
        if accel.compile_error() is not None:
            pytest.skip(f"torch.compile unavailable here: {accel.compile_error()!r}")
        assert _compiled_keys(name)
        inputs = [torch.randn(*s, generator=g) * 100 for s in
                  [(5000,), (3, 70, 129), (1, 4096), (257, 33)]]
        with torch.compiler.set_stance("fail_on_recompile"):
            compiled_out = [quant.quantize(x, name) for x in inputs]
        assert accel.compile_error() is None
        monkeypatch.setenv("QUANT_COMPILE", "0")
        for x, y in zip(inputs, compiled_out):
            ref = quant.quantize(x, name)
            assert torch.equal(y.view(torch.int32), ref.view(torch.int32)), (name, x.shape)
        monkeypatch.setenv("QUANT_COMPILE", "auto")


def test_blocks_in_place_serve_every_row_and_inner_length(monkeypatch):
    """Blocks along an inner axis ([rows, block, inner]): the rows and the inner length are
    dynamic, the block fixed, so one compiled graph serves other shapes without recompiling,
    with the eager kernel's bits."""
    monkeypatch.setenv("QUANT_COMPILE", "1")
    g = torch.Generator().manual_seed(5)
    quant.quantize(torch.randn(64, 40, generator=g), "mxfp8", axis=0)
    if accel.compile_error() is not None:
        pytest.skip(f"torch.compile unavailable here: {accel.compile_error()!r}")
    inputs = [torch.randn(*s, generator=g) * 50 for s in [(96, 7), (32, 129), (2, 64, 33)]]
    with torch.compiler.set_stance("fail_on_recompile"):
        compiled_out = [quant.quantize(x, "mxfp8", axis=-2) for x in inputs]
    assert accel.compile_error() is None
    monkeypatch.setenv("QUANT_COMPILE", "0")
    for x, y in zip(inputs, compiled_out):
        ref = quant.quantize(x, "mxfp8", axis=-2)
        assert torch.equal(y.view(torch.int32), ref.view(torch.int32)), x.shape


def test_bit_casts_are_vector_register_moves():
    """With quant.inductor_vec installed, Inductor's C++ kernel reinterprets float32 and int32
    vectors in registers (at::vec::cast) instead of lane by lane through the stack, with the
    same bits as eager (exponent fields, powers of two built from bits)."""
    from torch._inductor.utils import run_and_get_code

    from quant import inductor_vec

    def exponent_power(x):
        bits = x.abs().view(torch.int32) & 0x7F800000
        return (x + bits.add(5 << 23).view(torch.float32)).view(torch.int32) >> 3

    if not inductor_vec.install():
        pytest.skip("this torch has no Inductor C++ bit-cast hook")
    from torch._inductor import cpu_vec_isa

    if not cpu_vec_isa.pick_vec_isa():      # e.g. ATEN_CPU_CAPABILITY=default: scalar C++
        pytest.skip("Inductor generates scalar C++ on this CPU setting: no vector casts to check")
    x = torch.randn(4096, generator=torch.Generator().manual_seed(6)) * 1e3
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):   # generate, never reuse
            got, code = run_and_get_code(torch.compile(exponent_power, dynamic=False), x)
    except Exception as exc:  # no C++ compiler: quant falls back to eager (other tests)
        pytest.skip(f"torch.compile unavailable here: {exc!r}")
    source = "\n".join(code)
    assert "at::vec::cast<int32_t>" in source and "at::vec::cast<float>" in source
    assert "c10::bit_cast<int32_t>(tmpbuf" not in source   # no lane-by-lane loop
    assert torch.equal(got, exponent_power(x))


def test_auto_mode_threshold(monkeypatch):
    monkeypatch.setenv("QUANT_COMPILE", "auto")
    monkeypatch.setenv("QUANT_COMPILE_MIN_NUMEL", "1000")
    if accel.compile_error() is None:
        assert accel.should_compile(1000) and not accel.should_compile(999)
        assert not accel.should_compile(10 ** 9, "cuda")  # auto: CPU only (CUDA unmeasured)
    monkeypatch.setenv("QUANT_COMPILE", "0")
    assert not accel.should_compile(10 ** 9)


def test_exit_during_a_background_compile_is_clean(tmp_path):
    """A process that ends while the background compile runs waits for it and exits 0 (torn
    down mid-compile, Inductor can abort the process in C++ teardown: exit 134)."""
    import os
    import subprocess
    import sys
    code = ("import torch, quant\n"
            "quant.quantize(torch.randn(64, 64), 'bf16')\n"
            "print('done', flush=True)\n")
    env = dict(os.environ, QUANT_COMPILE="auto", QUANT_COMPILE_AFTER="1",
               QUANT_COMPILE_MIN_NUMEL="100", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cold"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "done" in out.stdout


#: the scripts below quantize with formats whose float32 CPU casts Inductor compiles (bf16 and
#: the per-tensor family): the C kernels of quant.cpu_blocks take the other element formats, MX, NVFP4


def _run_script(code: str, tmp_path, **env):
    import os
    import subprocess
    import sys
    full = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TMPDIR=str(tmp_path),
                **env)
    full.pop("QUANT_COMPILE_AFTER", None)
    full.pop("QUANT_COMPILE_MIN_NUMEL", None)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          timeout=600)


def test_exit_after_many_quantize_calls_says_nothing(tmp_path):
    """A script whose kernel got hot (more than QUANT_COMPILE_AFTER calls) ends while its
    background compile runs: the compile is dropped, nothing on stderr, exit 0."""
    code = ("import torch, quant\n"
            "x = torch.randn(64, 1024)\n"
            "for _ in range(12):\n"
            "    quant.quantize(x, 'bf16')\n"
            "print('done', flush=True)\n")
    out = _run_script(code, tmp_path, QUANT_COMPILE="auto")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "done"
    assert out.stderr == ""


def test_a_real_compile_failure_is_one_line_and_results_stay_exact(tmp_path):
    """A compile that truly fails (no C++ compiler for Inductor) says once what failed and
    where the traceback is; every result stays bit-identical to the eager kernels."""
    code = ("import os, torch, quant\n"
            "from quant import accel\n"
            "x = torch.randn(64, 1024) * 3\n"
            "names = ('bf16', 'fp8_e4m3_tensor', 'fp8_e5m2_tensor')\n"
            "os.environ['QUANT_COMPILE'] = '0'\n"
            "eager = [quant.quantize(x, n) for n in names]\n"
            "os.environ['QUANT_COMPILE'] = '1'\n"
            "tried = [quant.quantize(x, n) for n in names for _ in range(2)]\n"
            "assert accel.compile_error() is not None, 'the compile did not fail'\n"
            "for e, t in zip([e for e in eager for _ in range(2)], tried):\n"
            "    assert torch.equal(e.view(torch.int32), t.view(torch.int32))\n"
            "print('exact', flush=True)\n")
    out = _run_script(code, tmp_path, CXX=str(tmp_path / "no-such-c++"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "exact"
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("quant: torch.compile of the ") and "eager kernels" in lines[0]
    assert "backend='inductor' raised" not in lines[0]      # the root error, not Dynamo's wrapper
    log = lines[0].split("traceback in ", 1)[1].split(";", 1)[0]
    assert log.startswith(str(tmp_path)) and "Traceback" in open(log).read()
