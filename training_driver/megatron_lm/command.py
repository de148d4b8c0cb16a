"""The arguments the launcher gives Megatron-LM's ``pretrain_gpt.py``, and what it checks first.

Why a module: the launcher (``examples/llama/train_llama32_1b_h100_fp8.sh``) used to hard-code
the 1B shape and a fixed flag list, so ``MODEL=tiny`` was ignored and a machine without
Transformer Engine or apex crashed at model build (issue 38). Here the shape comes from the one
table of model shapes (``train_config.MODEL_SHAPES``) with the launcher's shape variables
over it, each flag that depends on the machine is one rule (``MACHINE_FLAGS``: what must
import, and why the flag is needed without it), and each package Megatron-LM's training loop
needs is one row (``REQUIREMENTS``), checked before torchrun starts: a missing one is one line
and exit 2 instead of a crash, or a hang, minutes later.

    python -m training_driver.megatron_lm.command --checkout DIR --model tiny --dtype bf16

prints the model and machine arguments one per line (notes on stderr).
"""
from __future__ import annotations

import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from lowp_common.cli import CommandParser, UserError, cli_entry

from ..train_config import MODEL_SHAPES, SHAPE_KEYS, TrainConfig, _te_available

PROG = "train_llama32_1b_h100_fp8.sh"
EXTRA = 'pip install -e ".[megatron-lm]"'


def _imports(module: str) -> bool:
    """Whether ``module`` really imports (a CUDA extension can be found and still fail)."""
    try:
        __import__(module)
    except Exception:
        return False
    return True


def dataset_helpers_built(checkout: Path) -> bool:
    """megatron/core/datasets/helpers_cpp built for this Python (else Megatron builds it at
    start with make and pybind11)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return (checkout / "megatron/core/datasets" / f"helpers_cpp{suffix}").is_file()


@dataclass(frozen=True)
class Requirement:
    """A package Megatron-LM's training loop imports that megatron-core does not bring."""

    module: str
    needed_by: str
    pip: str
    #: the checkout does not need it (e.g. what it builds is already built)
    waived: Callable[[Path], bool] = lambda checkout: False


REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement("six", "pretrain_gpt.py imports megatron/training/tokenizer/bert_tokenization.py, "
                "which imports six", "six"),
    Requirement("psutil", "Megatron's checkpoint writer process imports psutil; without it the "
                "writer dies and training waits for it forever", "psutil"),
    Requirement("pybind11", "Megatron builds its dataset helpers (megatron/core/datasets, make) "
                "with pybind11 at start", "pybind11", waived=dataset_helpers_built),
    Requirement("transformers", "Megatron-LM loads TOKENIZER_PATH with transformers.AutoTokenizer "
                "(--tokenizer-type HuggingFaceTokenizer)", "transformers"),
)


def check_requirements(checkout: Path, present: Callable[[str], bool] | None = None) -> None:
    """UserError naming the first missing package, what needs it and the install command
    (``present``: whether a module imports; default: import it, as Megatron-LM will)."""
    present = present or _imports
    for req in REQUIREMENTS:
        if not req.waived(checkout) and not present(req.module):
            raise UserError(f"MEGATRON_LM_DIR: {req.needed_by}, and {req.module} does not import "
                            f"here: pip install {req.pip} (or {EXTRA})")


@dataclass(frozen=True)
class Machine:
    """What the flags depend on."""

    cuda: bool
    te: bool                    # transformer_engine imports
    apex_softmax: bool          # scaled_masked_softmax_cuda (apex / Megatron's fused kernels)
    apex_wgrad: bool            # fused_weight_gradient_mlp_cuda (apex)
    te_custom_recipe: bool      # CUSTOM_QUANT_TYPE on TE linears (DTYPE fp8)

    @classmethod
    def here(cls, te_custom_recipe: bool = False) -> "Machine":
        import torch

        return cls(cuda=torch.cuda.is_available(), te=_te_available(),
                   apex_softmax=_imports("scaled_masked_softmax_cuda"),
                   apex_wgrad=_imports("fused_weight_gradient_mlp_cuda"),
                   te_custom_recipe=te_custom_recipe)


@dataclass(frozen=True)
class MachineFlag:
    """Flags Megatron-LM needs on a machine where ``needed`` holds, and why."""

    flags: tuple[str, ...]
    needed: Callable[[Machine], bool]
    why: str


MACHINE_FLAGS: tuple[MachineFlag, ...] = (
    MachineFlag(("--no-rope-fusion",), lambda m: not m.te,
                "Transformer Engine does not import (TransformerConfig refuses apply_rope_fusion "
                "without TE >= 1.4)"),
    MachineFlag(("--no-masked-softmax-fusion",), lambda m: not m.apex_softmax,
                "scaled_masked_softmax_cuda (apex) does not import (fused_softmax.py imports it)"),
    MachineFlag(("--no-gradient-accumulation-fusion",), lambda m: m.te_custom_recipe,
                "TE's custom recipe runs without gradient-accumulation fusion"),
    MachineFlag(("--no-gradient-accumulation-fusion",),
                lambda m: not m.te_custom_recipe and not m.apex_wgrad,
                "apex's fused_weight_gradient_mlp_cuda is not importable"),
    MachineFlag(("--distributed-backend", "gloo", "--use-cpu-initialization"), lambda m: not m.cuda,
                "no GPU found (Megatron-LM's training loop asserts CUDA at start: on a CPU it runs "
                "only with stand-ins for its CUDA calls, see docs/training.md)"),
)


def machine_flags(machine: Machine) -> tuple[list[str], list[str]]:
    """(flags, notes) for ``machine``."""
    flags: list[str] = []
    notes: list[str] = []
    for rule in MACHINE_FLAGS:
        if rule.needed(machine):
            flags.extend(rule.flags)
            notes.append(f"{rule.why}: passing {' '.join(rule.flags)}")
    return flags, notes


def model_shape(model: str, overrides: dict[str, int | None]) -> dict[str, int]:
    """MODEL_SHAPES[model] with the given fields replaced (``TrainConfig.resolved_shape``, as
    llama-train reads it); UserError for an unknown model or a shape Megatron cannot build."""
    if model not in MODEL_SHAPES:
        raise UserError(f"MODEL={model!r} is unknown: choose one of {', '.join(sorted(MODEL_SHAPES))}")
    for key, value in overrides.items():
        if value is not None and value < 1:
            raise UserError(f"{key.upper()}={value} must be a positive integer")
    shape = TrainConfig("", "", model=model, **overrides).resolved_shape()
    if shape["hidden_size"] % shape["num_attention_heads"]:
        raise UserError(f"HIDDEN_SIZE={shape['hidden_size']} is not a multiple of "
                        f"NUM_ATTENTION_HEADS={shape['num_attention_heads']}")
    if shape["num_attention_heads"] % shape["num_query_groups"]:
        raise UserError(f"NUM_ATTENTION_HEADS={shape['num_attention_heads']} is not a multiple of "
                        f"NUM_QUERY_GROUPS={shape['num_query_groups']}")
    return shape


def shape_args(shape: dict[str, int]) -> list[str]:
    """Megatron-LM's arguments for a Llama of ``shape`` (the local or TE layer spec)."""
    args = []
    for key in SHAPE_KEYS:
        args += [f"--{key.replace('_', '-')}", str(shape[key])]
    return args + ["--max-position-embeddings", str(shape["seq_length"]), "--group-query-attention"]


def transformer_impl_args(dtype: str) -> list[str]:
    """fp8: TE layers; else the local spec, whose RMSNorm (torch_norm.py WrappedTorchNorm)
    refuses persist_layer_norm, which Megatron-LM's arguments turn on by default."""
    if dtype == "fp8":
        return ["--transformer-impl", "transformer_engine"]
    return ["--transformer-impl", "local", "--no-persist-layer-norm"]


def build_parser() -> CommandParser:
    p = CommandParser(prog="megatron_lm_command",
                      description="Megatron-LM pretrain_gpt.py arguments of the launcher's model "
                                  "shape and this machine, after checking what it needs.")
    p.add_argument("--checkout", default=None, help="the Megatron-LM checkout (MEGATRON_LM_DIR)")
    p.add_argument("--shape-only", action="store_true",
                   help="only check MODEL and the shape variables (this project's driver)")
    p.add_argument("--model", default="llama32_1b", help="MODEL: " + ", ".join(sorted(MODEL_SHAPES)))
    for key in SHAPE_KEYS:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                       help=f"{key.upper()} (default: the model's)")
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--te-custom-recipe", action="store_true",
                   help="CUSTOM_QUANT_TYPE runs as TE's custom recipe")
    p.add_argument("--quant-plan", default="", help="CUSTOM_QUANT_PLAN: refused when a rule matches "
                                                   "no GEMM of this shape")
    return p


@cli_entry("megatron_lm_command")
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shape = model_shape(args.model, {k: getattr(args, k) for k in SHAPE_KEYS})
    if args.shape_only:
        return 0
    if not args.checkout:
        raise UserError("--checkout is required (the Megatron-LM checkout), or --shape-only")
    checkout = Path(args.checkout)
    check_requirements(checkout)
    if args.quant_plan:
        from ..plan_sites import check_plan_covers_shape

        check_plan_covers_shape(shape, args.quant_plan)
    flags, notes = machine_flags(Machine.here(args.te_custom_recipe))
    for note in notes:
        print(f"{PROG}: note: {note}", file=sys.stderr, flush=True)
    print("\n".join(shape_args(shape) + transformer_impl_args(args.dtype) + flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
