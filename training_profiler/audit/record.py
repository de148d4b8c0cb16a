"""The run-time precision audit's recorder: what ran, in which dtype, where, and how close to its
dtype's limits, aggregated per call site so memory stays bounded however long the audit runs.

A ``TorchDispatchMode`` sees every aten op after autocast chose its dtype (so it sees what ran,
not what the source says). Autocast's own enabled flag reads False inside the mode (the mode runs
with the keys above Python excluded), so the autocast state is tracked where it changes: the
``torch.autocast`` context manager's enter/exit, read at the Python level. Module paths come from
global forward hooks, the user's source line from the Python stack (frames in torch and in this
package skipped). Optimizer steps, ``GradScaler.scale`` and custom autograd Functions are
observed through their global hooks or a wrapper installed only while the audit runs; every hook
and wrapper is removed on exit, so nothing is left after the audited steps. Where an optimizer or
GradScaler was built and a model cast comes from :mod:`training_profiler.audit.source`; in-place
updates of low-precision parameters outside an optimizer step go to
:mod:`training_profiler.audit.updates`.

Nothing here changes a value: outputs are returned as computed, statistics are read from them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from quant.analysis import dtype_limits
from training_profiler.audit.source import LOW_PRECISION, Origins, Where, dtype_name, user_frame
from training_profiler.audit.updates import UPDATE_OPS, ManualUpdate, UpdateJudge

#: at most this many call sites are kept; later new sites are only counted (bounded memory)
MAX_SITES = 20_000
#: range statistics are read on this many calls of a site (the rest only counts calls)
STAT_CALLS = 4

_ADMIN_OPS = frozenset({"detach", "alias", "view", "_unsafe_view", "t", "transpose", "permute",
                        "expand", "reshape", "squeeze", "unsqueeze", "select", "slice", "split",
                        "clone", "empty", "empty_like", "zeros", "zeros_like", "ones", "ones_like",
                        "fill_", "zero_", "copy_", "_to_copy", "lift_fresh", "as_strided",
                        "set_", "new_empty", "new_zeros", "_local_scalar_dense", "normal_",
                        "uniform_", "randint", "arange", "full", "new_full", "index_select",
                        "embedding", "unbind", "split_with_sizes", "contiguous", "stack", "cat"})


@dataclass
class OpSite:
    """One call site of one op with one dtype signature, and its aggregated statistics."""

    op: str
    phase: str                      # "forward" or "backward"
    module: str                     # module path ("" outside any module)
    where: Where
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...]
    autocast: str | None            # autocast dtype when active for the op's device
    autocast_at: Where | None = None  # where that autocast region was entered (when seen)
    calls: int = 0
    stat_calls: int = 0
    absmax: float = 0.0             # over low-precision floating outputs
    flushed: float = 0.0            # largest fraction of nonzero outputs below min_normal
    saturated: float = 0.0          # largest fraction of outputs at +-Inf
    reduced: int = 0                # largest input numel (how much a reduction accumulates)


@dataclass
class StepEvent:
    """What one optimizer step showed: low-precision grads and params, state dtypes, eps."""

    where: Where
    optimizer: str
    lowp_grad_elems: int = 0
    lowp_grad_flushed: int = 0      # zero or below min_normal
    lowp_grad_subnormal: int = 0    # nonzero and below min_normal: underflow under way
    grad_dtypes: set[str] = field(default_factory=set)
    lowp_param_dtypes: set[str] = field(default_factory=set)
    moved_elems: int = 0            # low-precision elements whose grad was nonzero
    stuck_elems: int = 0            # ... and which the step left unchanged
    fp16_states: list[str] = field(default_factory=list)
    eps: list[float] = field(default_factory=list)
    built: Where | None = None      # the line that built the optimizer (when seen)
    casts: dict[Where, str] = field(default_factory=dict)  # where its low-precision params were cast


@dataclass
class FunctionCall:
    """A custom autograd Function's dtypes in and out, aggregated per class and site."""

    name: str
    where: Where
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...]
    autocast: str | None
    custom_fwd: bool
    autocast_at: Where | None = None
    calls: int = 0


@dataclass
class Record:
    """Everything the rules read (see :mod:`training_profiler.audit.rules`)."""

    sites: dict[tuple, OpSite] = field(default_factory=dict)
    steps: list[StepEvent] = field(default_factory=list)
    functions: dict[tuple, FunctionCall] = field(default_factory=dict)
    #: (scale() site, enabled, the line that built the scaler or None) -> calls
    scaler_calls: dict[tuple[Where, bool, Where | None], int] = field(default_factory=dict)
    scaler_updates: int = 0         # iterations under an enabled scaler, skipped steps included
    updates: dict[tuple, ManualUpdate] = field(default_factory=dict)  # hand-written updates
    manual_iterations: int = 0      # backwards that followed a judged hand-written update


def _dtype_name(t: torch.Tensor) -> str:
    return dtype_name(t.dtype)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    return []


_FP32_MIN_NORMAL = dtype_limits(torch.float32).min_normal


def range_stats(t: torch.Tensor) -> tuple[float, float, float]:
    """absmax, fraction of nonzero values below the dtype's min_normal (quant.analysis's
    underflow), fraction at +-Inf (an overflow already happened), for the tensor's own dtype.
    The underflow pass runs only for a dtype whose min_normal is above float32's (float16):
    below that no float32 value was lost to it (bfloat16 shares float32's exponent range)."""
    lim = dtype_limits(t.dtype)
    if lim is None or t.numel() == 0:
        return 0.0, 0.0, 0.0
    lo, hi = torch.aminmax(t.detach())       # one pass, no |x| copy (vector_norm(inf) is ~10x slower)
    absmax = max(-float(lo), float(hi))
    under = 0.0
    if lim.min_normal > _FP32_MIN_NORMAL:
        a = t.detach().abs()
        nonzero = int(torch.count_nonzero(a))
        under = int(torch.count_nonzero((a < lim.min_normal) & (a > 0))) / nonzero if nonzero else 0.0
    inf = int(torch.count_nonzero(torch.isinf(t.detach()))) / t.numel() if absmax == float("inf") else 0.0
    return absmax, under, inf


class _ModuleStack:
    """Module paths from global forward hooks: a module is named by its path under the module
    that called it (a child, or deeper in a ModuleList), a root by its class name; each name is
    found once per module."""

    def __init__(self, origins: Origins) -> None:
        self.stack: list[str] = []
        self.names: dict[int, str] = {}
        self.handles: list = []
        self.owners: list[torch.nn.Module] = []
        self.origins = origins

    def install(self) -> None:
        from torch.nn.modules import module as m
        self.handles = [m.register_module_forward_pre_hook(self._pre),
                        m.register_module_forward_hook(self._post, always_call=True)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _pre(self, module: torch.nn.Module, _inputs: Any) -> None:
        name = self.names.get(id(module))
        if name is None:
            name = type(module).__name__
            if self.stack:
                parent = self.stack[-1]
                owner = self.owners[-1]
                found = next((a for a, c in owner.named_children() if c is module), None)
                if found is None:  # held in a ModuleList / ModuleDict, or deeper
                    found = next((a for a, c in owner.named_modules() if c is module and a), None)
                if found is not None:
                    name = f"{parent}.{found}"
            self.names[id(module)] = name
            self.origins.note_params(module)
        self.stack.append(name)
        self.owners.append(module)

    def _post(self, _module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
        if self.stack:
            self.stack.pop()
            self.owners.pop()

    def current(self) -> str:
        return self.stack[-1] if self.stack else ""


class _AutocastState:
    """Which devices autocast is on for, its dtype and the line that entered the region, kept
    current at every enter/exit of ``torch.autocast`` (the flag itself is not readable inside a
    dispatch mode). A region entered before the audit started has no line."""

    DEVICES = ("cpu", "cuda")

    def __init__(self) -> None:
        self.active: dict[str, str | None] = {}
        self.entered: dict[str, Where | None] = {}
        self.regions: list[tuple[Any, Where]] = []   # (autocast object, its line), innermost last
        self._saved: tuple | None = None

    def read(self) -> None:
        for dev in self.DEVICES:
            try:
                on = torch.is_autocast_enabled(dev)
            except RuntimeError:
                on = False
            self.active[dev] = dtype_name(torch.get_autocast_dtype(dev)) if on else None
            self.entered[dev] = next((w for ac, w in reversed(self.regions) if on and ac.device == dev
                                      and getattr(ac, "_enabled", True)), None)

    def install(self) -> None:
        cls = torch.amp.autocast_mode.autocast
        enter, exit_ = cls.__enter__, cls.__exit__
        state = self

        def __enter__(ac):
            out = enter(ac)
            state.regions.append((ac, user_frame(2)))
            state.read()
            return out

        def __exit__(ac, *exc):
            out = exit_(ac, *exc)
            mine = [i for i, (a, _) in enumerate(state.regions) if a is ac]
            if mine:                  # else entered before the audit started
                del state.regions[mine[-1]]
            state.read()
            return out

        self._saved = (cls, enter, exit_)
        cls.__enter__, cls.__exit__ = __enter__, __exit__
        self.read()

    def remove(self) -> None:
        if self._saved is not None:
            cls, enter, exit_ = self._saved
            cls.__enter__, cls.__exit__ = enter, exit_
            self._saved = None
        self.regions.clear()


class StopAudit(BaseException):
    """Raised after the last audited optimizer step when a whole script runs under the audit
    (a BaseException, so a script's ``except Exception`` does not swallow it)."""


class OpRecorder(TorchDispatchMode):
    """Records every op's dtypes and range per call site; see the module docstring."""

    def __init__(self, max_steps: int | None = None) -> None:
        super().__init__()
        self.record = Record()
        self.origins = Origins()
        self.modules = _ModuleStack(self.origins)
        self.autocast = _AutocastState()
        self.updates = UpdateJudge(self.origins, self.record.updates)
        self.max_steps = max_steps
        self._undo: list[Callable[[], None]] = []
        self._snap: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._stopping = False
        self.backward_where = Where("<unknown>", 0)   # the last user line that started a backward

    # ---- the op record ------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = func._overloadpacket.__name__
        targets = self.updates.targets(args) if op in UPDATE_OPS else None
        out = self.updates.run(func, op, args, kwargs, targets) if targets else func(*args, **kwargs)
        if op in _ADMIN_OPS:
            return out
        outs = _tensors(out)
        if not any(t.is_floating_point() for t in outs):
            return out
        ins = _tensors(args) + _tensors(list(kwargs.values()))
        backward = torch._C._current_graph_task_id() != -1
        where = user_frame(2)
        if backward and where.path == "<unknown>":  # autograd's device threads: no user frame
            where = self.backward_where
        dev = outs[0].device.type
        key = (op, backward, self.modules.current() if not backward else "", where,
               tuple(_dtype_name(t) for t in ins), tuple(_dtype_name(t) for t in outs),
               self.autocast.active.get(dev), self.autocast.entered.get(dev))
        site = self.record.sites.get(key)
        if site is None:
            if len(self.record.sites) >= MAX_SITES:
                return out
            site = self.record.sites[key] = OpSite(op, "backward" if backward else "forward",
                                                   key[2], where, key[4], key[5], key[6], key[7])
        site.calls += 1
        if site.stat_calls < STAT_CALLS:
            site.stat_calls += 1
            site.reduced = max(site.reduced, max((t.numel() for t in ins), default=0))
            for t in outs:
                if t.dtype in LOW_PRECISION:
                    absmax, flushed, saturated = range_stats(t)
                    site.absmax = max(site.absmax, absmax)
                    site.flushed = max(site.flushed, flushed)
                    site.saturated = max(site.saturated, saturated)
        return out

    # ---- install / remove ---------------------------------------------------------------------
    def __enter__(self):
        self.modules.install()
        self._undo.append(self.modules.remove)
        self.origins.install()
        self._undo.append(self.origins.remove)
        self.autocast.install()
        self._undo.append(self.autocast.remove)
        from torch.optim import optimizer as optim_mod
        pre = optim_mod.register_optimizer_step_pre_hook(self._step_pre)
        post = optim_mod.register_optimizer_step_post_hook(self._step_post)
        self._undo += [pre.remove, post.remove]
        self._wrap_scaler()
        self._wrap_function_apply()
        self._wrap_backward()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            while self._undo:
                self._undo.pop()()

    def _wrap_scaler(self) -> None:
        """Note each ``GradScaler.scale`` call site; count ``update`` calls, which end every
        iteration under a scaler, also one whose optimizer step was skipped (an overflow), so a
        run that keeps overflowing still stops after its audited iterations."""
        cls = torch.amp.GradScaler
        scale_, update_ = cls.scale, cls.update
        rec, recorder, built = self.record, self, self.origins.built

        def scale(scaler, outputs):
            key = (user_frame(2), bool(scaler.is_enabled()), built.get(scaler))
            rec.scaler_calls[key] = rec.scaler_calls.get(key, 0) + 1
            return scale_(scaler, outputs)

        def update(scaler, new_scale=None):
            out = update_(scaler, new_scale)
            if scaler.is_enabled():
                rec.scaler_updates += 1
                recorder._stop_after(rec.scaler_updates)
            return out

        cls.scale, cls.update = scale, update
        self._undo.append(lambda: (setattr(cls, "scale", scale_), setattr(cls, "update", update_)))

    def _wrap_backward(self) -> None:
        """Note where each backward starts (``Tensor.backward`` calls ``torch.autograd.backward``):
        backward ops run on autograd's device threads on a GPU, where no user frame is seen.
        A backward after hand-written parameter updates starts a new iteration of such a loop,
        counted as optimizer steps are (a script is stopped after ``max_steps`` of them)."""
        original = torch.autograd.backward
        rec = self

        def backward(*args, **kwargs):
            rec.backward_where = user_frame(2)
            if rec.updates.pending:
                rec.updates.pending = False
                rec.record.manual_iterations += 1
                rec._stop_after(rec.record.manual_iterations)
            return original(*args, **kwargs)

        torch.autograd.backward = backward
        self._undo.append(lambda: setattr(torch.autograd, "backward", original))

    def _wrap_function_apply(self) -> None:
        fn_cls = torch.autograd.function.Function
        original = fn_cls.__dict__["apply"]
        rec, autocast = self.record, self.autocast

        def apply(cls, *args, **kwargs):
            out = original.__func__(cls, *args, **kwargs)
            if cls.__module__.startswith("torch."):  # torch's own (checkpointing) keep autocast's state
                return out
            ins = [t for t in _tensors(list(args)) if t.is_floating_point()]
            outs = [t for t in _tensors(out) if t.is_floating_point()]
            if ins and outs:
                where = user_frame(2)
                dev = outs[0].device.type
                key = (cls.__qualname__, where, tuple(_dtype_name(t) for t in ins),
                       tuple(_dtype_name(t) for t in outs), autocast.active.get(dev),
                       autocast.entered.get(dev))
                call = rec.functions.get(key)
                if call is None:
                    wrapped = getattr(cls.forward, "__wrapped__", None) is not None
                    call = rec.functions[key] = FunctionCall(cls.__qualname__, where, key[2],
                                                             key[3], key[4], wrapped, key[5])
                call.calls += 1
            return out

        fn_cls.apply = classmethod(apply)
        self._undo.append(lambda: setattr(fn_cls, "apply", original))

    # ---- optimizer steps ------------------------------------------------------------------------
    def _step_pre(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        ev = StepEvent(user_frame(2), type(optimizer).__name__, built=self.origins.built.get(optimizer))
        self._snap = []
        self.updates.paused = True          # the step's own in-place ops are judged below
        for group in optimizer.param_groups:
            eps = group.get("eps")
            if isinstance(eps, (int, float)):
                ev.eps.append(float(eps))
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                ev.grad_dtypes.add(_dtype_name(g))
                if g.dtype in LOW_PRECISION:
                    lim = dtype_limits(g.dtype)
                    a = g.detach().abs()
                    below = int(torch.count_nonzero(a < lim.min_normal))
                    ev.lowp_grad_elems += g.numel()
                    ev.lowp_grad_flushed += below
                    ev.lowp_grad_subnormal += below - (g.numel() - int(torch.count_nonzero(a)))
                if p.dtype in LOW_PRECISION:
                    ev.lowp_param_dtypes.add(_dtype_name(p))
                    self._snap.append((p, p.detach().clone(), g.detach() != 0))
                    cast = self.origins.casts.get(p)
                    if cast is not None and cast[1] == _dtype_name(p):
                        ev.casts.setdefault(*cast)
        self.record.steps.append(ev)

    def _step_post(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        ev = self.record.steps[-1]
        self.updates.paused = False
        for p, before, moving in self._snap:
            ev.moved_elems += int(moving.sum())
            ev.stuck_elems += int((moving & (p.detach() == before)).sum())
        self._snap = []
        for state in optimizer.state.values():
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.dtype == torch.float16 and value.numel() > 1:
                    if name not in ev.fp16_states:
                        ev.fp16_states.append(name)
        self._stop_after(len(self.record.steps))

    def _stop_after(self, iterations: int) -> None:
        """Raise StopAudit once ``iterations`` reach ``max_steps`` (when a script is audited)."""
        if self.max_steps is not None and iterations >= self.max_steps and not self._stopping:
            self._stopping = True
            raise StopAudit
