"""The value analysis on shapes that large projects have: long chains of calls and re-exports,
and cycles through parameters, which must end with the right answer whichever question enters
them first, in bounded time, and without Python's recursion limit.

Before the cycle heads were asked again until their answers stopped growing, a chain longer
than twelve hops was cut ("nothing known"), and every question that entered a cycle walked it
again: a whole diffusers checkout took more than 15 minutes (2.5 minutes now)."""
from __future__ import annotations

import ast
import textwrap

from training_profiler.amp_checker import checker as sc
from training_profiler.amp_checker import questions as aq
from training_profiler.amp_checker import values as av
from training_profiler.amp_checker.project import Project


def _module(source: str, project: Project | None = None, name: str = "mod") -> sc.FileContext:
    ctx = sc.parse_module(textwrap.dedent(source), f"{name}.py", project or Project(), name)
    assert isinstance(ctx, sc.FileContext)
    return ctx


def _value_at(ctx: sc.FileContext, text: str) -> set[str]:
    expr = next(n for n in ast.walk(ctx.tree) if isinstance(n, ast.expr) and ast.unparse(n) == text)
    return {v.kind for v in aq.deep_stack(ctx.values.value, expr)}


def _chain(n: int) -> str:
    """f0() returns f1() ... returns an autocast: n hops, each a frame of its own."""
    defs = [f"def f{i}():\n    return f{i + 1}()\n" for i in range(n)]
    defs.append(f"def f{n}():\n    return torch.autocast('cuda', dtype=torch.float16)\n")
    return "import torch\n" + "\n".join(defs) + "\nctx = f0()\n"


def test_a_chain_of_3000_calls_is_followed_to_its_end() -> None:
    ctx = _module(_chain(3000))
    assert av.AUTOCAST in _value_at(ctx, "f0()")


def test_the_checker_follows_a_long_chain_to_a_finding() -> None:
    # the loss after the block is AMP003 only if `ctx` is known to be an autocast, 400 calls away
    source = _chain(400) + textwrap.dedent("""
        def train(model, x, y, opt):
            with ctx:
                out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            loss.backward()
            opt.step()
        """)
    findings, error = sc.check_source(source, "chain.py")
    assert error is None
    assert any(f.rule_id == "AMP003" for f in findings), [f.rule_id for f in findings]


_CYCLE = """
    import torch

    def relay(value, hops):
        if hops:
            return bounce(value, hops - 1)
        return value

    def bounce(value, hops):
        return relay(value, hops)

    scaler = relay(torch.cuda.amp.GradScaler(), 3)
    other = bounce(None, 2)
    """


def test_a_value_going_round_a_cycle_of_parameters_reaches_every_point_of_it() -> None:
    # `value` in bounce is what relay passes, and relay's `value` is what its callers pass,
    # bounce among them: the GradScaler goes round the cycle and comes out of both functions
    for first in ("scaler", "other"):  # whichever question enters the cycle first
        ctx = _module(_CYCLE)
        answers = {name: _value_at(ctx, name) for name in (first, {"scaler": "other", "other": "scaler"}[first])}
        assert av.SCALER in answers["scaler"] and av.SCALER in answers["other"], (first, answers)


def test_answers_are_remembered_once_the_cycle_is_settled() -> None:
    ctx = _module(_CYCLE)
    call = next(n for n in ast.walk(ctx.tree) if isinstance(n, ast.Call) and ast.unparse(n) == "bounce(None, 2)")
    aq.deep_stack(ctx.values.value, call)
    inner = next(n for n in ast.walk(ctx.tree) if isinstance(n, ast.Call) and ast.unparse(n) == "bounce(value, hops - 1)")
    # computed under the cycle's head and whole once it settled: answered from memory
    assert ctx.values.known(inner) is not None


def test_deep_stack_raises_in_the_caller_and_restores_the_limit() -> None:
    import sys

    before = sys.getrecursionlimit()

    def boom() -> None:
        raise ValueError("from the worker")

    try:
        aq.deep_stack(boom)
    except ValueError as exc:
        assert str(exc) == "from the worker"
    else:
        raise AssertionError("the worker's exception was lost")
    assert sys.getrecursionlimit() == before


def test_tuple_unpacking_follows_each_element_of_a_returned_tuple() -> None:
    """``weight_dtype, save_dtype = prepare_dtype(args)`` across modules: each name is the
    element of the returned tuple at its position (before, both were unknown)."""
    project = Project()
    _module("""
        import torch

        def prepare_dtype(args):
            weight_dtype = torch.float32
            if args.mixed_precision == "fp16":
                weight_dtype = torch.float16
            save_dtype = torch.float32
            return weight_dtype, save_dtype
    """, project, "train_util")
    script = _module("""
        import train_util

        def main(args, vae):
            weight_dtype, save_dtype = train_util.prepare_dtype(args)
            low, high = "fp16", "fp32"
            vae.to("cuda", dtype=weight_dtype)
            vae.to("cuda", dtype=save_dtype)
            print(low, high)
    """, project, "train")
    moves = [c for c in ast.walk(script.tree) if isinstance(c, ast.Call) and ast.unparse(c).startswith("vae.to")]
    assert [script.dtype_of(c.keywords[0].value) for c in moves] == ["float16", "float32"]
    printed = next(c for c in ast.walk(script.tree) if isinstance(c, ast.Call) and ast.unparse(c).startswith("print"))
    assert [script.values.strings(a) for a in printed.args] == [{"fp16"}, {"fp32"}]
