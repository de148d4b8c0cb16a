"""Import Transformer Engine's real Python (from its published wheel) on a CPU.

``load(root)`` imports ``transformer_engine.pytorch`` from the unpacked wheel at ``root`` with
exactly two things replaced, each named here:

- ``transformer_engine.common``'s ``__init__`` (it loads libtransformer_engine.so, cuDNN,
  NVRTC, cuBLAS with ctypes) by a package object over the same folder, so its submodules
  (``recipe``, ``utils``) are TE's own files; its ``load_framework_extension`` installs
- ``transformer_engine_torch`` (the compiled extension) = tests/te_real/tex_stub.py.

Plus the CPU shims a CUDA-less torch needs, listed in ``CPU_SHIMS`` (each a name TE calls
that a CPU build of torch raises on); nothing in TE's own files is changed.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _install_extension_stub() -> None:
    spec = importlib.util.spec_from_file_location("transformer_engine_torch", HERE / "tex_stub.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["transformer_engine_torch"] = mod
    spec.loader.exec_module(mod)


def _import_common() -> types.ModuleType:
    """TE's own ``transformer_engine/common/__init__.py``, imported with TE's build-time switch
    (NVTE_PROJECT_BUILDING) that skips loading its CUDA libraries; then its
    ``load_framework_extension`` installs the stub instead of the compiled extension."""
    saved = {k: os.environ.get(k) for k in ("NVTE_PROJECT_BUILDING", "NVTE_RELEASE_BUILD")}
    os.environ["NVTE_PROJECT_BUILDING"] = "1"
    os.environ.pop("NVTE_RELEASE_BUILD", None)
    try:
        common = importlib.import_module("transformer_engine.common")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def load_framework_extension(framework: str) -> None:
        if framework == "torch" and "transformer_engine_torch" not in sys.modules:
            _install_extension_stub()

    common.load_framework_extension = load_framework_extension
    return common


def _import_pkg_without_init(root: Path) -> None:
    """An empty ``transformer_engine`` package (only to import ``.common`` first: TE's own
    top-level __init__ imports .pytorch, which calls load_framework_extension at once)."""
    pkg = types.ModuleType("transformer_engine")
    pkg.__path__ = [str(root / "transformer_engine")]
    sys.modules["transformer_engine"] = pkg


def _no_cuda_nvtx() -> None:
    """torch.cuda.nvtx on a CPU build raises; TE pushes ranges around every GEMM."""
    torch.cuda.nvtx.range_push = lambda *a, **k: None
    torch.cuda.nvtx.range_pop = lambda *a, **k: None


def _cuda_is_available() -> None:
    """TE's module base refuses to build without CUDA; the driver process (never the pytest
    process) says yes, and builds every module with device="cpu"."""
    torch.cuda.is_available = lambda: True


def _hopper_device() -> None:
    """TE asks the device's compute capability (FP8 support); answer an H100's, device 0."""
    props = types.SimpleNamespace(major=9, minor=0, name="cpu (test shim, sm_90 capability)",
                                  multi_processor_count=132, total_memory=80 * 2**30)
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)


def _no_graph_capture() -> None:
    """No CUDA graph is ever being captured on a CPU."""
    torch.cuda.is_current_stream_capturing = lambda: False


#: name -> what it does; applied in load() (only in the driver subprocess)
CPU_SHIMS = {
    "torch.cuda.nvtx.range_push/range_pop": _no_cuda_nvtx,
    "torch.cuda.is_available": _cuda_is_available,
    "torch.cuda.current_device/get_device_properties/get_device_capability": _hopper_device,
    "torch.cuda.is_current_stream_capturing": _no_graph_capture,
}


def _cpu_empty_tensor() -> None:
    """TE frees saved activations by swapping in ``torch.Tensor().cuda()`` (utils._empty_tensor);
    on a CPU the empty tensor is a CPU one. Replaced in every TE module that imported it."""
    _replace_everywhere("transformer_engine.pytorch.utils", "_empty_tensor", torch.Tensor)


def _replace_everywhere(module_name: str, attr: str, new: object) -> None:
    """``module.attr`` := new, in the defining TE module and every TE module that imported it."""
    original = getattr(importlib.import_module(module_name), attr)
    for name, mod in list(sys.modules.items()):
        if name.startswith("transformer_engine.") and getattr(mod, attr, None) is original:
            setattr(mod, attr, new)


def _cpu_dummy_wgrad() -> None:
    """With fuse_wgrad_accumulation TE returns a placeholder weight gradient that it allocates
    on "cuda" (module.base.get_dummy_wgrad); here a CPU one, cached per shape and dtype."""
    cache: dict = {}

    def get_dummy_wgrad(shape, dtype, zero=False):
        t = cache.setdefault((*shape, dtype), torch.empty(shape, dtype=dtype))
        return (t.fill_(0) if zero else t).detach()

    _replace_everywhere("transformer_engine.pytorch.module.base", "get_dummy_wgrad", get_dummy_wgrad)


#: shims of TE's own functions, applied after the import
TE_CPU_SHIMS = {
    "transformer_engine.pytorch.utils._empty_tensor": _cpu_empty_tensor,
    "transformer_engine.pytorch.module.base.get_dummy_wgrad": _cpu_dummy_wgrad,
}


class CudaLabelled(torch.Tensor):
    """A CPU tensor that answers ``is_cuda`` True: TE's forward refuses inputs that are not
    on CUDA. Only the module inputs the driver builds are of this class; torch functions on it
    return plain tensors (torch-function dispatch disabled), so nothing else is labelled."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self) -> bool:
        return True


def cuda_labelled(x: torch.Tensor) -> torch.Tensor:
    """``x`` (a leaf) as a CudaLabelled leaf with the same values and requires_grad."""
    out = x.detach().as_subclass(CudaLabelled)
    return out.requires_grad_(x.requires_grad)


def load(root: Path) -> types.ModuleType:
    """``transformer_engine.pytorch`` from the wheel unpacked at ``root``."""
    root = Path(root)
    sys.path.insert(0, str(root))
    for shim in CPU_SHIMS.values():
        shim()
    _import_pkg_without_init(root)
    _import_common()
    sys.modules.pop("transformer_engine")     # now TE's own top-level __init__, in full
    import transformer_engine.pytorch as te

    for shim in TE_CPU_SHIMS.values():
        shim()
    return te
