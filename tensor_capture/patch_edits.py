"""The edits the patcher makes, per Megatron version family: data only, no file access.

Why families: from megatron-core 0.16.1 to Megatron-LM main the capture call sites barely move,
so one edit set serves several releases and a new release usually costs one table row. Each
family lists the edits it needs per file; edits that differ between families are built by the
small functions below (same call, different upstream lines around it).

Every anchor is a run of WHOLE lines, indentation included, that must occur exactly once in the
upstream file; ``patched`` contains the new text for those lines. The capture calls go through
``tensor_capture.hooks`` and are guarded by ``_tensor_saver.STATE.active`` (except the schedule
wrapper), so capture off runs the upstream code.
"""
from __future__ import annotations

from dataclasses import dataclass

MARK = "# tensor_capture patch"
IMPORT_LINE = f"from megatron.core import tensor_saver as _tensor_saver  {MARK}\n"

LAYERS = "megatron/core/tensor_parallel/layers.py"
ATTENTION = "megatron/core/transformer/dot_product_attention.py"
TE = "megatron/core/extensions/transformer_engine.py"
SCHEDULES = "megatron/core/pipeline_parallel/schedules.py"
PACKAGE_INFO = "megatron/core/package_info.py"


@dataclass(frozen=True)
class Edit:
    """Replace the whole lines ``anchor`` (found exactly once) by ``patched``."""
    name: str
    anchor: str
    patched: str


@dataclass(frozen=True)
class FilePatch:
    rel: str
    edits: tuple[Edit, ...]
    optional: bool = False   # skipped with a note when the file or an anchor is absent


@dataclass(frozen=True)
class Family:
    """Releases that share one edit set."""
    name: str
    releases: tuple[tuple[int, int, int], ...]   # (major, minor, lowest patch) per minor
    tested: tuple[str, ...]          # released versions the CI matrix downloads and patches
    differs: str                     # what is different from the previous family
    patches: tuple[FilePatch, ...]
    checked: str = ""                # what was checked by hand (trees that are not on PyPI)


def _prefix(name: str, anchor: str, added: str) -> Edit:
    return Edit(name, anchor, added + anchor)


def _suffix(name: str, anchor: str, added: str) -> Edit:
    return Edit(name, anchor, anchor + added)


def _import_after(line: str) -> Edit:
    return _suffix("import", line, IMPORT_LINE)


def _indent(text: str, n: int) -> str:
    pad = " " * n
    return "".join(pad + ln if ln.strip() else ln for ln in text.splitlines(keepends=True))


def _guarded_return(name: str, anchor: str, call: str, condition: str = "") -> Edit:
    """``if active: return <call>`` in front of the upstream return (anchor at 8 spaces)."""
    return _prefix(name, anchor, f"        if _tensor_saver.STATE.active{condition}:  {MARK}\n"
                                 f"            return _tensor_saver.{call}\n")


def _backward_post(name: str, n_none: int, grad_weight: str) -> Edit:
    """Capture call in front of backward's final return of ``n_none`` trailing Nones."""
    head = "grad_input, grad_weight, grad_bias" if grad_weight == "grad_weight" else "grad_input"
    anchor = f"        return {head}{', None' * n_none}\n"
    return _prefix(name, anchor, f"        if _tensor_saver.STATE.active:  {MARK}\n"
                                 f"            _tensor_saver.linear_backward_post(ctx, grad_input, "
                                 f"{grad_weight})\n")


def _wgrad(indent: int) -> Edit:
    """The unfused weight-gradient GEMM, wherever the version nests it."""
    return Edit("linear.wgrad", _indent("grad_weight = grad_output.t().matmul(total_input)\n", indent),
                _indent(f"""\
if _tensor_saver.STATE.active:  {MARK}
    grad_weight = _tensor_saver.linear_wgrad(ctx, grad_output, total_input)
else:
    grad_weight = grad_output.t().matmul(total_input)
""", indent))


# --- tensor_parallel/layers.py -----------------------------------------------------------------

_LAYERS_IMPORT = _import_after("from .utils import VocabUtility\n")

# LinearWithGradAccumulationAndAsyncCommunication.forward: the GEMM inline (<= 0.19) ...
_FWD_INLINE = _guarded_return("linear.forward", """\
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output
""", "linear_forward(ctx, total_input, weight, bias)")
# ... or in the module-level _linear_forward(input, weight, bias, output_dtype) (main). A wider
# output dtype goes through Transformer Engine's GEMM upstream; those calls stay upstream.
_FWD_CALL = _guarded_return(
    "linear.forward", "        return _linear_forward(total_input, weight, bias, output_dtype)\n",
    "linear_forward(ctx, total_input, weight, bias)",
    " and output_dtype in (None, total_input.dtype)")

def _guarded_dgrad(name: str, lead: str) -> Edit:
    """The dgrad GEMM through ``linear_dgrad`` when active; ``lead`` (the upstream line before
    it) makes the anchor occur once in the file."""
    gemm = "        grad_input = grad_output.matmul(weight)\n"
    return Edit(name, lead + gemm, f"""\
{lead}        if _tensor_saver.STATE.active:  {MARK}
            grad_input = _tensor_saver.linear_dgrad(ctx, grad_output, weight)
        else:
    {gemm}""")


_DGRAD = _guarded_dgrad("linear.dgrad", "                total_input = input\n")

# gradient_accumulation_fusion: apex's wgrad_gemm_accum_* into weight.main_grad (all versions).
_FUSED_WGRAD = Edit("linear.wgrad_fused", "                    if weight.main_grad.dtype == torch.float32:\n", f"""\
                    if _tensor_saver.STATE.active:  {MARK}
                        _tensor_saver.linear_wgrad_fused(
                            ctx, grad_output, total_input, weight.main_grad
                        )
                    elif weight.main_grad.dtype == torch.float32:
""")

# LinearWithFrozenWeight
# The guard goes after ``ctx.tp_group = tp_group``: backward reads it for the dgrad all-reduce.
_FROZEN_FWD_INLINE = Edit("frozen.forward", """\
        ctx.tp_group = tp_group
        output = torch.matmul(input, weight.t())
""", f"""\
        ctx.tp_group = tp_group
        if _tensor_saver.STATE.active:  {MARK}
            return _tensor_saver.linear_forward(ctx, input, weight, bias)
        output = torch.matmul(input, weight.t())
""")
_FROZEN_FWD_CALL = _guarded_return(
    "frozen.forward", "        return _linear_forward(input, weight, bias, output_dtype)\n",
    "linear_forward(ctx, input, weight, bias)", " and output_dtype in (None, input.dtype)")
_FROZEN_DGRAD_PLAIN = _guarded_dgrad("frozen.dgrad", "        (weight,) = ctx.saved_tensors\n")
# 0.19+: the dgrad splits on grad_output.dim() > 2 (a reshape work-around for torch's matmul).
_FROZEN_DGRAD_BRANCHED = Edit("frozen.dgrad", "        if grad_output.dim() > 2:\n", f"""\
        if _tensor_saver.STATE.active:  {MARK}
            grad_input = _tensor_saver.linear_dgrad(ctx, grad_output, weight)
        elif grad_output.dim() > 2:
""")

# --- transformer/dot_product_attention.py and extensions/transformer_engine.py -----------------

_ATTN_DEF = """\
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
"""


def _attn_wrapper(hook: str) -> Edit:
    return Edit(f"attention.{hook}", _ATTN_DEF, f"""\
    def forward(self, query, key, value, attention_mask, *args, **kwargs):  {MARK}
        \"\"\"Forward; with tensor capture or emulation active, runs through tensor_saver.\"\"\"
        if _tensor_saver.STATE.active:
            return _tensor_saver.{hook}(
                self, self._forward_unpatched, query, key, value, attention_mask, *args, **kwargs
            )
        return self._forward_unpatched(query, key, value, attention_mask, *args, **kwargs)

    def _forward_unpatched(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
""")


_ATTENTION = FilePatch(ATTENTION, (
    _import_after("from megatron.core.utils import divide\n"),
    _attn_wrapper("attention_forward"),
    _prefix("attention.probs", "        context = torch.bmm(attention_probs, value.transpose(0, 1))\n",
            f"""\
        if _tensor_saver.STATE.active:  {MARK}
            attention_probs = _tensor_saver.attention_probs(self, attention_probs)
"""),
))
# Transformer Engine attention: capture only (its fused kernel cannot be emulated from Python).
# The class exists only when TE imports, so the edit is inert without TE.
_TE = FilePatch(TE, (
    _import_after("from megatron.core.packed_seq_params import PackedSeqParams\n"),
    _attn_wrapper("te_attention_forward"),
), optional=True)

# --- pipeline_parallel/schedules.py: one call of the schedule = one iteration ------------------

_SCHEDULES = FilePatch(SCHEDULES, (
    _import_after("from megatron.core import parallel_state\n"),
    Edit("schedule.wrap", "    return forward_backward_func\n",
         f"    return _tensor_saver.wrap_schedule(forward_backward_func)  {MARK}\n"),
))


def _layers(*edits: Edit) -> FilePatch:
    return FilePatch(LAYERS, (_LAYERS_IMPORT, *edits))


FAMILIES: tuple[Family, ...] = (
    Family(
        "0.16", releases=((0, 16, 1), (0, 17, 0), (0, 18, 0)),
        tested=("0.16.1", "0.17.0", "0.17.1", "0.18.0", "0.18.2"),
        differs="baseline",
        patches=(
            _layers(_FWD_INLINE, _DGRAD, _wgrad(12), _FUSED_WGRAD,
                    _backward_post("linear.backward_post", 6, "grad_weight"),
                    _FROZEN_FWD_INLINE, _FROZEN_DGRAD_PLAIN,
                    _backward_post("frozen.backward_post", 4, "None")),
            _ATTENTION, _TE, _SCHEDULES),
    ),
    Family(
        "0.19", releases=((0, 19, 0),), tested=("0.19.0", "0.19.2"),
        differs="linear backward returns 10 values (gtp_remat_size); LinearWithFrozenWeight's "
                "dgrad splits on grad_output.dim() > 2",
        patches=(
            _layers(_FWD_INLINE, _DGRAD, _wgrad(12), _FUSED_WGRAD,
                    _backward_post("linear.backward_post", 7, "grad_weight"),
                    _FROZEN_FWD_INLINE, _FROZEN_DGRAD_BRANCHED,
                    _backward_post("frozen.backward_post", 4, "None")),
            _ATTENTION, _TE, _SCHEDULES),
    ),
    Family(
        "main", releases=((0, 20, 0),), tested=(),
        checked="Megatron-LM main d98e8a64ddf3 (2026-08-22), by hand",
        differs="forward GEMMs in module-level _linear_forward(..., output_dtype) (patched at the "
                "two call sites); backward returns 11 values; unfused wgrad nested one level "
                "deeper (GTP branches); frozen backward returns 6 values",
        patches=(
            _layers(_FWD_CALL, _DGRAD, _wgrad(16), _FUSED_WGRAD,
                    _backward_post("linear.backward_post", 8, "grad_weight"),
                    _FROZEN_FWD_CALL, _FROZEN_DGRAD_BRANCHED,
                    _backward_post("frozen.backward_post", 5, "None")),
            _ATTENTION, _TE, _SCHEDULES),
    ),
)


def family_for(version: tuple[int, int, int]) -> Family | None:
    """The family whose table row covers ``version`` (major, minor, patch), or None."""
    for fam in FAMILIES:
        for major, minor, lowest in fam.releases:
            if version[:2] == (major, minor) and version[2] >= lowest:
                return fam
    return None


def supported_text() -> str:
    """The supported list, as refusals and --help print it."""
    parts = []
    for fam in FAMILIES:
        for major, minor, lowest in fam.releases:
            label = f"{major}.{minor}.x" if lowest == 0 else f"{major}.{minor}.{lowest}+"
            parts.append(label + (" (Megatron-LM main)" if fam.name == "main" else ""))
    return ", ".join(parts)


def all_files() -> tuple[str, ...]:
    """Every file any family edits, plus package_info.py (read for the version)."""
    seen = {PACKAGE_INFO: None}
    for fam in FAMILIES:
        for fp in fam.patches:
            seen.setdefault(fp.rel, None)
    return tuple(seen)
