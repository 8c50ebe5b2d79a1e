"""The fine-tuning flags of ``memfit plan`` and ``memfit estimate``: LoRA, DoRA, bitsandbytes quantization.

``add_plan_options`` / ``add_estimate_options`` declare them; ``plan_finetune`` turns them into a
``FinetuneSpec`` for the planner, ``estimate_counts`` into the formula tier's counts.
"""

from __future__ import annotations

import argparse
import logging
import shlex
from typing import Any

from memfit.errors import InvalidInputError
from memfit.planning.finetune import QUANTIZATIONS, FinetuneSpec, resolve_optimizer
from memfit.precision import Precision

__all__ = ["add_estimate_options", "add_plan_options", "estimate_command", "estimate_counts", "plan_finetune"]


def _rank(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive rank such as 8, 16 or 64, got {text!r}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def _add_common(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA and quantization")
    group.add_argument(
        "--lora-r", type=_rank, metavar="R", help="train LoRA adapters of rank R (peft); the base model is frozen"
    )
    group.add_argument(
        "--lora-alpha", type=_number, metavar="A", help="LoRA scaling alpha (default 2 x R; no effect on memory)"
    )
    group.add_argument(
        "--lora-targets",
        metavar="all-linear|NAMES",
        help="layers that get adapters: all-linear (default) or comma-separated module names such as q_proj,v_proj",
    )
    group.add_argument("--lora-dropout", type=_number, default=0.0, metavar="P", help="LoRA dropout (default 0)")
    group.add_argument("--dora", action="store_true", help="DoRA: LoRA with a learned magnitude vector (peft use_dora)")
    group.add_argument(
        "--quantize",
        type=str.lower,
        choices=QUANTIZATIONS,
        help="store the frozen linear weights with bitsandbytes: nf4 or fp4 (QLoRA, 4-bit) or int8 (LLM.int8())",
    )
    group.add_argument(
        "--double-quant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="4-bit double quantization of the scales (bnb_4bit_use_double_quant; default on)",
    )


def add_plan_options(parser: argparse.ArgumentParser) -> None:
    """The fine-tuning flags of ``memfit plan``."""
    _add_common(parser)


def add_estimate_options(parser: argparse.ArgumentParser, counts: Any) -> None:
    """The fine-tuning flags of ``memfit estimate``: the plan's, plus where counts come from (``counts``: the
    group that holds ``--params``, of which one is required)."""
    _add_common(parser)
    counts.add_argument(
        "--hf-config",
        metavar="NAME_OR_PATH",
        help="count parameters, LoRA adapters and quantized layers of this config built on meta (a preset or a "
        "config.json) instead of --params",
    )
    parser.add_argument(
        "--lora-params",
        metavar="N",
        help="trainable adapter parameters, when no --hf-config counts them (e.g. 42M)",
    )


def plan_finetune(args: argparse.Namespace) -> FinetuneSpec:
    """The plan's ``FinetuneSpec``; resolves ``args.optimizer`` to a traceable name in place (the name as given
    stays in ``args.optimizer_given``)."""
    args.optimizer_given = args.optimizer
    args.optimizer, note = resolve_optimizer(args.optimizer)
    _quiet_bitsandbytes()
    return finetune_spec(args, notes=(note,) if note else ())


def finetune_spec(args: argparse.Namespace, notes: tuple[str, ...] = ()) -> FinetuneSpec:
    """The adapters and quantization the flags ask for, as one ``FinetuneSpec``."""
    return FinetuneSpec(
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_targets=args.lora_targets,
        lora_dropout=args.lora_dropout,
        dora=args.dora,
        quantize=args.quantize,
        double_quant=args.double_quant,
        notes=notes,
    )


def _quiet_bitsandbytes() -> None:
    """bitsandbytes' CPU backend advises on optional kernels when imported (by peft, a quantized layout, or an 8-bit
    optimizer traced on fake tensors): advice about this machine's CPU, never about the GPU planned."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def estimate_counts(args: argparse.Namespace, parse_count: Any) -> dict[str, Any]:
    """Keyword arguments for ``estimate_from_counts`` beyond the plain ones: parameters, trainable and
    quantized counts (from ``--hf-config`` built on meta with real peft, or from the counts given), the
    frozen weights' width and the optimizer's registry name."""
    optimizer, _ = resolve_optimizer(args.optimizer)
    _quiet_bitsandbytes()
    finetune = finetune_spec(args)
    if finetune.quantize and not finetune.lora and _all_trainable(args):
        adapters = (
            "--lora-r 16"
            if args.hf_config
            else "--lora-r 16 with --lora-params N (or --hf-config NAME_OR_PATH, which counts the adapters)"
        )
        raise InvalidInputError(
            f"--quantize {finetune.quantize} without --lora-r would train the quantized weights themselves, which "
            f"bitsandbytes cannot do (they are frozen): add {adapters} to estimate QLoRA, or --trainable-fraction 0 "
            "to count the quantized weights alone"
        )
    out: dict[str, Any] = {"optimizer": optimizer, "quantize": finetune.quantize, "double_quant": finetune.double_quant}
    if args.hf_config:
        out.update(_counts_from_config(args, finetune))
    else:
        out["parameters"] = parse_count(args.params, "--params")
        if finetune.lora:
            if args.lora_params is None:
                raise InvalidInputError(
                    "--lora-r needs the model's layers to count adapters: give --hf-config NAME_OR_PATH, or the "
                    "adapter count itself with --lora-params N"
                )
            adapters = parse_count(args.lora_params, "--lora-params")
            out["parameters"] += adapters
            out["trainable_parameters"] = adapters
    if args.lora_params is not None and not finetune.lora:
        raise InvalidInputError("--lora-params needs --lora-r (the adapter rank)")
    if not finetune.active:
        return out
    precision = Precision.parse(args.precision)
    if finetune.quantize and not precision.converts_to_half:
        out["frozen_bytes"] = 4  # prepare_model_for_kbit_training keeps every non-quantized weight in fp32
    elif finetune.lora and not finetune.quantize and precision.is_mixed:
        out["frozen_bytes"] = 2  # the base loaded in bf16/fp16, as LoRA scripts load it (the plan's assumption)
    return out


def _all_trainable(args: argparse.Namespace) -> bool:
    """Whether ``--trainable-fraction`` leaves every parameter trainable (its own errors are the caller's)."""
    try:
        return float(args.trainable_fraction) >= 1.0
    except ValueError:
        return False


def estimate_command(args: argparse.Namespace, stand_in: str) -> str:
    """The ``memfit estimate`` command that counts what ``memfit plan``'s ``args`` plan, with ``--quantize stand_in``
    for a quantization the trace cannot model: it runs as printed for a ``--hf-config``; a ``--model`` factory's
    counts are the user's to give."""
    if args.hf_config is None:
        return (
            f"memfit estimate --params N --lora-r {args.lora_r or 16} --lora-params M --quantize {stand_in}, with N "
            "the model's parameters and M its adapters'"
        )
    words = ["memfit", "estimate", "--hf-config", args.hf_config, "--quantize", stand_in]
    if args.lora_r is not None:
        words += ["--lora-r", str(args.lora_r)]
        words += ["--lora-targets", args.lora_targets] if args.lora_targets else []
        words += ["--dora"] if args.dora else []
    elif args.inference:
        words += ["--trainable-fraction", "0"]  # a served model: its weights alone
    else:
        words += ["--lora-r", "16"]  # its quantized weights do not train: adapters do
    words += ["--precision", args.precision or ("bf16" if args.inference else "bf16-mixed")]
    optimizer = getattr(args, "optimizer_given", args.optimizer)
    if not args.inference and optimizer != "adamw":
        words += ["--optimizer", optimizer]
    return shlex.join(words)


def _counts_from_config(args: argparse.Namespace, finetune: FinetuneSpec) -> dict[str, Any]:
    """Counts of the config's model on meta: every parameter, the adapters peft adds, the quantized weights.

    A config quantized by a library the trace cannot model (GPTQ, AWQ, ...) is counted as its unquantized
    architecture (what it builds on meta) with ``--quantize`` standing in for that library's packing.
    """
    from memfit.planning.finetune import add_lora, foreign_quantization, quantizable_linears
    from memfit.presets import from_hf_config

    spec = from_hf_config(args.hf_config)
    foreign = foreign_quantization(spec.model)
    if foreign is not None and not finetune.quantize:
        library, stand_in = foreign
        raise InvalidInputError(
            f"{args.hf_config} is quantized with {library} (its quantization_config), which the formula tier counts "
            f"as bitsandbytes weights of the same width: add --quantize {stand_in}"
        )
    linears = quantizable_linears(spec.model) if finetune.quantize else None
    lora_only = FinetuneSpec(
        lora_r=finetune.lora_r, lora_alpha=finetune.lora_alpha, lora_targets=finetune.lora_targets, dora=finetune.dora
    )
    model = add_lora(spec.model, lora_only) if lora_only.lora else spec.model
    out: dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters())}
    if finetune.lora:
        out["trainable_sizes"] = [p.numel() for p in model.parameters() if p.requires_grad]
        out["trainable_parameters"] = sum(out["trainable_sizes"])
    elif _all_trainable(args):
        out["trainable_sizes"] = [p.numel() for p in model.parameters()]
    if linears is not None:
        out["quantized_parameters"] = sum(linear.weight.numel() for _, linear in linears)
        out["quantized_layers"] = len(linears)
    return out
