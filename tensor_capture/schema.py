"""The on-disk format of captured tensors: file names, metadata keys, manifest records.

Every writer builds names here and every reader parses them here; nothing else
splits a file name on underscores.

Current file name (iteration, rank and micro-batch in the name)::

    {YYYYMMDD_HHMMSS}_{counter:04d}_iter{iteration}_{layer_type}_L{layer_idx}_{operation}_
    {phase}_{component}_{quant_type}_rank{rank}_sample{sample_idx}_{tensor_name}.pt

``None`` in an integer field is written ``NA`` (``LNA`` for a linear outside any
transformer layer, ``sampleNA`` when the micro-batch is unknown). ``layer_idx`` is
0-based, matching the module path ``decoder.layers.{i}``.

Older names still parse (fields they lack come back as ``None`` / ``"unknown"``):

- v2 (phase and component, no iteration / rank): ``{ts}_{counter}_{layer_type}_L{idx}_{operation}_{phase}_{component}_{quant}_{tensor}.pt``
- v1 (the first capture's names): ``{ts}_{counter}_{layer_type}[_L{idx}]_{operation}_{quant}_{tensor}.pt``

A saved file holds ``{"tensor": <CPU tensor, original dtype>, "metadata": {...}}``.
Each rank appends one JSON object per saved tensor to ``manifest_rank{rank}.jsonl``
in the save directory: the metadata plus ``file`` (the name relative to the
directory, or ``None`` in stats-only mode).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Iterator

from quant.formats import UNDERSCORED_NAMES  # the format table; loads no torch
from quant.vocabulary import HIGH_PRECISION

SCHEMA_VERSION = 3

MANIFEST_GLOB = "manifest_rank*.jsonl"
TENSOR_SUFFIX = ".pt"

# Quant-type names that contain underscores; only needed to split the ambiguous
# older names (v1/v2), where quant_type and tensor_name are both free text.
_UNDERSCORED_QUANT_TYPES = UNDERSCORED_NAMES   # from quant.FORMATS, longest first


@dataclass(frozen=True)
class TensorName:
    """Every field a captured tensor's file name carries."""

    layer_type: str
    operation: str
    tensor_name: str
    quant_type: str = "unknown"
    layer_idx: int | None = None
    phase: str = "unknown"
    component: str = "unknown"
    iteration: int | None = None
    rank: int | None = None
    sample_idx: int | None = None
    timestamp: str = "00000000_000000"
    counter: int = 0
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


NAME_FIELDS = tuple(f.name for f in fields(TensorName))


def _fmt_int(value: int | None) -> str:
    return "NA" if value is None else str(int(value))


def _parse_int(text: str | None) -> int | None:
    if text is None or text == "NA":
        return None
    return int(text)


_SAFE_TOKEN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _check_token(field_name: str, value: str, allow_underscore: bool = True) -> None:
    if not isinstance(value, str) or not _SAFE_TOKEN.match(value) or (
        not allow_underscore and "_" in value
    ):
        raise ValueError(
            f"{field_name}={value!r} cannot go into a tensor file name: use letters, digits, '.', '-'"
            + (" and '_'" if allow_underscore else "")
        )


def _compose(timestamp: str, counter: str, iteration: str, layer_type: str, layer_idx: str,
             operation: str, phase: str, component: str, quant_type: str, rank: str,
             sample_idx: str, tensor_name: str) -> str:
    """The one layout of a current-format name, from already formatted fields."""
    return (
        f"{timestamp}_{counter}_iter{iteration}_{layer_type}_L{layer_idx}_{operation}_{phase}"
        f"_{component}_{quant_type}_rank{rank}_sample{sample_idx}_{tensor_name}{TENSOR_SUFFIX}"
    )


def build_filename(name: TensorName) -> str:
    """The current-format file name for ``name`` (validates every field)."""
    _check_token("layer_type", name.layer_type, allow_underscore=False)
    _check_token("operation", name.operation, allow_underscore=False)
    _check_token("phase", name.phase, allow_underscore=False)
    _check_token("component", name.component, allow_underscore=False)
    _check_token("quant_type", name.quant_type)
    _check_token("tensor_name", name.tensor_name)
    if not re.fullmatch(r"\d{8}_\d{6}", name.timestamp):
        raise ValueError(f"timestamp={name.timestamp!r} must look like YYYYMMDD_HHMMSS")
    return _compose(name.timestamp, f"{name.counter:04d}", _fmt_int(name.iteration),
                    name.layer_type, _fmt_int(name.layer_idx), name.operation, name.phase,
                    name.component, name.quant_type, _fmt_int(name.rank),
                    _fmt_int(name.sample_idx), name.tensor_name)


#: A field of :func:`filename_glob` that matches any value.
ANY: Any = object()


def filename_glob(*, iteration: Any = ANY, layer_type: Any = ANY, layer_idx: Any = ANY,
                  operation: Any = ANY, phase: Any = ANY, component: Any = ANY,
                  quant_type: Any = ANY, rank: Any = ANY, sample_idx: Any = ANY,
                  tensor_name: Any = ANY) -> str:
    """A glob pattern (``Path.glob`` / ``fnmatch``) for current-format names with the given
    fields, e.g. every file of layer 3 at iteration 120 on rank 0; ``ANY`` fields match
    anything (``None`` in an integer field means ``NA``, as in the names). Why here: tools that
    point a user at captured files (the training monitor's alerts) must not re-spell the layout."""
    def i(v: Any) -> str:
        return "*" if v is ANY else _fmt_int(v)

    def t(v: Any) -> str:
        return "*" if v is ANY else str(v)

    return _compose("*", "*", i(iteration), t(layer_type), i(layer_idx), t(operation), t(phase),
                    t(component), t(quant_type), i(rank), i(sample_idx), t(tensor_name))


_INT = r"(?:\d+|NA)"
_V3 = re.compile(
    rf"^(?P<timestamp>\d{{8}}_\d{{6}})_(?P<counter>\d+)_iter(?P<iteration>{_INT})"
    rf"_(?P<layer_type>[A-Za-z0-9.-]+)_L(?P<layer_idx>{_INT})_(?P<operation>[A-Za-z0-9.-]+)"
    rf"_(?P<phase>[A-Za-z0-9.-]+)_(?P<component>[A-Za-z0-9.-]+)_(?P<quant_type>.+?)"
    rf"_rank(?P<rank>{_INT})_sample(?P<sample_idx>{_INT})_(?P<tensor_name>.+)\.pt$"
)
_V2 = re.compile(
    r"^(?P<timestamp>\d{8}_\d{6})_(?P<counter>\d+)_(?P<layer_type>[A-Za-z0-9.-]+)"
    r"_L(?P<layer_idx>\d+)_(?P<operation>forward|backward)_(?P<phase>pre|post|unknown)"
    r"_(?P<component>[A-Za-z0-9.-]+)_(?P<rest>.+)\.pt$"
)
_V1 = re.compile(
    r"^(?P<timestamp>\d{8}_\d{6})_(?P<counter>\d+)_(?P<layer_type>[A-Za-z0-9.-]+)"
    r"(?:_L(?P<layer_idx>\d+))?_(?P<operation>forward|backward)_(?P<rest>.+)\.pt$"
)


def _split_quant_and_tensor(rest: str) -> tuple[str, str]:
    for quant in _UNDERSCORED_QUANT_TYPES:
        if rest.startswith(quant + "_") and len(rest) > len(quant) + 1:
            return quant, rest[len(quant) + 1:]
    quant, sep, tensor = rest.partition("_")
    if not sep or not tensor:
        raise ValueError("no tensor name after the quant type")
    return quant, tensor


def parse_filename(filename: str | os.PathLike[str]) -> TensorName:
    """Parse a captured tensor's file name (any schema version); ValueError if it is not one."""
    base = os.path.basename(os.fspath(filename))
    m = _V3.match(base)
    if m:
        g = m.groupdict()
        return TensorName(
            layer_type=g["layer_type"], operation=g["operation"], tensor_name=g["tensor_name"],
            quant_type=g["quant_type"], layer_idx=_parse_int(g["layer_idx"]), phase=g["phase"],
            component=g["component"], iteration=_parse_int(g["iteration"]),
            rank=_parse_int(g["rank"]), sample_idx=_parse_int(g["sample_idx"]),
            timestamp=g["timestamp"], counter=int(g["counter"]), schema_version=3,
        )
    for version, pattern in ((2, _V2), (1, _V1)):
        m = pattern.match(base)
        if not m:
            continue
        g = m.groupdict()
        try:
            quant, tensor = _split_quant_and_tensor(g["rest"])
        except ValueError:
            continue
        return TensorName(
            layer_type=g["layer_type"], operation=g["operation"], tensor_name=tensor,
            quant_type=quant, layer_idx=_parse_int(g.get("layer_idx")),
            phase=g.get("phase") or "unknown", component=g.get("component") or "unknown",
            timestamp=g["timestamp"], counter=int(g["counter"]), schema_version=version,
        )
    raise ValueError(f"{base}: not a captured tensor file name (expected {_EXAMPLE})")


_EXAMPLE = build_filename(TensorName(
    layer_type="linear", operation="forward", tensor_name="input", quant_type="hifp8",
    layer_idx=1, phase="pre", component="linear", iteration=0, rank=0, sample_idx=0,
    timestamp="20250908_095220", counter=5,
))


def is_tensor_filename(filename: str | os.PathLike[str]) -> bool:
    try:
        parse_filename(filename)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Metadata: keys the saver writes beside the naming fields. Readers use these names.
# ---------------------------------------------------------------------------------------------
META_SHAPE = "shape"                  # list[int], of the full tensor (before row sampling)
META_DTYPE = "dtype"                  # e.g. "torch.bfloat16"
META_MODULE_PATH = "module_path"      # e.g. "decoder.layers.3.mlp.linear_fc1"
META_SUBMODULE = "submodule"          # linear_qkv | linear_proj | linear_fc1 | linear_fc2 | core_attention
META_VARIANT = "variant"              # VARIANT_HP or VARIANT_QUANTIZED
META_STATS = "stats"                  # dict, see STAT_KEYS
META_SAMPLED_ROWS = "sampled_rows"    # None, or the number of rows kept in the file
META_SAMPLED_ROW_STRIDE = "sampled_row_stride"   # stride of the kept rows (None: all kept)
META_EMULATED_FORMAT = "emulated_format"         # CUSTOM_QUANT_TYPE being emulated, or None
META_RECIPE = "recipe"                # the emulated recipe (quant.recipes name), or None
# For a linear GEMM operand (input / weight / grad_output and their quantized variants) under
# emulation: {gemm: quant.role_quantizers.RoleQuantizer.summary()} for each GEMM the tensor feeds
# (fprop / dgrad / wgrad): kind, element, tile, pow2_scale, rounding, rht.
META_RECIPE_SPECS = "recipe_specs"
META_TP_RANK, META_PP_RANK, META_DP_RANK, META_WORLD_SIZE = (
    "tp_rank", "pp_rank", "dp_rank", "world_size")
META_PARALLEL = (META_TP_RANK, META_PP_RANK, META_DP_RANK, META_WORLD_SIZE)
META_MCORE_VERSION = "megatron_core_version"
MANIFEST_FILE = "file"                # relative file name, None in stats-only mode

#: the values of a record's operation, phase and layer_type (and of the capture filters on them)
OPERATIONS = ("forward", "backward")
PHASES = ("pre", "post")
LAYER_TYPES = ("attention", "linear")
# Values of META_VARIANT: the high-precision tensor, or the operand a GEMM saw (fake-quantized).
VARIANT_HP = HIGH_PRECISION
VARIANT_QUANTIZED = "quantized"
# Tensor-name suffixes of a quantized operand: "input_quantized" beside "input" (forward / dgrad
# operand), "grad_output_quantized_wgrad" beside "grad_output" (quantized along the wgrad GEMM's
# reduction axis). Longest first, so a reader strips the right one.
QUANTIZED_SUFFIX = "_quantized"
QUANTIZED_WGRAD_SUFFIX = "_quantized_wgrad"
QUANTIZED_SUFFIXES = (QUANTIZED_WGRAD_SUFFIX, QUANTIZED_SUFFIX)


def quantized_name(tensor_name: str, wgrad: bool = False) -> str:
    """The tensor name of ``tensor_name``'s quantized operand (``input`` -> ``input_quantized``)."""
    return tensor_name + (QUANTIZED_WGRAD_SUFFIX if wgrad else QUANTIZED_SUFFIX)


def hp_twin_name(tensor_name: str) -> str:
    """The high-precision tensor name a quantized operand's name refers to."""
    for suffix in QUANTIZED_SUFFIXES:
        if tensor_name.endswith(suffix):
            return tensor_name[: -len(suffix)]
    return tensor_name


@dataclass(frozen=True, slots=True)
class CaptureSite:
    """What a capture call site knows about a tensor: where in the model and in the step it is
    taken. Hooks build one per tensor and pass it by keyword through the saver to the record.

    Why these fields and not the others of :class:`TensorName`: a site is fixed by the code and
    the model (the same linear input, in the same module, in every iteration), while
    ``iteration``, ``rank`` and ``sample_idx`` are run-time facts of one event that the saver
    reads from the schedule (tensor_capture.numbering) and the process when the call leaves them
    out, and ``timestamp`` / ``counter`` are assigned by the saver as it books the record.
    ``quant_type`` None lets the saver label the tensor (the emulated format, else its dtype).
    ``module_path`` / ``submodule`` / ``variant`` are metadata keys (META_MODULE_PATH,
    META_SUBMODULE, META_VARIANT), not file-name fields.
    """

    layer_type: str
    operation: str
    phase: str = "unknown"
    tensor_name: str = "tensor"
    component: str = "unknown"
    layer_idx: int | None = None
    module_path: str | None = None
    submodule: str | None = None
    quant_type: str | None = None
    variant: str = VARIANT_HP


# Statistics computed on the whole tensor before any copy or sampling.
STAT_KEYS = (
    "numel", "min", "max", "mean", "std", "absmax", "min_nonzero_abs",
    "zero_count", "nan_count", "inf_count",
)
# ... of which these are integer counts (the others are floats, None when undefined)
STAT_COUNT_KEYS = ("numel", "zero_count", "nan_count", "inf_count")
# Overflow/underflow against a dtype or quant format, stored under stats["range"][name]:
# {"upper_overflow_count", "lower_overflow_count", "overflow_count", "underflow_count",
#  "flush_to_zero_count", and "*_ratio" for each}, with quant.analysis' definitions (upper:
# +Inf and values whose cast rounds above max_normal, lower: the same below -max_normal,
# underflow: 0 < |x| < min_normal, flush_to_zero: nonzero values the cast rounds to 0).
STAT_RANGE = "range"
#: the counts of one range entry, in the order the device statistics pack them
STAT_RANGE_COUNT_KEYS = ("upper_overflow_count", "lower_overflow_count", "underflow_count",
                         "flush_to_zero_count")
#: every key of one range entry: the counts, their overflow total, a ratio per count, and the
#: format's limits they were judged against
STAT_RANGE_KEYS = (*STAT_RANGE_COUNT_KEYS, "overflow_count",
                   *(k.replace("_count", "_ratio") for k in (*STAT_RANGE_COUNT_KEYS, "overflow_count")),
                   "max_normal", "min_normal", "min_subnormal")
# log2-magnitude histogram of finite nonzero values: {"min_exp": e0, "counts": [n_e0, n_e0+1, ...]}
# where a value x falls in bin floor(log2(|x|)).
STAT_LOG2_HIST = "log2_hist"
# Scaled formats (MX, NVFP4, *_tensor) are not compared raw with the element range; for GEMM
# operands the saver stores quant.analyze_quantization(x, fmt, axis=<reduction axis>).to_dict()
# (overflow / underflow / flush-to-zero after the block or tensor scale) per format name here.
META_QUANT_ANALYSIS = "quant_analysis"
# What-if numerics of a high-precision tensor (tensor_capture.whatif, quant.whatif's numbers):
# {"axis": the axis blocks ran along, "axis_source": "gemm" (the reduction axis of the GEMM the
#  tensor feeds, quant.gemm_plan) or "last" (not a GEMM operand: the last axis),
#  "elements": how many elements were analysed, "sampled": True when that is a strided subset
#  of rows (config whatif_max_elements; blocks along the axis stay whole),
#  "formats": {format name: quant.whatif.whatif(...) dict, or {"error": text}}}
META_WHATIF = "whatif"
WHATIF_AXIS, WHATIF_AXIS_SOURCE, WHATIF_FORMATS = "axis", "axis_source", "formats"
WHATIF_ELEMENTS, WHATIF_SAMPLED = "elements", "sampled"
AXIS_FROM_GEMM, AXIS_LAST = "gemm", "last"
# Attention probabilities (softmax output, the P operand of P·V as the BMM sees it, after
# dropout): a sampled subset of heads and query rows (config probs_heads / probs_rows), saved as
# [heads kept, rows kept, keys]. META_PROBS_SAMPLE = {"heads": kept head indexes in this rank's
# partition, "head_count": heads in the partition, "row_stride": stride of the kept query rows,
# "shape": the full [batch*heads, queries, keys] shape}. Statistics, what-if numerics and the
# file describe the sample (META_SHAPE is the sample's shape).
ATTENTION_PROBS = "attention_probs"
META_PROBS_SAMPLE = "probs_sample"
# A tensor captured through Transformer Engine's debug API (te_integration.features):
# {"namespace": the debug-API namespace, "tensor": the debug API's own name of the tensor}.
META_DEBUG_API = "debug_api"

#: Every metadata key the saver may write beside the naming fields (tensor_capture.record), in
#: the order it writes them; a manifest record is NAME_FIELDS + these + MANIFEST_FILE. Readers
#: that index records (tensor_viz.columnar) check themselves against RECORD_KEYS.
META_KEYS = (
    META_SHAPE, META_DTYPE, META_MODULE_PATH, META_SUBMODULE, META_VARIANT, META_SAMPLED_ROWS,
    META_SAMPLED_ROW_STRIDE, META_EMULATED_FORMAT, *META_PARALLEL, META_MCORE_VERSION,
    META_RECIPE, META_RECIPE_SPECS, META_QUANT_ANALYSIS, META_STATS, META_WHATIF,
    META_PROBS_SAMPLE, META_DEBUG_API,
)
RECORD_KEYS = NAME_FIELDS + META_KEYS + (MANIFEST_FILE,)


def manifest_path(directory: str | os.PathLike[str], rank: int | None) -> Path:
    return Path(directory) / f"manifest_rank{_fmt_int(rank)}.jsonl"


#: one encoder for every manifest line (json.dumps with options builds one per call); records
#: are plain dicts the saver built, so no cycle check
_MANIFEST_JSON = json.JSONEncoder(default=str, allow_nan=True, check_circular=False)


def append_manifest(directory: str | os.PathLike[str], rank: int | None,
                    *records: dict[str, Any]) -> None:
    """Append records, one line each, in one write (O_APPEND keeps lines whole; the writer
    thread hands over all the records it finished since its queue was last empty)."""
    data = "".join(_MANIFEST_JSON.encode(r) + "\n" for r in records).encode()
    fd = os.open(manifest_path(directory, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def read_json_lines(paths: Iterable[str | os.PathLike[str]]) -> Iterator[dict[str, Any]]:
    """Every JSON object of these JSON-lines files, in order; a torn last line (a crash
    mid-write) and lines that are not objects are skipped."""
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict):
                    yield record


def read_manifest(directory: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Every record of every rank's manifest; a torn last line (crash mid-write) is skipped."""
    yield from read_json_lines(sorted(Path(directory).glob(MANIFEST_GLOB)))


def record_name(record: dict[str, Any]) -> TensorName:
    """The naming fields of a manifest record or a file's metadata."""
    known = {k: record[k] for k in NAME_FIELDS if k in record}
    for required in ("layer_type", "operation", "tensor_name"):
        known.setdefault(required, "unknown")
    return TensorName(**known)


class UnsafeTensorFileError(ValueError):
    """A file whose pickle holds objects other than tensors: refused, loading it could run code."""


def _is_refused_archive(path: str, exc: BaseException) -> bool:
    """A whole torch archive whose pickle weights_only refused (not merely garbage bytes)."""
    import pickle
    import zipfile

    if not (isinstance(exc, pickle.UnpicklingError) and "weights only" in str(exc).lower()):
        return False
    try:
        return zipfile.is_zipfile(path)
    except OSError:
        return False


def _load_failure_reason(exc: BaseException) -> str:
    """A short reason for a failed load, without torch's advice to load unsafely."""
    text = str(exc)
    if "weights only" in text.lower() or isinstance(exc, KeyError):
        return "not a PyTorch tensor file"
    if "zip" in text.lower() or "archive" in text.lower() or isinstance(exc, EOFError):
        return "truncated or not a PyTorch file"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first[:160] or type(exc).__name__


def load_tensor_file(path: str | os.PathLike[str]) -> tuple[Any, dict[str, Any]]:
    """Load a captured file safely (weights_only). Returns (tensor, metadata).

    Accepts the saver's ``{"tensor", "metadata"}`` dict or a bare tensor (metadata
    then comes from the file name when it parses, else is empty). Raises ValueError
    with the file name for anything else: unreadable, corrupt, or a pickle that would
    need code to run.
    """
    import torch

    p = os.fspath(path)
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt, truncated, or refused by weights_only
        if _is_refused_archive(p, exc):
            raise UnsafeTensorFileError(
                f"{p}: refused: it holds Python objects other than tensors, and loading them could run code"
            ) from None
        raise ValueError(f"{p}: cannot be read as a tensor file ({_load_failure_reason(exc)})") from None
    if isinstance(obj, torch.Tensor):
        try:
            meta: dict[str, Any] = parse_filename(p).to_dict()
        except ValueError:
            meta = {}
        return obj, meta
    if isinstance(obj, dict) and isinstance(obj.get("tensor"), torch.Tensor):
        meta = obj.get("metadata") or {}
        if not isinstance(meta, dict):
            meta = {}
        return obj["tensor"], meta
    raise ValueError(f"{p}: holds a {type(obj).__name__}, not a tensor or a {{'tensor', 'metadata'}} dict")


# ---------------------------------------------------------------------------------------------
# The flight recorder's output (mode: recorder; tensor_capture.recorder.flight, docs/capture.md
# "Recorder mode"): under ``<save_dir>/recorder/`` beside the capture's own manifests.
# ---------------------------------------------------------------------------------------------
RECORDER_DIR = "recorder"
#: per rank, one Parquet file per K iterations: one row per iteration x site, micro-batches merged
RECORDER_SUMMARY_GLOB = "summary_rank*_it*.parquet"
#: per rank, one JSON line per trigger this rank agreed on
RECORDER_TRIGGERS_GLOB = "triggers_rank*.jsonl"
#: one per trigger (written by global rank 0): how to replay it from a checkpoint
RECORDER_REPLAY_GLOB = "replay_it*.json"
#: per rank, one JSON line per iteration with a loss ({"iteration", "rank", "loss"}: the
#: schedule's, on the last pipeline stage), appended with each summary file
RECORDER_LOSS_GLOB = "loss_rank*.jsonl"
#: the file a user touches to ask for a trigger (in the save directory itself)
RECORDER_TRIGGER_FILE = "TRIGGER"


@dataclass(frozen=True)
class RecStat:
    """One mergeable statistic of the flight recorder: its summary column, its value over no
    element (the identity of its merge: an empty tensor's row, a slot not yet filled) and how
    it merges over micro-batches, iterations and ranks ("sum", "min" or "max")."""

    name: str
    identity: float
    merge: str


#: the recorder's statistics, one row each, in the order its buffers hold them (the index of a
#: row is where every path writes it: tensor_capture.recorder.stats, the C kernel of
#: tensor_capture.stats_cpu); ``count`` (elements) is kept on the host beside them
REC_STAT_ROWS = (
    RecStat("sum", 0.0, "sum"),
    RecStat("sumsq", 0.0, "sum"),
    RecStat("min", float("inf"), "min"),       # over the finite values
    RecStat("max", float("-inf"), "max"),
    RecStat("nan_count", 0.0, "sum"),
    RecStat("inf_count", 0.0, "sum"),
    RecStat("flush_count", 0.0, "sum"),        # 0 < |x| < the judged format's flush bound
    RecStat("saturation_count", 0.0, "sum"),   # |x| >= its overflow bound, +-Inf included
)
REC_STATS = tuple(r.name for r in REC_STAT_ROWS)
#: the element count: merged as the counts are
REC_COUNT = RecStat("count", 0.0, "sum")
#: how each column merges
REC_MERGE = {r.name: r.merge for r in (REC_COUNT, *REC_STAT_ROWS)}
#: a summary row: where (the site, in first-seen = execution order), then the merged statistics
REC_SITE_KEYS = ("site", "module_path", "layer_type", "layer_idx", "operation", "phase",
                 "tensor_name", "variant", "quant_type")
REC_SUMMARY_COLUMNS = ("iteration", "rank", *REC_SITE_KEYS, "micro_batches", "count", *REC_STATS)


def recorder_summary_name(rank: int | None, first_iteration: int) -> str:
    return f"summary_rank{_fmt_int(rank)}_it{first_iteration:07d}.parquet"


#: a rollup tier's rows (tensor_capture.recorder.out.rollup) each merge a span of iterations:
#: ``iteration`` is its first, this column its last (a full-resolution row has none: its own)
REC_LAST_ITERATION = "last_iteration"
#: a rollup tier's file: tier t >= 1, the span [first, last] of the finer files it replaced
RECORDER_TIER_RE = re.compile(r"summary_rank(?P<rank>\w+?)_it(?P<first>\d+)"
                              r"(?:_to(?P<last>\d+)_t(?P<tier>\d+))?\.parquet$")


def recorder_tier_name(rank: int | None, first: int, last: int, tier: int) -> str:
    return f"summary_rank{_fmt_int(rank)}_it{first:07d}_to{last:07d}_t{tier}.parquet"


def recorder_triggers_name(rank: int | None) -> str:
    return f"triggers_rank{_fmt_int(rank)}.jsonl"


def recorder_loss_name(rank: int | None) -> str:
    return f"loss_rank{_fmt_int(rank)}.jsonl"


def recorder_replay_name(iteration: int) -> str:
    return f"replay_it{iteration:07d}.json"
