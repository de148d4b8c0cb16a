"""No public function of quant/ or tensor_capture/ takes more than six positional parameters.

Why: a long positional list is how a quantizer once threaded nine options through every scaling
family (issue 42); options go by keyword (after ``*``), values that travel together in one
object (quant.quantizer.Quantizer). A function that must keep a longer positional signature
is listed in ``EXCEPTIONS`` with its reason.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("quant", "tensor_capture")
LIMIT = 6
#: "package/module.py:Qualified.name" -> why it keeps more positional parameters. Empty: the
#: seed's capture API (save_tensor, save_attention_tensors, save_linear_tensors) is called by
#: keyword in the seed documents (/work/shared/seeds/tensor_naming_rules.md), so its trailing
#: parameters (phase, component, rank, sample_idx, iteration) are keyword-only.
EXCEPTIONS: dict[str, str] = {}


def _public(name: str) -> bool:
    return not name.startswith("_")


def long_positional(source: str, where: str) -> list[str]:
    """``where:qualname (n)`` for each public module-level function or public method of a
    public class in ``source`` with more than LIMIT positional parameters (self / cls not
    counted)."""
    found = []

    def check(fn, qual: str, method: bool) -> None:
        args = fn.args
        n = len(args.posonlyargs) + len(args.args)
        if method and not any(isinstance(d, ast.Name) and d.id == "staticmethod"
                              for d in fn.decorator_list):
            n -= 1
        if n > LIMIT:
            found.append(f"{where}:{qual} ({n})")

    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _public(node.name):
            check(node, node.name, False)
        elif isinstance(node, ast.ClassDef) and _public(node.name):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                        _public(item.name) or item.name == "__call__"):
                    check(item, f"{node.name}.{item.name}", True)
    return found


def test_the_scan_sees_a_long_positional_list():
    src = ("def f(a, b, c, d, e, g, h): pass\n"
           "def ok(a, b, c, d, e, g, *, h): pass\n"
           "def _private(a, b, c, d, e, g, h): pass\n"
           "class C:\n"
           "    def m(self, a, b, c, d, e, g, h): pass\n"
           "    def fine(self, a, b, c, d, e, g): pass\n"
           "    @staticmethod\n"
           "    def s(a, b, c, d, e, g, h): pass\n")
    assert long_positional(src, "x.py") == ["x.py:f (7)", "x.py:C.m (7)", "x.py:C.s (7)"]


def test_no_public_function_takes_more_than_six_positional_parameters():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            found += [f for f in long_positional(path.read_text(), rel)
                      if f.rsplit(" ", 1)[0] not in EXCEPTIONS]
    assert not found, ("public functions with more than 6 positional parameters (make the "
                       "options keyword-only after `*`, or pass one object; or list the function "
                       f"in EXCEPTIONS with its reason): {found}")


def test_exceptions_still_exist():
    for key in EXCEPTIONS:
        rel, qual = key.split(":")
        assert any(f.startswith(key) for f in long_positional((ROOT / rel).read_text(), rel)), (
            f"{key} is listed in EXCEPTIONS but no longer has a long positional list: drop it")
