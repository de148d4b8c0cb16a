"""Our debug features in a Megatron-LM run that has no ``--tensor-inspect*`` flags.

Why: Megatron-LM's ``--tensor-inspect`` family (which calls nvdlfw-inspect for TE layers) exists
only in its pull request #3811, not in main nor in core_r0.16-0.18: a released Megatron-LM
stops on those flags with "unrecognized arguments". This entry point does what the flags would,
around an unmodified ``pretrain_gpt.py``:

    python -m te_integration.megatron_lm [--inspect-config YAML] [--inspect-log-dir DIR] \\
        PRETRAIN_SCRIPT [Megatron-LM arguments...]

(under torchrun: ``torchrun ... -m te_integration.megatron_lm ...``). Before Megatron builds the
model (``megatron.training.training.setup_model_and_optimizer``, which both its get_model path
and main's config-container builder path pass through) it calls ``debug_api.initialize`` with our
feature folder and TE's; after, ``infer_and_assign_layer_names`` names every layer by its module
path (which the YAML's layer patterns and LOWP_TE_ROLE_FORMATS ``name`` rules match); after each
``train_step`` it advances the debug API's iteration. The YAML is checked before anything runs.
Without ``--inspect-config`` it only names the TE layers by module path (for ``name`` rules:
Megatron-LM itself gives TE no names, and TE then calls them ``Layer_N``).

``--check-checkout DIR`` is the launcher's check that a checkout has the custom-recipe flag
(``--fp8-quantizer-factory``): one line, exit 2, otherwise.
"""
from __future__ import annotations

import argparse
import functools
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from lowp_common import CommandParser, UserError, cli_entry

from . import check_cli, inspect_support

PROG = "python -m te_integration.megatron_lm"
#: Megatron-LM's module whose get_model / train_step the entry point wraps
TRAINING_MODULE = "megatron.training.training"
#: where a Megatron-LM checkout declares its command-line flags, and the flag we need
ARGUMENTS_FILE = Path("megatron/training/arguments.py")
FACTORY_FLAG = "--fp8-quantizer-factory"
CORE_FACTORY_FILE = Path("megatron/core/fp8_utils.py")


def check_checkout(checkout: str) -> str:
    """UserError (one line) unless the Megatron-LM checkout takes ``--fp8-quantizer-factory``."""
    root = Path(checkout)
    args_file, core_file = root / ARGUMENTS_FILE, root / CORE_FACTORY_FILE
    if args_file.is_file():
        ok = FACTORY_FLAG in args_file.read_text(encoding="utf-8", errors="replace")
    else:   # a tree of megatron-core alone: the config field behind the flag
        ok = core_file.is_file() and "fp8_quantizer_factory" in core_file.read_text(
            encoding="utf-8", errors="replace")
    if not ok:
        raise UserError(f"{checkout}: this Megatron-LM has no {FACTORY_FLAG} (the custom recipe "
                        "our quantizer factory needs, megatron-core >= 0.16): update the checkout, "
                        "or unset CUSTOM_QUANT_TYPE with DTYPE fp8")
    return f"{checkout}: {FACTORY_FLAG} available"


def feature_dirs() -> list[str]:
    """Our feature folder and TE's (nvdlfw-inspect needs TE's for its namespace)."""
    te = check_cli.te_feature_dir()
    if te is None:
        raise UserError("Transformer Engine does not import here, so its debug feature folder "
                        "cannot be listed beside ours: install transformer-engine[pytorch]")
    return [str(check_cli.FEATURE_DIR), str(te)]


def name_te_layers(model: Any) -> int:
    """Name every Transformer Engine module of ``model`` by its module path (how many);
    Megatron's wrappers (megatron.core.extensions.transformer_engine) subclass TE's modules."""
    named = 0
    for path, module in model.named_modules():
        te_class = any(c.__module__.startswith("transformer_engine.") for c in type(module).__mro__)
        if te_class and hasattr(module, "name"):
            module.name = path
            named += 1
    return named


#: the Megatron-LM function every model build passes through. Megatron-LM main's
#: pretrain_gpt.py hands pretrain() a config container, and setup_model_and_optimizer then
#: builds the model through the container's builder without calling get_model, so get_model
#: is not a hook point (checked on Megatron-LM main d98e8a6, training.py).
SETUP_FUNCTION = "setup_model_and_optimizer"


def _chunks(model: Any) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def install_hooks(config: Optional[str], log_dir: str, dirs: Sequence[str],
                  training: Any) -> None:
    """Wrap Megatron-LM's setup_model_and_optimizer and train_step in ``training``
    (megatron.training.training): with a debug-API ``config``, initialize before the model is
    built, name its layers after (nvdlfw-inspect's names) and advance the debug iteration after
    each step; without one, only name the TE layers by module path. A step before any model
    was named is refused: the names are what role rules, plans and the YAML match, and a run
    without them would train with other formats than asked, without a word."""
    setup: Callable = getattr(training, SETUP_FUNCTION)
    train_step: Callable = training.train_step
    named: list = []

    @functools.wraps(setup)
    def named_setup(*args: Any, **kwargs: Any):
        if config is not None:
            import nvdlfw_inspect.api as debug_api

            debug_api.initialize(config_file=config, feature_dirs=list(dirs), log_dir=log_dir)
        out = setup(*args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        for chunk in _chunks(model):
            if config is not None:
                debug_api.infer_and_assign_layer_names(chunk)
            else:
                name_te_layers(chunk)
        named.append(True)
        return out

    @functools.wraps(train_step)
    def stepping_train_step(*args: Any, **kwargs: Any):
        if not named:
            raise UserError(f"{PROG}: a training step ran before {TRAINING_MODULE}."
                            f"{SETUP_FUNCTION} built a model, so no layer was named: this "
                            "Megatron-LM builds its model another way; run without "
                            "LOWP_TE_ROLE_FORMATS name rules, CUSTOM_QUANT_PLAN and the "
                            "inspect config, or report the Megatron-LM commit")
        out = train_step(*args, **kwargs)
        if config is not None:
            import nvdlfw_inspect.api as debug_api

            debug_api.step()
        return out

    setattr(training, SETUP_FUNCTION, named_setup)
    training.train_step = stepping_train_step


def run_script(script: str, args: Sequence[str]) -> None:
    """Run ``script`` as ``python script args...`` would (its folder first on sys.path)."""
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def _custom_recipe(script_args: Sequence[str]) -> bool:
    """Whether Megatron-LM's arguments ask for TE's custom recipe (fp8 or fp4)."""
    pairs = list(zip(script_args, list(script_args[1:]) + [""]))
    return any(a in ("--fp8-recipe", "--fp4-recipe") and v == "custom" for a, v in pairs) or any(
        a in ("--fp8-recipe=custom", "--fp4-recipe=custom") for a in script_args)


@cli_entry("te_integration.megatron_lm")
def main(argv: Optional[Sequence[str]] = None) -> int:
    p = CommandParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--inspect-config", help="the debug-API YAML (our features, TE's)")
    p.add_argument("--inspect-log-dir", default="inspect_logs",
                   help="where nvdlfw-inspect writes its logs (default: inspect_logs)")
    p.add_argument("--check-checkout", metavar="DIR",
                   help=f"only check that the Megatron-LM checkout DIR takes {FACTORY_FLAG}")
    p.add_argument("script", nargs="?", help="Megatron-LM's pretrain_gpt.py (or another script)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    args = p.parse_args(argv)
    if args.check_checkout:
        print(check_checkout(args.check_checkout))
        return 0
    if not args.script:
        raise UserError("give the script to run (Megatron-LM's pretrain_gpt.py) and its arguments")
    if not os.path.isfile(args.script):
        raise UserError(f"{args.script}: no such file (give Megatron-LM's pretrain_gpt.py)")
    dirs: list[str] = []
    if args.inspect_config and _custom_recipe(args.script_args):
        from .factory import DEBUG_API_CONFLICT

        raise UserError(DEBUG_API_CONFLICT)
    if _custom_recipe(args.script_args) and "--moe-grouped-gemm" in args.script_args:
        from .factory import UNSUPPORTED_MODULES

        raise UserError(UNSUPPORTED_MODULES["grouped_linear"])
    if args.inspect_config:
        inspect_support.require()
        check_cli.check(args.inspect_config)
        dirs = feature_dirs()
    import importlib

    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    try:
        training = importlib.import_module(TRAINING_MODULE)
    except ImportError as exc:
        raise UserError(f"{args.script}: {TRAINING_MODULE} does not import beside it ({exc}): "
                        "run a Megatron-LM checkout's pretrain_gpt.py") from None
    install_hooks(args.inspect_config, args.inspect_log_dir, dirs, training)
    run_script(args.script, args.script_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
