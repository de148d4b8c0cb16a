"""Where a module sits in the model: its path and 0-based layer index, found while it runs.

A global forward pre-hook (installed only while capture or the underflow warning needs it)
sees the outermost module first, records every sub-module's path once, and tells the linear
Function which linear module is running. ``layer_idx`` is 0-based: the owning
TransformerLayer's ``layer_number - 1``, i.e. the ``decoder.layers.{i}`` index when there is
no pipeline parallelism. Its own module because the process-wide saver switches the hook on
and off while the hooks (tensor_capture.hooks) read the sites: neither imports the other.
The map itself is ``STATE.sites`` (tensor_capture.state), with the rest of the process state.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from .state import STATE

LINEAR_CLASSES = frozenset({"ColumnParallelLinear", "RowParallelLinear"})
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Site:
    """Where a module sits in the model."""

    module_path: str | None
    submodule: str | None
    layer_idx: int | None


UNKNOWN_SITE = Site(None, None, None)


def _strip(path: str) -> str:
    while path.startswith("module."):
        path = path[len("module."):]
    return path


def register_model(root: torch.nn.Module, prefix: str = "") -> None:
    """Record the path and 0-based layer index of every sub-module of ``root``."""
    layer_of: dict[str, int | None] = {}
    for name, mod in root.named_modules(prefix=prefix):
        path = _strip(name)
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        idx = layer_of.get(parent)
        number = getattr(mod, "layer_number", None)
        if type(mod).__name__.endswith("TransformerLayer") and isinstance(number, int):
            idx = number - 1
        elif idx is None:
            m = _LAYER_RE.search(path)
            idx = int(m.group(1)) if m else None
        layer_of[path] = idx
        leaf = path.rsplit(".", 1)[-1] if path else type(mod).__name__
        STATE.sites[mod] = Site(path or None, leaf, idx)


def site_of(module: torch.nn.Module) -> Site:
    """Where ``module`` sits (UNKNOWN_SITE for a module never registered)."""
    return STATE.sites.get(module, UNKNOWN_SITE)


def _discover(module: torch.nn.Module, args: Any) -> None:
    site = STATE.sites.get(module)
    if site is None:                 # first call of an unseen root: map its whole tree
        register_model(module)
        site = STATE.sites.get(module, UNKNOWN_SITE)
    if type(module).__name__ in LINEAR_CLASSES:
        STATE.current_linear = site


def install_discovery() -> None:
    if not STATE.discovery:
        STATE.discovery.append(torch.nn.modules.module.register_module_forward_pre_hook(_discover))


def uninstall_discovery() -> None:
    while STATE.discovery:
        STATE.discovery.pop().remove()
