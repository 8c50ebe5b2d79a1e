"""The ``memfit`` command line: one subcommand per way of estimating.

Each subcommand is an ``add_parser`` call in :func:`_build_parser` plus a ``_cmd_<name>(args) -> int``
function set as its ``handler``; :func:`main` turns bad input into a one-line error and exit code 2,
argparse's usage errors included.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, NoReturn

from memfit.cli import answers
from memfit.cli.entry import console, reader_gone, show_warning
from memfit.cli.finetune_options import add_estimate_options, add_plan_options
from memfit.cli.model_factory import add_loss_option, cli_advice, with_loss
from memfit.cli.sharding import add_sharding_arguments, is_sharded, run_sharded
from memfit.errors import InvalidInputError, MemfitError
from memfit.planning.margin import DEFAULT_MARGIN
from memfit.prediction.formula import OPTIMIZERS, estimate_from_counts
from memfit.simulation.allocator import AllocatorConfig
from memfit.tracing.optimizers import OPTIMIZER_NAMES

if TYPE_CHECKING:  # annotations only: the planner is imported when `memfit plan` runs
    from memfit.planning.finetune import FinetuneSpec
    from memfit.planning.gpu_report import PlanReport

__all__ = ["console", "main"]

_EXIT_USAGE = 2
EXIT_NOTHING_FITS = 1  # the answer is "no": on no GPU asked about, or no count of GPUs, does the step fit
EXIT_CODES = (
    "exit status: 0 when the step fits (on at least one GPU asked about), 1 when it fits nowhere (the answer is "
    "still printed, --json included), 2 for bad input, 141 when the reader of the output closed it"
)

# Optional dependencies by the extra that installs them (pyproject.toml's [project.optional-dependencies]).
_EXTRAS = {
    "bitsandbytes": "quant",
    "peft": "quant",
    "deepspeed": "sharding",
    "matplotlib": "plot",
    "transformers": "hf",
    "accelerate": "hf",
    "pynvml": "nvml",
    "lightning": "lightning",
}

_COUNT_SUFFIXES: dict[str, int] = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}

# The library's trace errors advise forward_fn= / loss_fn=: loss_fn= is --loss here, forward_fn= has no option.
_FORWARD_FN_ADVICE = re.compile(
    r"check that the sample matches what the model expects \(got .*\); pass forward_fn=lambda model, batch: \.\.\. "
    r"if the model is called another way"
)
_CONFIG_ADVICE = (
    "check that the config's sizes agree with one another (attention heads and key-value heads divide the hidden "
    "size and each other, head_dim times heads is the hidden size)"
)
# what a config's model failing on memfit's sample says about the config, by the error (else: the sizes)
_MISSING_CONFIG_KEY = re.compile(r"'(\w+Config)' object has no attribute '(\w+)'")
_DTYPE_FAILURE = re.compile(r"dtype|Expected .*\b(?:BF16|Half|Float|bfloat16|float16|float32)\b", re.IGNORECASE)
# The library's advice on a forward that reads tensor values, in its Python words
_VALUE_ADVICE = re.compile(r"pass a forward_fn/loss_fn that avoids it, or use memfit\.estimate_from_counts\(\) for a "
                           r"formula estimate")  # fmt: skip
_CLI_CALLING = (
    "On the command line, make the --model factory return (module, sample) instead: sample(batch_size) builds "
    "the batch the module is called with (a dict as keyword arguments, a tuple as positional ones, a tensor as "
    "is), and --loss MODULE:FUNCTION gives the loss, function(output, batch) -> scalar, of a module whose forward "
    "does not return one."
)


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line, like memfit's own (the usage is a ``--help`` away)."""

    argv: ClassVar[list[str]] = []  # the command line being parsed, for the errors to quote

    def error(self, message: str) -> NoReturn:
        flag = re.match(r"argument (--[\w-]+)(?:/[\w-]+)?: expected one argument$", message)
        given = self.argv[self.argv.index(flag[1]) + 1 :] if flag and flag[1] in self.argv else []
        if given and given[0].startswith("-"):  # argparse reads a value such as -3GiB as another option
            message += f"; a value that starts with '-' goes after '=': {flag[1]}={given[0]}"
        self.exit(_EXIT_USAGE, f"memfit: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    """The installed distribution's version; a source checkout on PYTHONPATH has no metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("memfit")
    except PackageNotFoundError:
        return "0+unknown"


def _parse_count(text: str, option: str) -> int:
    """Read a count as people write it: ``20000000``, ``20_000_000``, ``20e6``, ``124M``, ``7B``.

    Suffixes are decimal (K = 10**3, M = 10**6, B = 10**9, T = 10**12), as model sizes are quoted.
    """
    cleaned = text.strip().replace("_", "").replace(",", "")
    multiplier = 1
    if cleaned and cleaned[-1].lower() in _COUNT_SUFFIXES:
        multiplier = _COUNT_SUFFIXES[cleaned[-1].lower()]
        cleaned = cleaned[:-1].strip()
    try:
        number = Decimal(cleaned) * multiplier
    except InvalidOperation:
        number = None
    if number is None or not number.is_finite() or number < 0 or number != number.to_integral_value():
        raise InvalidInputError(
            f"{option} must be a non-negative whole count such as 20000000, 20e6, 124M or 7B, got {text!r}"
        )
    return int(number)


def _parse_fraction(text: str, option: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise InvalidInputError(f"{option} must be a number between 0 and 1, got {text!r}") from None


def _cmd_estimate(args: argparse.Namespace) -> int:
    """Formula tier: estimate from parameter and activation counts."""
    from memfit.cli.finetune_options import estimate_counts

    try:
        estimate = estimate_from_counts(
            batch_size=_parse_count(args.batch_size, "--batch-size"),
            activations_per_sample=_parse_count(args.activations_per_sample, "--activations-per-sample"),
            precision=args.precision,
            trainable_fraction=_parse_fraction(args.trainable_fraction, "--trainable-fraction"),
            **estimate_counts(args, _parse_count),
        )
    except InvalidInputError as error:
        raise _as_flag(error) from None
    if args.json:
        print(json.dumps(estimate.to_dict(), indent=2))
    else:
        from memfit.cli.console import stdout_console
        from memfit.reporting.tables import formula_table

        stdout_console().print(formula_table(estimate))
    return 0


def _cmd_gpus(args: argparse.Namespace) -> int:
    """List the GPU catalog."""
    from memfit.planning.gpus import known_gpus

    cards = [
        {
            "name": gpu.name,
            "memory_bytes": gpu.memory_bytes,
            "bf16": gpu.bf16,
            "compute_capability": ".".join(map(str, gpu.compute_capability)) if gpu.compute_capability else None,
            "multiprocessors": gpu.multiprocessors,
            "vendor": gpu.vendor,
            "architecture": gpu.architecture,
            "aliases": list(gpu.aliases),
        }
        for gpu in known_gpus()
    ]
    if args.json:
        print(json.dumps(cards, indent=2))
        return 0
    from rich.table import Table

    from memfit.cli.console import stdout_console
    from memfit.units import format_bytes

    table = Table(title="GPUs memfit knows (--gpu NAME)")
    for column, justify in (("name", "left"), ("memory", "right"), ("bf16", "center"), ("compute capability",
                            "right"), ("SMs", "right"), ("architecture", "left"), ("also called", "left")):  # fmt: skip
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for card in cards:
        table.add_row(card["name"], format_bytes(card["memory_bytes"]), "yes" if card["bf16"] else "no",
                      card["compute_capability"] or "-", str(card["multiprocessors"] or "-"), card["architecture"],
                      ", ".join(card["aliases"]))  # fmt: skip
    stdout_console(width=None if sys.stdout.isatty() else 200).print(table)
    return 0


def _cmd_cache(args: argparse.Namespace) -> int:
    """Where the trace cache is, what it holds; ``--clear`` empties it."""
    from memfit.tracing import trace_cache
    from memfit.units import format_bytes

    folder = trace_cache.cache_dir()
    if args.clear:
        try:
            removed, answered = trace_cache.clear(), answers.clear()
        except OSError as error:
            print(f"memfit: cannot clear {folder.parent}: {error.strerror or error}", file=sys.stderr)
            return 2
        print(
            f"removed {removed} kept trace(s) from {folder} and {answered} kept answer(s) from {answers.answer_dir()}"
        )
        return 0
    entries = list(folder.glob("*.json.gz")) if folder.is_dir() else []
    kept = list(answers.answer_dir().glob("*.json.gz")) if answers.answer_dir().is_dir() else []
    state = "on" if trace_cache.enabled() else f"off ({trace_cache.CACHE_ENV}={os.environ.get(trace_cache.CACHE_ENV)})"
    size, answer_size = (format_bytes(sum(p.stat().st_size for p in paths)) for paths in (entries, kept))
    print(f"trace cache: {state}\nfolder: {folder} ({trace_cache.CACHE_DIR_ENV} moves it)\n"
          f"kept traces: {len(entries)}, {size}\n"
          f"kept answers: {len(kept)}, {answer_size} (in {answers.answer_dir()})")  # fmt: skip
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    """Trace a model and plan micro batch, accumulation and checkpointing for each GPU asked about."""
    from memfit.cli.finetune_options import estimate_command, plan_finetune
    from memfit.planning.finetune import ForeignQuantizationError

    if is_sharded(args):  # --strategy, --gpus auto, --nodes: one rank of a sharded job
        if len(args.seq_len) > 1:
            print("memfit: error: several --seq-len values are planned on one GPU; give one with --strategy/--gpus "
                  "auto", file=sys.stderr)  # fmt: skip
            return 2
        return run_sharded(args, plan_finetune(args))
    if args.plot:  # before the traces, not after them
        _check_writable(args.plot, "--plot")
        if importlib.util.find_spec("matplotlib") is None:
            raise InvalidInputError(_needs("matplotlib", "--plot"))
    finetune = plan_finetune(args)
    try:
        report = _plan_for_gpus(args, finetune)
    except ForeignQuantizationError as error:  # with the formula tier's command for what was asked
        raise InvalidInputError(f"{error.reason}. {error.advice(estimate_command(args, error.stand_in))}") from None
    report = _rows_name_flags(report, args)
    given = any(a == "--seq-len" or a.startswith("--seq-len=") for a in _Parser.argv)
    if args.model and given and report.seq_len not in (None, args.seq_len[0]):
        warnings.warn(
            f"--seq-len {args.seq_len[0]}: the sample of --model {args.model} makes batches of {report.seq_len} "
            "tokens, which the plan is for; further --seq-len values are read off its trace (make "
            f"sample(batch_size) build {args.seq_len[0]} tokens to plan that length)",
            UserWarning,
            stacklevel=1,
        )
    if args.plot:
        report.plot(args.plot)
    if args.json:
        answers.json_answer(report.to_dict())
    else:
        from memfit.cli.console import stdout_console
        from memfit.planning.gpu_report import traced_how
        from memfit.reporting.tables import finetune_table, plan_table

        console = stdout_console(width=None if sys.stdout.isatty() else 200)
        console.print(plan_table(report))
        if args.gpus > 1:
            console.print(f"one rank of ddp over {args.gpus} GPUs: every rank holds the whole model, its gradient "
                          "buckets and its own micro batches; the effective batch counts all ranks")  # fmt: skip
        if report.finetune is not None:
            console.print(finetune_table(report))
        if report.host is not None:
            answers.host_line(
                console, report.host, "; more than this machine has available" if report.host.fits is False else ""
            )
        for line in traced_how(report, extrapolated="traced at {low} and {high} blocks and extrapolated in depth "
                               "(--exact: the whole model)"):  # fmt: skip
            console.print(line, highlight=False)
        if args.plot:
            console.print(f"pictures: {args.plot}")
    if report.rows and all(row.refused for row in report.rows):  # nothing asked for could be planned
        print(f"memfit: error: {report.rows[0].error}", file=sys.stderr)
        return _EXIT_USAGE
    return 0 if any(row.fits for row in report.rows) else EXIT_NOTHING_FITS


def _flags_named(message: str, args: argparse.Namespace) -> str:
    """A library message names its arguments (```budget` must be positive``); the command line names the flag
    the value came from (``--budget``)."""
    options = vars(args)
    return re.sub(r"`(\w+)`", lambda m: f"--{m[1].replace('_', '-')}" if m[1] in options else m[0], message)


def _rows_name_flags(report: PlanReport, args: argparse.Namespace) -> PlanReport:
    """Each row's error as the command line says it: ``--precision 16-mixed``, not ``precision``'s name."""
    import dataclasses

    rows = tuple(dataclasses.replace(row, error=_flags_named(row.error, args)) if row.error else row
                 for row in report.rows)  # fmt: skip
    return dataclasses.replace(report, rows=rows)


def _as_flag(error: InvalidInputError) -> InvalidInputError:
    """The Python API names its arguments ("batch_size must be ..."); the command line names the flag."""
    name, said, rest = str(error).partition(" must be ")
    if said and name.isidentifier():
        return InvalidInputError(f"--{name.replace('_', '-')} must be {rest}")
    return error


def _check_writable(path: str, option: str) -> None:
    """One line now for an output file that cannot be written, rather than a traceback at the end."""
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise InvalidInputError(f"{option} {path}: the folder {folder} does not exist; create it or give another path")
    if Path(path).expanduser().is_dir():
        raise InvalidInputError(f"{option} {path} is a folder; give a file name such as {Path(path) / 'plan.png'}")
    if not os.access(folder, os.W_OK):
        raise InvalidInputError(f"{option} {path}: the folder {folder} is not writable; give another path")


def _plan_for_gpus(args: argparse.Namespace, finetune: FinetuneSpec) -> PlanReport:
    """``plan_for_gpus`` with what the command line asked for."""
    from memfit.planning.gpu_report import plan_for_gpus

    return plan_for_gpus(
        hf_config=args.hf_config,
        model=args.model,
        gpus=args.gpu or [],
        budget=args.budget,
        seq_len=args.seq_len[0],
        more_seq_lens=args.seq_len[1:],
        image_size=args.image_size,
        layers=args.layers,
        precision=args.precision,
        optimizer=args.optimizer,
        checkpointing=args.checkpointing,
        target_batch_size=args.target_batch_size,
        world_size=args.gpus,
        margin=args.margin,
        show_progress=not args.json,
        inference=args.inference,
        num_workers=args.num_workers,
        prefetch_factor=args.prefetch_factor,
        pin_memory=args.pin_memory,
        offload_optimizer=args.offload == "optimizer",
        exact=args.exact,
        zero_grad=args.zero_grad,
        finetune=finetune,
        allocator=_allocator(args.allocator),
    )


def _allocator(text: str | None) -> AllocatorConfig:
    """``--allocator``'s options, else the ones this shell's ``PYTORCH_ALLOC_CONF`` would give the run."""
    return AllocatorConfig.parse(text) if text is not None else AllocatorConfig.from_environment()


def _target(text: str) -> int | str:
    if text == "max":
        return "max"
    try:
        value = _parse_count(text, "--target-batch-size")
    except InvalidInputError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number such as 64 or 1K, or max; got {text!r}")
    return value


def _lengths(text: str) -> tuple[int, ...]:
    """An argparse type: one sequence length, or several separated by commas (each a positive whole number)."""
    whole = _whole(1)
    lengths = tuple(whole(part.strip()) for part in text.split(","))
    if len(set(lengths)) != len(lengths):
        raise argparse.ArgumentTypeError(f"each sequence length once, got {text!r}")
    return lengths


def _whole(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum`` (0 or 1), said in one line when not."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            kind = "positive" if minimum > 0 else "non-negative"
            raise argparse.ArgumentTypeError(f"must be a {kind} whole number, got {text!r}")
        return value

    return parse


def _margin(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction of memory in [0, 1) such as 0.05, got {text!r}")
    return value


def _importable_cwd() -> None:
    """Let --model name a module in the current directory, as ``python -m`` does (a console script's
    path starts at its own folder instead)."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="memfit",
        description="Predict the peak GPU memory of a PyTorch training step before it runs.",
        epilog=EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_estimate_command(subparsers)
    _add_gpus_command(subparsers)
    _add_cache_command(subparsers)
    _add_plan_command(subparsers)
    return parser


def _add_estimate_command(subparsers: argparse._SubParsersAction) -> None:
    """``memfit estimate``: the formula tier, for a model that is only a parameter count."""
    estimate = subparsers.add_parser(
        "estimate",
        help="estimate from parameter and activation counts (no model needed)",
        description="Formula tier: add up weights, gradients, optimizer state and activations from counts. "
        "Ignores temporaries, allocator overhead and the CUDA context.",
    )
    # Counts are parsed in _cmd_estimate, not by argparse, so bad ones get the same one-line error.
    counts = estimate.add_mutually_exclusive_group(required=True)
    counts.add_argument("--params", metavar="N", help="number of parameters (e.g. 124M, 7B)")
    estimate.add_argument("--batch-size", default="1", metavar="N", help="samples per step (default 1)")
    estimate.add_argument(
        "--activations-per-sample",
        default="0",
        metavar="N",
        help="activation elements one sample keeps for backward (default 0)",
    )
    estimate.add_argument(
        "--precision",
        default="fp32",
        help="fp32, 16-mixed, bf16-mixed, fp16 (16-true) or bf16 (bf16-true); default fp32",
    )
    estimate.add_argument("--optimizer", default="adamw", help=f"one of {', '.join(OPTIMIZERS)}, or a Hugging Face "
                          "optim name (paged_adamw_8bit, adamw_bnb_8bit, ...); default adamw")  # fmt: skip
    estimate.add_argument(
        "--trainable-fraction",
        default="1.0",
        metavar="F",
        help="share of parameters that are trained, 0 to 1 (default 1.0)",
    )
    add_estimate_options(estimate, counts)
    estimate.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    estimate.set_defaults(handler=_cmd_estimate)


def _add_gpus_command(subparsers: argparse._SubParsersAction) -> None:
    """``memfit gpus``: the catalog ``--gpu`` names come from."""
    gpus = subparsers.add_parser(
        "gpus",
        help="list the GPUs memfit knows by name (for --gpu)",
        description="The GPU catalog: each card's name, memory, bf16 support, compute capability and "
        "multiprocessors. --gpu takes any of these names, forgivingly (h100, 'rtx 4090', A100-80GB).",
    )
    gpus.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    gpus.set_defaults(handler=_cmd_gpus)


def _add_cache_command(subparsers: argparse._SubParsersAction) -> None:
    """``memfit cache``: where kept traces live, and a way to delete them."""
    cache = subparsers.add_parser(
        "cache",
        help="where kept traces and answers live, how many; --clear deletes them",
        description="memfit keeps each trace (and its replays) on disk, so a question asked again (another GPU, "
        "budget or batch) skips the trace, and each `memfit plan --hf-config` answer, so the same question asked "
        "again prints it at once. The key is everything the trace or the answer reads, the versions of the code "
        "that runs it included; models whose code is outside an installed package are never kept. Deleting the "
        "folder is always safe. MEMFIT_CACHE=off turns the cache off, MEMFIT_CACHE_DIR moves it.",
    )
    cache.add_argument("--clear", action="store_true", help="delete every kept trace and answer")
    cache.set_defaults(handler=_cmd_cache)


def _add_plan_command(subparsers: argparse._SubParsersAction) -> None:
    """``memfit plan``: trace a model and plan its batch, the command most questions go to."""
    plan = subparsers.add_parser(
        "plan",
        help="will it fit? trace a model and plan its batch for one or more GPUs",
        description="Trace two training steps of a model on fake tensors (no weights are materialised or "
        "downloaded) and plan the largest micro batch, the accumulation and checkpointing for each GPU.",
        epilog=EXIT_CODES,
    )
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-config", metavar="NAME_OR_PATH", help="a preset (gpt2, bert-base, t5-base, llama-3-8b, "
                        "mistral-7b, qwen2.5-7b, llama-3-70b, llama-2-70b, qwen2.5-72b, vit-base) or a local "
                        "config.json")  # fmt: skip
    source.add_argument("--model", metavar="MODULE:FACTORY", help="your own code: factory() returns a module or "
                        "(module, sample) with sample(batch_size) -> batch")  # fmt: skip
    add_loss_option(plan)
    plan.add_argument("--gpu", action="append", metavar="NAME", help="a GPU to plan for (repeatable), e.g. h100; "
                      "--gpu list (or memfit gpus) lists them")  # fmt: skip
    plan.add_argument("--budget", metavar="SIZE", help="plan for this much memory instead, e.g. 20GiB")
    plan.add_argument("--seq-len", type=_lengths, default=(1024,), metavar="N[,N...]",
                      help="tokens per sample (default 1024); several, e.g. 512,1024,4096, plan each from the same "
                      "trace")  # fmt: skip
    plan.add_argument("--image-size", type=_whole(1), help="image side for vision models (default: the config's)")
    plan.add_argument("--layers", type=_whole(1), help="override the depth (a quick look at a deep model)")
    plan.add_argument("--precision", help="fp32, 16-mixed, bf16-mixed, fp16 (16-true) or bf16 (bf16-true); default "
                      "bf16-mixed, 16-mixed on cards without bf16 (T4, V100); with --inference bf16 weights (fp16 "
                      "on those cards)")  # fmt: skip
    plan.add_argument("--optimizer", default="adamw", help=f"one of {', '.join(OPTIMIZER_NAMES)}, or a Hugging Face "
                      "optim name (paged_adamw_8bit, adamw_bnb_8bit, ...); default adamw")  # fmt: skip
    plan.add_argument("--checkpointing", choices=["auto", "on", "off"], default="auto",
                      help="auto: only when needed (default)")  # fmt: skip
    plan.add_argument("--target-batch-size", type=_target, default="max", metavar="N|max",
                      help="effective batch to keep with accumulation; max: largest micro batch (default)")  # fmt: skip
    plan.add_argument("--zero-grad", choices=["after_step", "before_backward", "in_place"], default="after_step",
                      help="when the loop frees gradients: after_step (Hugging Face Trainer, default), "
                      "before_backward (Lightning, whose forward carries the last step's gradients) or in_place "
                      "(zero_grad(set_to_none=False): gradients are zeroed, never freed)")  # fmt: skip
    plan.add_argument(
        "--margin",
        type=_margin,
        default=DEFAULT_MARGIN,
        help=f"fraction of memory kept free for the prediction's measured error (default {DEFAULT_MARGIN})",
    )
    plan.add_argument("--allocator", metavar="OPTIONS",
                      help="the caching allocator's options the run will have, as PYTORCH_ALLOC_CONF spells them "
                      "(e.g. expandable_segments:True); default: this shell's PYTORCH_ALLOC_CONF")  # fmt: skip
    plan.add_argument("--inference", action="store_true", help="plan a forward-only pass (serving): no gradients, "
                      "optimizer state or saved activations; outputs and KV cache kept")  # fmt: skip
    plan.add_argument("--num-workers", type=_whole(0), default=0, help="dataloader workers, for the host RAM line")
    plan.add_argument("--prefetch-factor", type=_whole(1), default=2, help="batches each worker prefetches (default 2)")
    plan.add_argument("--pin-memory", action="store_true", help="the dataloader pins memory")
    add_sharding_arguments(plan)  # --gpus (--world-size), --strategy, --offload (--offload-optimizer), --nodes
    plan.add_argument("--exact", action="store_true", help="trace the whole model even when it is deep (slower; by "
                      "default a deep config's log is built from traces at 3 and 4 blocks)")  # fmt: skip
    add_plan_options(plan)
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    plan.add_argument(
        "--plot", metavar="PNG", help="also draw the step's timeline and peak vs batch (needs matplotlib)"
    )
    plan.set_defaults(handler=with_loss(_cmd_plan))


def _needs(module: str, what: str = "this") -> str:
    """One line for an optional dependency that is not installed, with the extra that installs it."""
    top = module.split(".")[0]
    extra = _EXTRAS.get(top, top)
    try:
        installed = module != top and importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        installed = False
    if installed:  # the package is there, without the module: an older release
        return f'{what} needs {module}, which the installed {top} lacks: pip install -U "memfit[{extra}]"'
    return f'{what} needs {top}, which is not installed: pip install "memfit[{extra}]"'


def _missing_extra(error: BaseException) -> str | None:
    """``_needs`` for a missing optional dependency: ``error``, or an error it was raised from (``raise ... from``);
    ``None`` when none of them is about one."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ModuleNotFoundError) and (cause.name or "").split(".")[0] in _EXTRAS:
            return _needs(cause.name or "")
        cause = cause.__cause__
    return None


def _asks_for_the_catalog(argv: Sequence[str]) -> bool:
    """``memfit plan --gpu list``: the GPU catalog, which needs no model."""
    if not argv or argv[0] != "plan" or {"-h", "--help"} & set(argv):
        return False
    pairs = zip(argv, [*argv[1:], ""], strict=True)
    return any(flag.lower() == "--gpu=list" or (flag == "--gpu" and name.strip().lower() == "list")
               for flag, name in pairs)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 fits or done, 1 nothing fits, 2 bad input, 141 when the
    reader of the output closed it) instead of exiting."""
    parser = _build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    _Parser.argv = argv
    if _asks_for_the_catalog(argv):  # as `memfit gpus`
        argv = ["gpus", *(["--json"] if "--json" in argv else [])]
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and argparse usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else _EXIT_USAGE)
    if getattr(args, "model", None):
        _importable_cwd()
    answers.prepare_environment()
    shown_before, warnings.showwarning = warnings.showwarning, show_warning
    try:
        code = answers.answered(args, argv, lambda: _handle(args))
        sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's flush at exit
        return code
    except BrokenPipeError:
        return reader_gone()
    except ModuleNotFoundError as error:
        missing = _missing_extra(error)
        if missing is None:
            raise
        print(f"memfit: error: {missing}", file=sys.stderr)
        return _EXIT_USAGE
    except (MemfitError, ValueError) as exc:
        message = " ".join(str(exc).split())
        if "memfit[" not in message:  # a library message that names the extra already is kept
            message = _missing_extra(exc) or message
        if getattr(args, "model", None) and ("forward_fn" in message or "loss_fn" in message):
            advice = cli_advice(message).rstrip()
            message = f"{advice}{'' if advice.endswith('.') else '.'} {_CLI_CALLING}"
        elif getattr(args, "hf_config", None):
            # memfit made the sample for the model the config describes: a forward that fails is the config's
            message = _FORWARD_FN_ADVICE.sub(lambda _: _config_advice(message), message)
            message = _VALUE_ADVICE.sub("plan it with --model module:factory, whose forward avoids that, or use "
                                        "`memfit estimate` for a formula estimate", message)  # fmt: skip
        print(f"memfit: error: {_flags_named(message, args)}", file=sys.stderr)
        return _EXIT_USAGE
    finally:
        warnings.showwarning = shown_before


def _config_advice(message: str) -> str:
    """What to check when a config's model fails on the sample memfit built for it: a key its code reads that the
    file lacks, a precision its kernels do not run in, else the sizes."""
    missing = _MISSING_CONFIG_KEY.search(message)
    if missing:
        return f"add `{missing[2]}` to the config.json: the model's code reads it and {missing[1]} has no default"
    if _DTYPE_FAILURE.search(message):
        return (
            "the model's code does not run in this precision here: plan it in another --precision (bf16 keeps "
            "the weights in bf16), or with --inference"
        )
    return _CONFIG_ADVICE


def _handle(args: argparse.Namespace) -> int:
    """The subcommand, with transformers' models imported lean where a config is built (on meta: it never
    generates, and no one reads its docstrings)."""
    if not getattr(args, "hf_config", None):
        return args.handler(args)
    from memfit.integrations.huggingface.internals import lean_model_imports

    with lean_model_imports():
        return args.handler(args)
