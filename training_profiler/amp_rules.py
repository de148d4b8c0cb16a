"""The static AMP checker's rules: one Rule object (id, severity, texts) and one visitor each.

The rules follow PyTorch's automatic-mixed-precision documentation: which ops autocast runs in
float32 and which in low precision, what autocast refuses (binary_cross_entropy on CUDA), the
GradScaler workflow (unscale before clipping), and the deprecated ``torch.cuda.amp`` names.
Each visitor only reports; filtering (suppression comments, rule selection) happens in
``static_checker``.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from training_profiler.amp_context import FileContext, dotted

_FP16 = np.finfo(np.float16)
FP16_MAX = float(_FP16.max)
FP16_MIN_SUBNORMAL = float(_FP16.smallest_subnormal)


class Severity(IntEnum):
    LOW = 1
    MEDIUM = 2
    HIGH = 3

    @classmethod
    def parse(cls, text: str) -> "Severity":
        try:
            return cls[text.upper()]
        except KeyError:
            raise ValueError(f"unknown severity {text!r}; use low, medium or high") from None


@dataclass(frozen=True)
class Finding:
    rule_id: str
    severity: Severity
    path: str
    line: int
    col: int
    message: str
    explanation: str
    suggestion: str

    def to_dict(self) -> dict:
        return {"path": self.path, "line": self.line, "col": self.col, "rule": self.rule_id,
                "severity": self.severity.name, "message": self.message,
                "explanation": self.explanation, "suggestion": self.suggestion}


class RuleVisitor(ast.NodeVisitor):
    """Base visitor: walks the tree and collects (node, message) pairs for its rule."""

    def __init__(self, ctx: FileContext) -> None:
        self.ctx = ctx
        self.hits: list[tuple[ast.AST, str]] = []

    def report(self, node: ast.AST, message: str) -> None:
        self.hits.append((node, message))

    def run(self) -> list[tuple[ast.AST, str]]:
        self.visit(self.ctx.tree)
        return self.hits


_LOSS_NAME = re.compile(r"(loss|crit|cross_entropy|nll|mse|l1|bce|kl_div|huber)", re.I)


def _is_loss_call(ctx: FileContext, call: ast.Call) -> bool:
    name = ctx.call_name(call) or ""
    return bool(_LOSS_NAME.search(name.split(".")[-1]))


def _has_kw(call: ast.Call, name: str) -> bool:
    return any(k.arg == name for k in call.keywords)


# --------------------------------------------------------------------------------------------
class ManualCast(RuleVisitor):
    def visit_Call(self, node: ast.Call) -> None:
        if self.ctx.uses_amp:
            d = self.ctx.lowp_cast_dtype(node)
            if d:
                attr = node.func.attr  # type: ignore[attr-defined]
                what = f".{attr}()" if attr in ("half", "bfloat16") else f".{attr}({d})"
                self.report(node, f"{what} call detected")
        self.generic_visit(node)


_BCE = {"torch.nn.functional.binary_cross_entropy", "torch.binary_cross_entropy",
        "torch.nn.BCELoss", "torch.nn.modules.loss.BCELoss"}


class BceUnderAutocast(RuleVisitor):
    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        if ctx.uses_amp and not ctx.cpu_only_autocast and ctx.call_name(node) in _BCE:
            scope = ctx.scope_of(node)
            if scope is None or scope.enabled:
                name = ctx.call_name(node).split(".")[-1]  # type: ignore[union-attr]
                self.report(node, f"{name} usage in AMP code")
        self.generic_visit(node)


def _assigned_names(stmt: ast.AST) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(stmt):
        if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and isinstance(
                getattr(n, "value", None), ast.Call):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                for x in ast.walk(t):
                    if isinstance(x, ast.Name):
                        out.add(x.id)
    return out


def _statement_lists(tree: ast.AST):
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                yield stmts


class LossOutsideAutocast(RuleVisitor):
    def run(self):
        ctx = self.ctx
        for stmts in _statement_lists(ctx.tree):
            produced: set[str] = set()
            for stmt in stmts:
                if isinstance(stmt, (ast.With, ast.AsyncWith)) and any(
                        (s := ctx.autocast_call(i.context_expr)) is not None and s.enabled
                        for i in stmt.items):
                    produced |= _assigned_names(stmt)
                    continue
                if not produced:
                    continue
                for call in (n for n in ast.walk(stmt) if isinstance(n, ast.Call)):
                    if ctx.in_autocast(call) or not _is_loss_call(ctx, call):
                        continue
                    used = {x.id for a in list(call.args) + [k.value for k in call.keywords]
                            for x in ast.walk(a) if isinstance(x, ast.Name)}
                    if used & produced:
                        name = (ctx.call_name(call) or "loss").split(".")[-1]
                        self.report(call, f"loss `{name}(...)` computed outside the autocast block")
        return self.hits


_SOFTMAX = {"torch.softmax", "torch.log_softmax", "torch.nn.functional.softmax",
            "torch.nn.functional.log_softmax", "torch.special.softmax", "torch.special.log_softmax"}


class _LowpNames(RuleVisitor):
    """Visits in source order, tracking names that hold low-precision tensors: results of calls
    made inside an enabled autocast (except losses, which autocast runs in float32) and results
    of manual casts."""

    def __init__(self, ctx: FileContext) -> None:
        super().__init__(ctx)
        self.lowp: set[str] = set()

    def _update(self, targets: list[ast.AST], value: ast.AST | None, node: ast.AST) -> None:
        if isinstance(value, ast.Call):
            lowp = self.ctx.lowp_cast_dtype(value) is not None or (
                self.ctx.in_autocast(node) and not _is_loss_call(self.ctx, value)) or (
                (self.ctx.call_name(value) or "").split(".")[-1] in self.ctx.lowp_functions)
        else:  # a matmul or other arithmetic computed under autocast
            lowp = isinstance(value, ast.BinOp) and self.ctx.in_autocast(node)
        for t in targets:
            if isinstance(t, ast.Name):
                (self.lowp.add if lowp else self.lowp.discard)(t.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        self._update(node.targets, node.value, node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        self._update([node.target], node.value, node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        saved, self.lowp = self.lowp, set()
        self.generic_visit(node)
        self.lowp = saved

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def operand(self, call: ast.Call) -> ast.AST | None:
        if isinstance(call.func, ast.Attribute) and not (self.ctx.qualname(call.func) or "").startswith("torch."):
            return call.func.value
        return call.args[0] if call.args else None


class SoftmaxNoDtype(_LowpNames):
    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        name = ctx.call_name(node) or ""
        is_method = isinstance(node.func, ast.Attribute) and node.func.attr in ("softmax", "log_softmax") \
            and not name.startswith("torch.")
        if (name in _SOFTMAX or is_method) and not _has_kw(node, "dtype"):
            scope = ctx.scope_of(node)
            op = node.func.attr if isinstance(node.func, ast.Attribute) else name.split(".")[-1]
            if scope is not None and scope.enabled and scope.device == "cpu":
                self.report(node, f"{op} without dtype under CPU autocast (not promoted to float32)")
            elif scope is None or not scope.enabled:
                x = self.operand(node)
                if (isinstance(x, ast.Name) and x.id in self.lowp) or (
                        ctx.manual_lowp_casts and not ctx.autocast_scopes):
                    self.report(node, f"{op} without dtype on a low-precision tensor")
        self.generic_visit(node)


class ReductionOutsideAutocast(_LowpNames):
    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        name = ctx.call_name(node) or ""
        is_method = isinstance(node.func, ast.Attribute) and node.func.attr in ("sum", "mean") \
            and not name.startswith("torch.")
        if (is_method or name in ("torch.sum", "torch.mean")) and not ctx.in_autocast(node) \
                and not _has_kw(node, "dtype"):
            x = self.operand(node)
            if isinstance(x, ast.Name) and x.id in self.lowp:
                op = node.func.attr if isinstance(node.func, ast.Attribute) else name
                self.report(node, f"{op}() on low-precision tensor `{x.id}` outside autocast")
        self.generic_visit(node)


class AutogradFunctionNoCustomFwd(RuleVisitor):
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        ctx = self.ctx
        if ctx.uses_lowp and any((ctx.qualname(b) or "") in ("torch.autograd.Function",
                                                            "torch.autograd.function.Function")
                                 for b in node.bases):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in ("forward", "backward"):
                    want = "custom_fwd" if item.name == "forward" else "custom_bwd"
                    decs = [(ctx.qualname(d.func if isinstance(d, ast.Call) else d) or "")
                            for d in item.decorator_list]
                    if not any(d.split(".")[-1] == want for d in decs):
                        self.report(item, f"autograd.Function {node.name}.{item.name} without @{want}")
        self.generic_visit(node)


_DEPRECATED = {
    "torch.cuda.amp.autocast": 'torch.amp.autocast("cuda", ...)',
    "torch.cuda.amp.GradScaler": 'torch.amp.GradScaler("cuda", ...)',
    "torch.cuda.amp.custom_fwd": 'torch.amp.custom_fwd(device_type="cuda")',
    "torch.cuda.amp.custom_bwd": 'torch.amp.custom_bwd(device_type="cuda")',
    "torch.cpu.amp.autocast": 'torch.amp.autocast("cpu", ...)',
    "torch.cpu.amp.GradScaler": 'torch.amp.GradScaler("cpu", ...)',
}


class DeprecatedAmpApi(RuleVisitor):
    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module in ("torch.cuda.amp", "torch.cpu.amp") and not node.level:
            names = [a.name for a in node.names if f"{node.module}.{a.name}" in _DEPRECATED]
            if names:
                self.report(node, f"deprecated import from {node.module}: {', '.join(names)}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        d = ".".join(reversed(_attr_parts(node)))
        q = self.ctx.qualname(node) or ""
        # Report only spelled-out uses (torch.cuda.amp.X); uses of a deprecated name imported
        # above are already covered by the import finding.
        if q in _DEPRECATED and d.count(".") >= 3:
            self.report(node, f"deprecated {q}; use {_DEPRECATED[q]}")
            return
        self.generic_visit(node)


def _attr_parts(node: ast.AST) -> list[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts


def _backward_calls(ctx: FileContext) -> list[ast.Call]:
    """``x.backward(...)`` calls on tensors: not ``some_cuda_module.backward(...)`` kernel calls
    (receiver is an imported name), nor calls inside an autograd Function's own backward."""
    out = []
    for n in ast.walk(ctx.tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "backward":
            head = (dotted(n.func.value) or "").split(".")[0]
            fn = ctx.enclosing_function(n)
            if head in ctx.aliases or getattr(fn, "name", None) == "backward":
                continue
            out.append(n)
    return out


class Fp16WithoutGradScaler(RuleVisitor):
    def run(self):
        ctx = self.ctx
        if ctx.has_gradscaler or not _backward_calls(ctx):
            return self.hits
        evidence: list[tuple[ast.AST, str]] = [(s.node, "float16 autocast") for s in ctx.fp16_autocast]
        evidence += [(c, "manual float16 cast") for c in ctx.manual_lowp_casts
                     if ctx.lowp_cast_dtype(c) == "float16"]
        if evidence:
            node, what = min(evidence, key=lambda e: (e[0].lineno, e[0].col_offset))
            self.report(node, f"float16 training ({what}) without a GradScaler")
        return self.hits


class BackwardInAutocast(RuleVisitor):
    def run(self):
        for call in _backward_calls(self.ctx):
            if self.ctx.in_autocast(call):
                self.report(call, "backward() called inside the autocast block")
        return self.hits


_CLIP = {"torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_value_",
         "torch.nn.utils.clip_grad.clip_grad_norm_", "torch.nn.utils.clip_grad_norm",
         "clip_grad_norm_", "clip_grad_value_"}


class ClipWithoutUnscale(RuleVisitor):
    def run(self):
        ctx = self.ctx
        if not ctx.has_gradscaler:
            return self.hits
        by_fn: dict[ast.AST, list[ast.Call]] = {}
        for n in ast.walk(ctx.tree):
            if isinstance(n, ast.Call):
                by_fn.setdefault(ctx.enclosing_function(n), []).append(n)
        for calls in by_fn.values():
            attrs = [(c, c.func.attr if isinstance(c.func, ast.Attribute) else "") for c in calls]
            if not any(a == "scale" for _, a in attrs):
                continue
            unscale_lines = [c.lineno for c, a in attrs if a == "unscale_"]
            for c in calls:
                q = ctx.call_name(c) or ""
                if q in _CLIP or q.split(".")[-1] in ("clip_grad_norm_", "clip_grad_value_"):
                    if not any(line < c.lineno for line in unscale_lines):
                        self.report(c, f"{q.split('.')[-1]} on scaled gradients (no scaler.unscale_ before it)")
        return self.hits


_FILL_CALLS = ("masked_fill", "masked_fill_", "fill_", "full", "full_like", "new_full", "clamp",
               "clamp_", "where")


def _const_value(node: ast.AST) -> float | None:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _const_value(node.operand)
        return -v if v is not None else None
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return float(node.value)
    return None


class Fp16UnsafeConstant(RuleVisitor):
    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        fp16 = ctx.fp16_autocast or any(ctx.lowp_cast_dtype(c) == "float16" for c in ctx.manual_lowp_casts)
        name = (ctx.call_name(node) or "").split(".")[-1]
        if fp16 and name in _FILL_CALLS:
            for a in list(node.args) + [k.value for k in node.keywords]:
                v = _const_value(a)
                if v is not None and abs(v) > FP16_MAX:
                    self.report(a, f"constant {v:g} in {name}() is outside the float16 range (±{FP16_MAX:g})")
        self.generic_visit(node)


_OPTIMIZERS = ("Adam", "AdamW", "Adagrad", "Adadelta", "RMSprop", "Adamax", "NAdam", "RAdam")


class EpsUnderflowFp16(RuleVisitor):
    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        half_model = any(ctx.lowp_cast_dtype(c) == "float16" for c in ctx.manual_lowp_casts)
        if half_model and (ctx.call_name(node) or "").split(".")[-1] in _OPTIMIZERS:
            for k in node.keywords:
                v = _const_value(k.value) if k.arg == "eps" else None
                if v is not None and 0 < v < FP16_MIN_SUBNORMAL:
                    self.report(k.value, f"optimizer eps={v:g} rounds to 0 in float16 parameters")
        self.generic_visit(node)


@dataclass(frozen=True)
class Rule:
    id: str
    name: str
    severity: Severity
    explanation: str
    suggestion: str
    visitor: type[RuleVisitor]


RULES: tuple[Rule, ...] = (
    Rule("AMP001", "manual-cast", Severity.HIGH,
         "A manual cast to float16/bfloat16 in AMP code bypasses autocast's per-op precision "
         "choice (ops autocast would keep in float32 now run in low precision).",
         "Remove the cast and let `with torch.autocast(...)` choose; keep master weights in float32.",
         ManualCast),
    Rule("AMP002", "bce-under-autocast", Severity.HIGH,
         "binary_cross_entropy / BCELoss is unsafe under CUDA autocast (PyTorch raises an error): "
         "the log of a float16 probability saturates.",
         "Use binary_cross_entropy_with_logits / BCEWithLogitsLoss on the raw logits.",
         BceUnderAutocast),
    Rule("AMP003", "loss-outside-autocast", Severity.HIGH,
         "The loss is computed outside the autocast block on its low-precision outputs, so it runs "
         "in float16/bfloat16 instead of autocast's float32 loss kernels (type mismatch, lost precision).",
         "Compute the loss inside the `with autocast(...)` block, or cast the outputs with .float() first.",
         LossOutsideAutocast),
    Rule("AMP004", "softmax-without-dtype", Severity.MEDIUM,
         "softmax/log_softmax without dtype= runs in the input's low precision here (CUDA autocast "
         "promotes it, CPU bf16 autocast and manual casts do not); exp() overflows in float16.",
         "Pass dtype=torch.float32 (e.g. F.softmax(x, dim=-1, dtype=torch.float32)).",
         SoftmaxNoDtype),
    Rule("AMP005", "reduction-outside-autocast", Severity.MEDIUM,
         "sum/mean on a low-precision tensor outside autocast returns float16/bfloat16; large "
         "reductions lose the small terms (big numbers eat small ones).",
         "Reduce in float32: x.float().sum() or x.sum(dtype=torch.float32), or keep it inside autocast.",
         ReductionOutsideAutocast),
    Rule("AMP006", "autograd-function-no-custom-fwd", Severity.MEDIUM,
         "A custom torch.autograd.Function in AMP code receives whatever dtypes autocast produced; "
         "without custom_fwd/custom_bwd its backward may run with different dtypes than forward.",
         "Decorate forward with @torch.amp.custom_fwd(device_type=...) and backward with "
         "@torch.amp.custom_bwd(device_type=...).",
         AutogradFunctionNoCustomFwd),
    Rule("AMP007", "deprecated-amp-api", Severity.LOW,
         "torch.cuda.amp.* and torch.cpu.amp.* are deprecated aliases and emit FutureWarning.",
         "Use torch.amp.autocast(device_type, ...), torch.amp.GradScaler(device_type) and "
         "torch.amp.custom_fwd/custom_bwd(device_type=...).",
         DeprecatedAmpApi),
    Rule("AMP008", "fp16-without-gradscaler", Severity.HIGH,
         "float16 gradients underflow to zero (smallest subnormal ~6e-8) without loss scaling; "
         "CUDA autocast defaults to float16.",
         "Use torch.amp.GradScaler: scaler.scale(loss).backward(); scaler.step(opt); scaler.update(), "
         "or train in bfloat16.",
         Fp16WithoutGradScaler),
    Rule("AMP009", "backward-inside-autocast", Severity.LOW,
         "Backward passes under autocast are not recommended: backward ops already run in the "
         "dtype autocast chose for the matching forward op.",
         "Leave the `with autocast(...)` block before calling loss.backward().",
         BackwardInAutocast),
    Rule("AMP010", "clip-without-unscale", Severity.MEDIUM,
         "With a GradScaler the gradients are multiplied by the scale; clipping them before "
         "scaler.unscale_ clips against the wrong norm.",
         "Call scaler.unscale_(optimizer) before clip_grad_norm_, then scaler.step(optimizer).",
         ClipWithoutUnscale),
    Rule("AMP011", "fp16-unsafe-constant", Severity.MEDIUM,
         "A constant beyond ±65504 becomes ±inf in float16; -1e9 attention masks give NaN rows "
         "after softmax.",
         "Use torch.finfo(x.dtype).min / max instead of a fixed constant.",
         Fp16UnsafeConstant),
    Rule("AMP012", "eps-underflow-fp16", Severity.MEDIUM,
         "An optimizer eps below float16's smallest subnormal (~6e-8) is zero for float16 "
         "parameters, so the update divides by sqrt(v) alone.",
         "Keep float32 master weights (autocast + GradScaler), or use eps >= 1e-4 with float16 parameters.",
         EpsUnderflowFp16),
)
RULES_BY_ID = {r.id: r for r in RULES}
RULES_BY_NAME = {r.name: r for r in RULES}
