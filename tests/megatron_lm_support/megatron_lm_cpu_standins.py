"""CPU stand-ins for the CUDA calls of Megatron-LM's training loop (tests only, never a user's path).

Why: Megatron-LM's ``megatron/training`` (``pretrain_gpt.py``'s loop) asks for CUDA in about 40
places, although the model itself (megatron-core) runs on a CPU over gloo. To run the real
``pretrain_gpt.py`` in CI, this module answers those calls on the CPU. It is loaded by
``sitecustomize.py`` beside it, only when a test puts this folder on ``PYTHONPATH`` and sets
``LOWP_MEGATRON_LM_CPU_STANDINS=1``; the product (launcher, patch set, capture) needs none of it.

Each stand-in names the Megatron-LM line (tag ``core_v0.16.1``) that needs it. They are of three
kinds: ``torch.cuda`` functions answered for a CPU; a device ``"cuda"`` written in a call
mapped to the CPU (a ``TorchFunctionMode``: ``torch.tensor(..., device='cuda')``, ``.cuda()``,
``.to('cuda')``); and three Megatron functions replaced or wrapped after their module is
imported (an import hook), because they refuse to run without CUDA.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

CPU = torch.device("cpu")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class CudaToCpu(TorchFunctionMode):
    """``device='cuda'`` in factories (training.py:806, :1816, :3225, :3406; utils.py:117-208;
    checkpointing.py:315; initialize.py:475-512), ``Tensor.cuda()`` / ``Module.cuda()``
    (training.py:1258, :3112) and ``Tensor.to('cuda')`` run on the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], CPU, *args[2:])
        return func(*args, **kwargs)


class _Stream:
    """torch.cuda.Stream (training.py:1325: the DDP stream; initialize.py:338)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args: Any) -> None:
        return None


def _props(_device: Any = None) -> types.SimpleNamespace:
    """get_device_properties (utils.py:448 get_device_arch_version, needed for TP > 1 in
    arguments.py:928): an H100's major version, so no Blackwell-only path is taken."""
    return types.SimpleNamespace(major=9, minor=0, name="cpu-standin", total_memory=0,
                                 multi_processor_count=1)


#: torch.cuda attribute -> stand-in, each for the Megatron-LM lines named.
CUDA_FUNCTIONS: dict[str, Callable[..., Any]] = {
    # megatron-core buffers (attention, RoPE, TP gathers) and training/utils.py:253-731
    "current_device": lambda: CPU,
    # initialize.py:319/:360 builds the model-parallel groups, and :422 seeds the RNG tracker,
    # only when a device exists; set_device (:331) is then asked for the local rank's
    "device_count": lambda: 1,
    "set_device": lambda *a, **k: None,
    # training.py:2255, inprocess_restart.py:159, the timers
    "synchronize": lambda *a, **k: None,
    # checkpointing.py:1911, training.py:1693/1737/3104, initialize.py:523
    "empty_cache": lambda: None,
    "Stream": _Stream,
    "current_stream": lambda *a, **k: _Stream(),
    "stream": lambda *a, **k: contextlib.nullcontext(),
    # checkpointing.py:343 saves it, :1866/:1878 restores it
    "get_rng_state": lambda *a, **k: torch.get_rng_state(),
    "set_rng_state": lambda *a, **k: None,
    # utils.py:284-289 report_memory, training.py:1940
    "memory_allocated": lambda *a, **k: 0,
    "max_memory_allocated": lambda *a, **k: 0,
    "memory_reserved": lambda *a, **k: 0,
    "max_memory_reserved": lambda *a, **k: 0,
    "memory_stats": lambda *a, **k: {},
    "reset_peak_memory_stats": lambda *a, **k: None,
    # arguments.py:853
    "get_device_capability": lambda *a, **k: (9, 0),
    "get_device_properties": _props,
}

_CUDA_TYPES = {"torch.BFloat16Tensor", "torch.HalfTensor", "torch.FloatTensor"}


def _cuda_type_names(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.type()`` as on CUDA: megatron/core/optimizer/optimizer.py:671/:690 and
    clip_grads.py:167 sort parameters by 'torch.cuda.BFloat16Tensor' / 'torch.cuda.FloatTensor'
    and reject anything else (the CPU answers 'torch.BFloat16Tensor')."""

    @functools.wraps(original)
    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if not args and not kwargs and name in _CUDA_TYPES:
            return name.replace("torch.", "torch.cuda.", 1)
        return name

    return type_


# ---- Megatron functions that refuse to run without CUDA (patched right after their import)

def _initialize(module: types.ModuleType) -> None:
    """megatron/training/initialize.py: initialize_megatron asserts CUDA (line 62) unless
    allow_no_cuda; fused_kernels.load (line 224) runs `nvcc -V`."""
    original = module.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    module.initialize_megatron = initialize_megatron
    module.fused_kernels.load = lambda args: None


def _random(module: types.ModuleType) -> None:
    """megatron/core/tensor_parallel/random.py:378: the default RNG tracker forks CUDA RNG
    states; the inference tracker (plain CPU generator states) is the one that runs here."""
    original = module.model_parallel_cuda_manual_seed

    @functools.wraps(original)
    def model_parallel_cuda_manual_seed(seed: int, *args: Any, **kwargs: Any) -> Any:
        kwargs["inference_rng_tracker"] = True
        kwargs.pop("te_rng_tracker", None)
        return original(seed, **kwargs)

    module.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed


#: module name -> what to change in it right after it is executed.
AFTER_IMPORT: dict[str, Callable[[types.ModuleType], None]] = {
    "megatron.training.initialize": _initialize,
    "megatron.core.tensor_parallel.random": _random,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Run AFTER_IMPORT[name] once the module has executed, before its importer sees it."""

    def find_spec(self, name, path, target=None):
        if name not in AFTER_IMPORT:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: types.ModuleType) -> None:
            exec_module(module)
            AFTER_IMPORT[name](module)

        spec.loader.exec_module = exec_then_patch
        return spec


_MODE: CudaToCpu | None = None


def install() -> None:
    """Install every stand-in (idempotent)."""
    global _MODE
    if _MODE is not None:
        return
    for name, standin in CUDA_FUNCTIONS.items():
        setattr(torch.cuda, name, standin)
    torch.Tensor.type = _cuda_type_names(torch.Tensor.type)
    # initialize.py:460 set_jit_fusion_options warms up torch.compile'd fusions (swiglu, bias
    # dropout); inductor then asks the device_count stand-in's "GPU" for its properties. Run
    # the compiled functions eagerly instead (same numerics on a CPU).
    torch._dynamo.config.disable = True
    sys.meta_path.insert(0, _AfterImport())
    _MODE = CudaToCpu()
    _MODE.__enter__()
