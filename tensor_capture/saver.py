"""TensorSaver: the capture facade (policy decides what, record builds it, sink writes it).

Usable on its own (no Megatron needed)::

    from tensor_capture.saver import TensorSaver
    saver = TensorSaver(enabled=True, save_dir="/tmp/caps", quant_type="mxfp8")
    saver.set_iteration(0)
    saver.capture(x, CaptureSite(layer_type="linear", operation="forward", phase="pre",
                                 tensor_name="input", component="linear", layer_idx=0,
                                 module_path="decoder.layers.0.mlp.linear_fc1"))
    saver.close()

(``save_tensor`` takes the same fields positionally, as the first capture API did, so older
patched trees keep working.)

Inside a patched Megatron tree the process-wide instance comes from :func:`get_tensor_saver`
(configured from TENSOR_SAVE_* / CUSTOM_QUANT_TYPE / TENSOR_SAVE_CONFIG). This module owns the
process state (tensor_capture.state.STATE): it sets the hot-path flags from the saver's config,
and a new session (:func:`configure`, :func:`reset_tensor_saver`) resets it in one call.
"""
from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any, Callable

import torch

from quant.vocabulary import is_high_precision

from . import budget, schema, sites, whatif
from .config import MODE_RECORDER, CaptureConfig, ConfigError, load_config, load_quant_plan
from .guard import Guard
from .policy import CapturePolicy, Warnings
from .record import RecordBuilder, short_dtype
from .recorder.flight import Recorder
from .recorder.flight import start_line as recorder_start_line
from .schema import CaptureSite
from .sink import CaptureSink
from .state import STATE
from .tensorboard import NumericsBoard

log = logging.getLogger("tensor_capture")
#: site objects TensorSaver.captures remembers an answer for within an iteration (the hooks'
#: cached sites number a few hundred; a caller that builds a new site per call stops here)
_SELECTED_MAX = 4096

__all__ = ["TensorSaver", "CaptureSite", "get_tensor_saver", "configure", "save_tensor",
           "save_attention_tensors", "save_linear_tensors", "ConfigError"]


class TensorSaver:
    """Captures tensors with metadata and statistics; see the module docstring.

    A facade over three parts with one job each: ``policy`` (what to capture:
    tensor_capture.policy), ``records`` (metadata + statistics -> record:
    tensor_capture.record) and ``sink`` (the directory, background writer and disk errors:
    tensor_capture.sink). The training loop drives ``iteration`` and ``sample_idx``.
    """

    #: CPU tensors: compute statistics on the writer thread (False: on the caller's thread).
    host_stats_in_writer: bool = True

    def __init__(self, config: CaptureConfig | None = None, **overrides: Any):
        if config is None:
            config = load_config(**overrides)
        elif overrides:
            config = load_config(env={}, **{**_config_dict(config), **overrides})
        self.config = config
        self.iteration: int = config.iteration
        self.sample_idx: int | None = None
        self._closed = False
        self._warnings = Warnings()
        self.policy = CapturePolicy(config, self._warnings.once)
        # captures(): id(site) -> (site, the policy's answer) in iteration _selected_it
        self._selected: dict[int, tuple[CaptureSite, bool]] = {}
        self._selected_it: int | None = None
        self.records = RecordBuilder(config)
        # what-if numerics to TensorBoard when they are computed at all
        self.board = (NumericsBoard(config.tensorboard_dir)
                      if config.enabled and config.whatif_formats else None)
        self.whatif_gate = whatif.WhatifGate(
            None if config.whatif_budget == math.inf else config.whatif_budget)
        self.sink = CaptureSink(config.save_dir, config.queue_size, on_failure=self._on_failure,
                                on_record=self.board.log if self.board is not None else None)
        self.budget = self.policy.budget
        self.directory = self.sink.directory
        # the flight recorder (mode: recorder): statistics of every iteration, full capture
        # only after a trigger (tensor_capture.recorder.flight)
        self.recorder = (Recorder(config, self.directory, self.policy.rank_info, self._label,
                                  self._warnings.once)
                         if config.enabled and config.mode == MODE_RECORDER else None)
        # the auto-guard (guard: / TENSOR_SAVE_GUARD): rescales or upcasts a failing GEMM
        self.guard = (Guard(config.guard, config.quant_type, None, self.directory,
                            lambda: self.policy.rank_info()["rank"], budget.announce)
                      if config.enabled and config.guard is not None else None)
        if config.enabled:
            self.sink.prepare_dir()

    # -- state the training loop drives --------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.config.enabled and self.sink.failed is None and not self._closed

    @property
    def quant_type(self) -> str | None:
        return self.config.quant_type

    def set_iteration(self, iteration: int) -> None:
        self.iteration = int(iteration)
        self.records.new_iteration()

    def step(self) -> None:
        """Advance to the next iteration (call once per optimizer step)."""
        self.iteration += 1
        self.records.new_iteration()

    def set_sample_idx(self, sample_idx: int | None) -> None:
        self.sample_idx = None if sample_idx is None else int(sample_idx)

    def flush(self) -> None:
        self.sink.flush()
        if self.board is not None:
            self.board.flush()

    def close(self) -> None:
        if self._closed:
            return
        if self.recorder is not None:
            self.recorder.close()
        if self.guard is not None:
            self.guard.close()
        self.sink.close()
        if self.board is not None:
            self.board.close()
        saved = self.policy.saved_iters
        if self.config.enabled and self.sink.failed is None and self.config.min_iterations and (
                self.recorder is None and len(saved) < self.config.min_iterations):
            log.warning("tensor capture: saved %d iteration(s), fewer than min_iterations=%d "
                        "(training stopped early, or the iteration schedule skipped them)",
                        len(saved), self.config.min_iterations)
        self._closed = True

    @property
    def saved_iterations(self) -> list[int]:
        return sorted(self.policy.saved_iters)

    @property
    def bytes_saved(self) -> int:
        return self.policy.bytes

    # -- selection (tensor_capture.policy) ---------------------------------------------------------
    def iteration_selected(self, iteration: int | None = None) -> bool:
        """Whether the schedule (start/end/every, max_iterations) saves this iteration."""
        return self.policy.iteration_selected(self.iteration if iteration is None else iteration)

    def wants(self, layer_type: str, operation: str, phase: str, tensor_name: str,
              layer_idx: int | None = None, module_path: str | None = None) -> bool:
        """Whether the layer/operation/phase/tensor filters select this tensor (cached)."""
        return self.policy.wants(layer_type, operation, phase, tensor_name, layer_idx, module_path)

    def should_capture(self, layer_type: str, operation: str, phase: str, tensor_name: str,
                       layer_idx: int | None = None, module_path: str | None = None, *,
                       iteration: int | None = None) -> bool:
        p = self.policy
        return (self.enabled and p.iteration_selected(self.iteration if iteration is None
                                                      else iteration)
                and p.wants(layer_type, operation, phase, tensor_name, layer_idx, module_path)
                and p.rank_selected())

    def captures(self, site: CaptureSite, iteration: int) -> bool:
        """Whether a tensor taken at ``site`` in ``iteration`` would be captured now. The
        policy's answer is kept per site object for the iteration (the hooks hand the same
        cached sites every step, and schedule, filters and rank hold within an iteration: an
        iteration once selected stays so); whether the saver is enabled is asked each time."""
        if not self.enabled:
            return False
        memo = self._selected
        if iteration != self._selected_it:
            memo.clear()
            self._selected_it = iteration
        hit = memo.get(id(site))
        if hit is not None and hit[0] is site:
            return hit[1]
        p = self.policy
        ok = (p.iteration_selected(iteration)
              and p.wants(site.layer_type, site.operation, site.phase, site.tensor_name,
                          site.layer_idx, site.module_path)
              and p.rank_selected())
        if len(memo) < _SELECTED_MAX:        # a caller building new sites: no growth past this
            memo[id(site)] = (site, ok)
        return ok

    # -- saving ----------------------------------------------------------------------------------
    def save_tensor(self, tensor: torch.Tensor, layer_type: str, operation: str,
                    quant_type: str | None = None, tensor_name: str = "tensor",
                    layer_idx: int | None = None, *, phase: str = "unknown",
                    component: str = "unknown", rank: int | None = None,
                    sample_idx: int | None = None, iteration: int | None = None,
                    module_path: str | None = None, submodule: str | None = None,
                    variant: str = schema.VARIANT_HP, metadata: dict[str, Any] | None = None,
                    quant_axis: int | None = None, whatif_axis: int | None = None) -> str | None:
        """Capture one tensor through the first capture API's signature (phase, component and
        the run-time fields by keyword, as a tree patched for that API calls it) over :meth:`capture`."""
        if not self.enabled or not isinstance(tensor, torch.Tensor) or not self.should_capture(
                layer_type, operation, phase, tensor_name, layer_idx, module_path,
                iteration=iteration):
            return None             # before building the site: most calls end here
        site = CaptureSite(layer_type=layer_type, operation=operation, phase=phase,
                           tensor_name=tensor_name, component=component, layer_idx=layer_idx,
                           module_path=module_path, submodule=submodule, quant_type=quant_type,
                           variant=variant)
        return self.capture(tensor, site, iteration=iteration, rank=rank, sample_idx=sample_idx,
                            metadata=metadata, quant_axis=quant_axis, whatif_axis=whatif_axis)

    def capture(self, tensor: torch.Tensor, site: CaptureSite, *, iteration: int | None = None,
                rank: int | None = None, sample_idx: int | None = None,
                metadata: dict[str, Any] | None = None, quant_axis: int | None = None,
                whatif_axis: int | None = None) -> str | None:
        """Capture one tensor taken at ``site``.

        ``iteration`` / ``rank`` / ``sample_idx``: the event's run-time fields; None takes the
        saver's iteration and micro-batch (set by the schedule) and this process's rank.
        ``metadata``: extra keys for the record (schema.META_*).
        ``quant_axis``: for a GEMM operand, its reduction axis; then each scaled format in
        play (the emulated one, scaled ``range_formats``) is analysed along it with
        quant.analyze_quantization into metadata["quant_analysis"]; and each what-if format
        (config ``whatif_formats``) gets quant.whatif's numbers along it (along the last axis
        for a tensor without one) into metadata["whatif"] (tensor_capture.whatif).
        ``whatif_axis``: the GEMM reduction axis for the what-if numerics alone (a GEMM whose
        operands are not emulated, e.g. attention with emulate_attention off); default
        ``quant_axis``.
        Returns the file path it will be written to, "" for a stats-only record, or None
        when nothing was captured (disabled, filtered out, or not a tensor).
        """
        if not self.enabled or not isinstance(tensor, torch.Tensor):
            return None
        it = self.iteration if iteration is None else int(iteration)
        if not self.captures(site, it):
            return None
        return self.take(tensor, site, it, sample_idx, rank=rank, metadata=metadata,
                         quant_axis=quant_axis, whatif_axis=whatif_axis)

    def take(self, tensor: torch.Tensor, site: CaptureSite, it: int, sample_idx: int | None,
             *, rank: int | None = None, metadata: dict[str, Any] | None = None,
             quant_axis: int | None = None, whatif_axis: int | None = None) -> str | None:
        """:meth:`capture` of a tensor its caller found selected (:meth:`captures` true for
        ``site`` and ``it``): the hooks ask first, so the check is not made twice per tensor
        (the flight recorder's hot path: every selected tensor of every step comes here)."""
        rec = self.recorder
        if rec is not None:
            rec.record(tensor, site, it, self.sample_idx if sample_idx is None else sample_idx)
            if not rec.capturing(it):
                return ""       # recorded: statistics in the recorder's buffer, no record
        try:
            return self._capture(tensor, site, iteration=it, rank=rank, sample_idx=sample_idx,
                                 metadata=metadata, quant_axis=quant_axis,
                                 whatif_axis=quant_axis if whatif_axis is None else whatif_axis)
        except ValueError as exc:   # a bad naming field from a caller: say so, keep training
            self._warnings.once(f"bad:{exc}", f"tensor capture: skipped a tensor: {exc}")
            return None

    def _capture(self, tensor: torch.Tensor, site: CaptureSite, *, iteration: int,
                 rank: int | None, sample_idx: int | None, metadata: dict[str, Any] | None,
                 quant_axis: int | None, whatif_axis: int | None) -> str | None:
        policy, records = self.policy, self.records
        it = iteration
        info = policy.rank_info()
        rank = info["rank"] if rank is None else rank
        sample_idx = self.sample_idx if sample_idx is None else sample_idx
        quant_label = self._label(site, tensor.dtype)
        ranges = records.ranges(tensor.dtype)
        full = tensor.detach()
        is_param = tensor.is_leaf and tensor.requires_grad
        # CPU tensors: statistics run on the writer thread over the copy the file needs anyway
        # (torch ops release the GIL, so they overlap the training step on another core).
        defer = self.host_stats_in_writer and not full.is_cuda and not is_param
        stats_vec = None if defer else records.stats(full, ranges, is_param)
        keep_file, kept, sampled_rows, row_stride, nbytes = policy.file_plan(full, it)
        counter = policy.book(it, nbytes)
        name = schema.TensorName(
            layer_type=site.layer_type, operation=site.operation, tensor_name=site.tensor_name,
            quant_type=quant_label, layer_idx=site.layer_idx, phase=site.phase,
            component=site.component, iteration=it, rank=rank, sample_idx=sample_idx,
            timestamp=records.timestamp(), counter=counter,
        )
        filename = schema.build_filename(name) if keep_file else None
        meta = records.metadata(name, site, tensor, info, sampled_rows=sampled_rows,
                                row_stride=row_stride, quant_axis=quant_axis, extra=metadata)
        cfg = self.config
        due = (cfg.whatif_formats and site.variant == schema.VARIANT_HP
               and ((it - cfg.iter_start) // cfg.iter_every) % cfg.whatif_every == 0  # N-th
               and self.whatif_gate.open(it))                  # within whatif_budget
        wplan = whatif.plan(cfg.whatif_formats if due else (), full, site.variant, whatif_axis,
                            cfg.whatif_max_elements)
        # the writer computes it: from its host copy of the whole tensor when it has one, else
        # from the (sampled) tensor staged beside the other copies
        wsrc = None if wplan is None or defer else whatif.sample(full, wplan.axis,
                                                                 wplan.max_elements)
        item = records.build(self.directory, rank, filename, full,
                             kept=kept if keep_file else None, sampled=sampled_rows is not None,
                             stats_vec=stats_vec, ranges=ranges, meta=meta, whatif_src=wsrc)
        if wplan is not None:
            item.whatif = whatif.WhatifJob(wplan, item.whatif_src, full.numel(),
                                           self.whatif_gate)
            item.whatif_src = None
        if not self.sink.submit(item):
            return None
        return str(self.directory / filename) if filename else ""

    def save_attention_tensors(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               quant_type: str | None = None, operation: str = "forward",
                               layer_idx: int | None = None, *, phase: str = "pre",
                               component: str = "FA", **kw: Any) -> dict[str, str | None]:
        """Save query, key and value of one attention call (the first capture API; ``kw``: save_tensor's
        keywords, rank / sample_idx / iteration among them)."""
        return {n: self.save_tensor(t, "attention", operation, quant_type, n, layer_idx,
                                    phase=phase, component=component, **kw)
                for n, t in (("query", query), ("key", key), ("value", value))}

    def save_linear_tensors(self, input_tensor: torch.Tensor, weight: torch.Tensor,
                            quant_type: str | None = None, operation: str = "forward",
                            layer_idx: int | None = None, phase: str = "pre", *,
                            component: str = "linear", **kw: Any) -> dict[str, str | None]:
        """Save the input and weight of one linear call (the first capture API; ``kw``: save_tensor's
        keywords, rank / sample_idx / iteration among them)."""
        return {n: self.save_tensor(t, "linear", operation, quant_type, n, layer_idx,
                                    phase=phase, component=component, **kw)
                for n, t in (("input", input_tensor), ("weight", weight))}

    def _label(self, site: CaptureSite, dtype: torch.dtype) -> str:
        """A record's quant_type: the site's, else the emulated format, else the dtype's."""
        return site.quant_type or self.config.quant_type or short_dtype(dtype)

    def _on_failure(self) -> None:
        """The sink turned saving off: the hot-path flag must follow for the global saver."""
        if self is STATE.saver:
            _set_flags(self)


def _config_dict(config: CaptureConfig) -> dict[str, Any]:
    from dataclasses import fields

    return {f.name: getattr(config, f.name) for f in fields(config)}


# -- the process-wide saver (in STATE.saver) ---------------------------------------------------------
_LOCK = threading.Lock()


def _set_flags(saver: TensorSaver) -> None:
    """The hot-path flags of STATE from ``saver``'s config (and the module-path hook with them)."""
    STATE.quant_type = saver.config.quant_type
    STATE.emulate = saver.config.emulating
    STATE.plan = (load_quant_plan(saver.config.quant_plan) if saver.config.quant_plan
                  else None)
    guard = saver.guard if saver.enabled else None
    STATE.guard = guard
    if guard is not None:                     # its decisions are rules before the user's
        guard.base_plan = STATE.plan
        STATE.plan = guard.plan()
    # a recipe without an attention format (Transformer Engine's) leaves attention unquantized
    names = {saver.config.quant_type} | (STATE.plan.formats() if STATE.plan else set())
    STATE.emulate_attention = (STATE.emulate and saver.config.emulate_attention
                               and any(_attention_format(n) is not None for n in names))
    STATE.warn_underflow = STATE.emulate and saver.config.underflow_warnings
    STATE.active = saver.enabled or STATE.emulate or STATE.inspector is not None
    if (saver.enabled or STATE.warn_underflow or STATE.inspector is not None
            or STATE.plan is not None):  # module paths
        sites.install_discovery()
    else:                      # the global module hook costs every module call: remove it
        sites.uninstall_discovery()


def _new_session(saver: TensorSaver | None, notes: dict[str, str] | None = None) -> None:
    """The one reset: close the previous saver, forget everything, install ``saver``."""
    old, STATE.saver = STATE.saver, None
    if old is not None:
        old.close()
    STATE.reset()
    sites.uninstall_discovery()
    if saver is not None:
        _install(saver, notes or {})


def _install(saver: TensorSaver, notes: dict[str, str]) -> None:
    STATE.saver = saver
    _set_flags(saver)
    if saver.recorder is not None:
        budget.announce(recorder_start_line(saver.config))
    elif saver.enabled:
        budget.announce_start(saver.config, notes)


def set_inspector(inspector: Callable[..., None] | None) -> None:
    """Also hand attention tensors to ``inspector(module, site, iteration, {name: tensor})``
    (te_integration's debug-API route; None: stop). Keeps the hot-path flag in step."""
    STATE.inspector = inspector
    _set_flags(get_tensor_saver())


def _bounded_saver(config: CaptureConfig) -> tuple[TensorSaver, dict[str, str]]:
    """A saver with the default bounds (tensor_capture.budget) and a note per bound applied."""
    config, notes = budget.bounded(config)
    return TensorSaver(config), notes


def get_tensor_saver() -> TensorSaver:
    """The process-wide saver, configured from the environment on first use."""
    saver = STATE.saver
    if saver is None:
        with _LOCK:
            saver = STATE.saver
            if saver is None:
                # the first saver of the process: what was set up before it (resume_at) stays
                saver, notes = _bounded_saver(load_config())
                _install(saver, notes)
    return saver


def current_saver() -> TensorSaver | None:
    """The process-wide saver if one was built, else None; never builds one (a reader such as
    the training monitor must not start a capture from the environment)."""
    return STATE.saver


def configure(config: CaptureConfig | str | os.PathLike[str] | None = None,
              **overrides: Any) -> TensorSaver:
    """Replace the process-wide saver (a config object, a YAML path, or keyword settings)."""
    with _LOCK:
        if not isinstance(config, CaptureConfig):
            config = load_config(config, **overrides)
        elif overrides:
            config = load_config(env={}, **{**_config_dict(config), **overrides})
        saver, notes = _bounded_saver(config)
        _new_session(saver, notes)
    return saver


def stop_capture(saver: TensorSaver) -> None:
    """Finish capturing (files flushed, hooks off); emulation, if any, goes on."""
    saver.close()
    if saver is STATE.saver:
        _set_flags(saver)


def reset_tensor_saver() -> None:
    """Close and forget the process-wide saver (tests; a new one is built on next use)."""
    with _LOCK:
        _new_session(None)


def _attention_format(recipe: str | None) -> str | None:
    from quant.recipes import get_recipe

    if is_high_precision(recipe):
        return None
    return get_recipe(recipe).attention_format


def save_tensor(tensor: torch.Tensor, layer_type: str, operation: str, quant_type: str | None = None,
                tensor_name: str = "tensor", layer_idx: int | None = None,
                **kw: Any) -> str | None:
    """The first capture API's function: save through the process-wide saver (``kw``: phase,
    component and the rest of TensorSaver.save_tensor's keywords)."""
    return get_tensor_saver().save_tensor(tensor, layer_type, operation, quant_type, tensor_name,
                                          layer_idx, **kw)


def save_attention_tensors(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           quant_type: str | None = None, operation: str = "forward",
                           layer_idx: int | None = None, **kw: Any) -> dict[str, str | None]:
    """The first capture API's function: TensorSaver.save_attention_tensors of the process's saver."""
    return get_tensor_saver().save_attention_tensors(query, key, value, quant_type, operation,
                                                     layer_idx, **kw)


def save_linear_tensors(input_tensor: torch.Tensor, weight: torch.Tensor,
                        quant_type: str | None = None, operation: str = "forward",
                        layer_idx: int | None = None, phase: str = "pre",
                        **kw: Any) -> dict[str, str | None]:
    """The first capture API's function: TensorSaver.save_linear_tensors of the process's saver."""
    return get_tensor_saver().save_linear_tensors(input_tensor, weight, quant_type, operation,
                                                  layer_idx, phase, **kw)
