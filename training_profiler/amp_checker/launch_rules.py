"""Launch hazards: mistakes in a Megatron launch script that waste a GPU run, read statically.

Why: the flags that decide the precision of a Megatron-LM run live in a bash script (arrays of
arguments, exported variables, line continuations), and a few combinations silently do
something else than the user thinks (emulation that never applies, E5M2 everywhere, FP4 flags
the installed version ignores). The script is never run: it is split into words with their line
numbers (comments dropped, ``\\`` continuations joined); every ``--flag`` anywhere in it counts
as part of the launch (scripts build their argument arrays in pieces), and ``NAME=value``
assignments (``export`` or inline) with a literal value are read. One rule object per rule
(``LAUNCH_RULES``); each returns ``(line, message)`` pairs.
"""
from __future__ import annotations

import importlib.util
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from quant.vocabulary import (
    ENV_CONFIG,
    ENV_ENABLED,
    ENV_QUANT,
    TRUE_WORDS,
    Severity,
    is_high_precision,
)
from training_profiler.amp_checker.rules import Finding

_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_SHEBANG_OK = re.compile(r"^#!\s*(/usr/bin/env\s+)?(/bin/|/usr/bin/)?(ba|da|z|k)?sh\b")


class NotBash(ValueError):
    """The file is not a bash launch script (its first line names another interpreter)."""


@dataclass
class LaunchScript:
    """A launch script as words: flags with their values and lines, literal assignments."""

    path: str
    flags: dict[str, list[tuple[int, str | None]]] = field(default_factory=dict)
    assigns: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    runs: list[int] = field(default_factory=list)       # lines that start the training

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def value(self, flag: str) -> str | None:
        got = self.flags.get(flag)
        return got[-1][1] if got else None

    def line(self, flag: str) -> int:
        return self.flags[flag][0][0]


def parse_script(text: str, path: str = "<script>") -> LaunchScript:
    """Words of ``text`` with line numbers (NotBash if its shebang names another language)."""
    first = text.split("\n", 1)[0]
    if first.startswith("#!") and not _SHEBANG_OK.match(first):
        raise NotBash(f"not a bash script (first line {first.strip()!r})")
    out = LaunchScript(path)
    logical: list[tuple[int, str]] = []
    start, buf = 0, ""
    for no, raw in enumerate(text.splitlines(), 1):
        if not buf:
            start = no
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        logical.append((start, buf + raw))
        buf = ""
    if buf:
        logical.append((start, buf))
    launchers: list[int] = []
    for no, line in logical:
        try:
            lexer = shlex.shlex(line, posix=True, punctuation_chars="();|&")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            words = list(lexer)
        except ValueError:                       # an unbalanced quote: take the plain split
            words = line.split("#", 1)[0].split()
        for i, w in enumerate(words):
            m = _ASSIGN.match(w) if i == 0 or words[i - 1] in ("export", "(", ";", "&&") else None
            if m:
                out.assigns.setdefault(m.group(1), []).append((no, m.group(2)))
            elif w.startswith("--") and len(w) > 2:
                name, eq, val = w.partition("=")
                if not eq:
                    nxt = words[i + 1] if i + 1 < len(words) else None
                    val = nxt if nxt is not None and not nxt.startswith("-") and nxt not in "();|&" else None
                out.flags.setdefault(name, []).append((no, val))
            elif _MEGATRON_ENTRY.search(w):
                out.runs.append(no)
            elif w in ("torchrun", "python", "python3") or w.endswith("torch.distributed.run"):
                launchers.append(no)
    # a generic launcher counts when the arguments are Megatron-LM's (a torchrun of some other
    # program is not a Megatron launch)
    if not out.runs and launchers and any(f in out.flags for f in _MEGATRON_FLAGS):
        out.runs.append(launchers[0])
    return out


_MEGATRON_ENTRY = re.compile(r"(^|/)pretrain_\w+\.py$|(^|/)megatron/.*\.py$")
_MEGATRON_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                   "--micro-batch-size", "--global-batch-size", "--num-layers")


def _literal(value: str) -> str | None:
    """A value with no expansion in it, else None (unknown until run time)."""
    return None if "$" in value or "`" in value else value


def _quant_on_te(s: LaunchScript) -> list[tuple[int, str]]:
    impl = s.value("--transformer-impl") or "transformer_engine"   # Megatron-LM's default
    custom = (s.value("--fp8-recipe") == "custom" or s.value("--fp4-recipe") == "custom")
    out = []
    for no, raw in s.assigns.get(ENV_QUANT, []):
        v = _literal(raw)
        if v is not None and not is_high_precision(v) and impl == "transformer_engine" \
                and not custom:
            out.append((no, f"CUSTOM_QUANT_TYPE={v} with Transformer Engine linears "
                            f"(--transformer-impl {impl}{'' if s.has('--transformer-impl') else ', the default'})"))
    return out


def _e5m2_mxfp8(s: LaunchScript) -> list[tuple[int, str]]:
    if s.value("--fp8-format") == "e5m2" and s.value("--fp8-recipe") == "mxfp8":
        return [(s.line("--fp8-format"), "--fp8-format e5m2 with --fp8-recipe mxfp8: E5M2 for "
                 "every tensor, activations and weights included")]
    return []


def fp4_support() -> tuple[bool | None, str]:
    """(does the installed stack take FP4 flags?, why): megatron-core's TransformerConfig must
    have an ``fp4`` field, and Transformer Engine (when installed) an NVFP4 recipe; None when
    neither can be looked at."""
    import dataclasses
    import warnings

    try:
        with warnings.catch_warnings():       # megatron-core warns about absent TE / apex
            warnings.simplefilter("ignore")
            from megatron.core.transformer import TransformerConfig
    except Exception:
        return None, "megatron-core is not importable here"
    if "fp4" not in {f.name for f in dataclasses.fields(TransformerConfig)}:
        import megatron.core as mc

        return False, f"the installed megatron-core {getattr(mc, '__version__', '?')} has no fp4 setting"
    if importlib.util.find_spec("transformer_engine") is not None:
        try:
            from transformer_engine.common import recipe
        except Exception:
            return None, "transformer_engine does not import here"
        if not hasattr(recipe, "NVFP4BlockScaling"):
            return False, "the installed Transformer Engine has no NVFP4 recipe"
    return True, ""


def _fp4_ignored(s: LaunchScript) -> list[tuple[int, str]]:
    used = [f for f in ("--fp4-format", "--fp4-recipe") if s.has(f)]
    if not used:
        return []
    ok, why = fp4_support()
    if ok is False:
        return [(s.line(f), f"{f} is not taken by this installation: {why}") for f in used]
    return []


def _fp8_without_bf16(s: LaunchScript) -> list[tuple[int, str]]:
    if s.has("--fp8-format") and not s.has("--bf16"):
        return [(s.line("--fp8-format"), "--fp8-format without --bf16: the non-FP8 parts of the "
                 "model run in " + ("fp16" if s.has("--fp16") else "fp32"))]
    return []


def _fusion_without_apex(s: LaunchScript) -> list[tuple[int, str]]:
    if not s.runs or s.has("--no-gradient-accumulation-fusion"):
        return []
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None:
        return []
    return [(s.runs[0], "gradient-accumulation fusion is on (Megatron-LM's default) and apex's "
             "fused_weight_gradient_mlp_cuda is not installed here")]


def _unbounded_capture(s: LaunchScript) -> list[tuple[int, str]]:
    from tensor_capture.config import ConfigError, load_config

    on = [(no, v) for no, v in s.assigns.get(ENV_ENABLED, [])
          if (_literal(v) or "").strip().lower() in TRUE_WORDS]
    cfgs = [(no, _literal(v)) for no, v in s.assigns.get(ENV_CONFIG, [])]
    out = []
    for no, path in cfgs:
        if not on or not path:
            continue
        p = Path(path) if Path(path).is_absolute() else Path(s.path).parent / path
        try:
            cfg = load_config(env={ENV_ENABLED: "true", ENV_CONFIG: str(p)})
        except ConfigError:
            continue                      # capture itself refuses it at start, in one line
        if cfg.max_iterations == float("inf") and cfg.byte_budget == float("inf") and (
                cfg.iter_end is None):
            out.append((no, f"tensor capture with no iteration bound or byte budget ({path}: "
                            "max_iterations and byte_budget unlimited, no iterations end)"))
    return out


@dataclass(frozen=True)
class LaunchRule:
    id: str
    name: str
    severity: Severity
    explanation: str
    suggestion: str
    check: Callable[[LaunchScript], list[tuple[int, str]]]


LAUNCH_RULES: tuple[LaunchRule, ...] = (
    LaunchRule("LCH001", "quant-type-on-te-linears", Severity.HIGH,
               "CUSTOM_QUANT_TYPE emulates formats in megatron-core's local linears; Transformer "
               "Engine linears never call it, so the run trains in TE's precision while its "
               "logs say otherwise.",
               "Add --transformer-impl local, or pass --fp8-recipe custom --fp8-quantizer-factory "
               "te_integration.factory.quantizer_factory (docs/te.md).", _quant_on_te),
    LaunchRule("LCH002", "e5m2-under-mxfp8", Severity.HIGH,
               "Under the MXFP8 recipe --fp8-format e5m2 quantizes every tensor to E5M2 (2 "
               "mantissa bits), forward activations and weights included.",
               "Use --fp8-format e4m3 (or hybrid) with --fp8-recipe mxfp8.", _e5m2_mxfp8),
    LaunchRule("LCH003", "fp4-flags-ignored", Severity.HIGH,
               "The installed megatron-core or Transformer Engine has no FP4 path, so the FP4 "
               "flags do nothing (or fail late).",
               "Upgrade megatron-core / Transformer Engine, or emulate NVFP4 with "
               "CUSTOM_QUANT_TYPE=te_nvfp4 on local linears.", _fp4_ignored),
    LaunchRule("LCH004", "fp8-without-bf16", Severity.MEDIUM,
               "FP8 covers the GEMMs only; without --bf16 everything else runs in fp32 (or "
               "fp16 with loss scaling), which is rarely what an FP8 recipe was tuned with.",
               "Add --bf16 next to --fp8-format.", _fp8_without_bf16),
    LaunchRule("LCH005", "grad-accum-fusion-without-apex", Severity.MEDIUM,
               "Megatron-LM fuses the weight-gradient accumulation through apex's "
               "fused_weight_gradient_mlp_cuda unless told not to; without apex the run stops "
               "at the first backward.",
               "Install apex with its CUDA extensions, or pass --no-gradient-accumulation-fusion.",
               _fusion_without_apex),
    LaunchRule("LCH006", "unbounded-capture", Severity.MEDIUM,
               "Tensor capture with no iteration bound and no byte budget fills the disk on a "
               "long run.",
               "Set max_iterations, byte_budget or iterations: {end: N} in the capture config.",
               _unbounded_capture),
)
LAUNCH_RULES_BY_ID = {r.id: r for r in LAUNCH_RULES}
LAUNCH_RULES_BY_NAME = {r.name: r for r in LAUNCH_RULES}


def check_script(text: str, path: str = "<script>",
                 rules: tuple[LaunchRule, ...] | list[LaunchRule] = LAUNCH_RULES) -> list[Finding]:
    """Findings of ``rules`` in a launch script's text, by line (NotBash for another language)."""
    script = parse_script(text, path)
    found = []
    for rule in rules:
        for line, message in rule.check(script):
            found.append(Finding(rule.id, rule.severity, path, line, 1, message,
                                 rule.explanation, rule.suggestion))
    return sorted(found, key=lambda f: (f.line, f.rule_id))
