"""``memfit plan`` across several GPUs: ``--gpus N|auto``, ``--strategy``, ``--offload``, ``--nodes``.

``add_sharding_arguments`` adds the options to the ``plan`` parser, ``is_sharded`` says whether a
command line asks for a per-rank plan and ``run_sharded`` answers it; ``--gpus N`` alone keeps its
meaning of DistributedDataParallel (``--world-size``, its older name, is the same option), and
``--offload-optimizer`` is ``--offload optimizer``.
"""

from __future__ import annotations

import argparse
import sys

from memfit.cli import answers
from memfit.errors import InvalidInputError, NoCountFitsError
from memfit.host_memory import machine_ram_bytes
from memfit.planning.finetune import FinetuneSpec
from memfit.planning.sharded_plan import AUTO_OFFLOADS, AUTO_STRATEGIES, Option, ShardedReport, plan_sharded
from memfit.units import format_bytes

__all__ = ["CLI_STRATEGIES", "OFFLOADS", "add_sharding_arguments", "is_sharded", "machine_ram_bytes", "run_sharded"]

CLI_STRATEGIES = ("ddp", "fsdp", "fsdp-hybrid", "zero1", "zero2", "zero3")
OFFLOADS = ("none", "optimizer", "params", "all")
_EXIT_USAGE = 2
_EXIT_NOTHING_FITS = 1  # as memfit.cli.main.EXIT_NOTHING_FITS


def host_ram_verdict(needed_bytes: int) -> str:
    """``"; more than this machine's 23.47 GiB"`` when ``needed_bytes`` of host RAM (a node's) is more than this
    machine has, else ``""``."""
    have = machine_ram_bytes()
    if have is None or needed_bytes <= have:
        return ""
    return f"; more than this machine's {format_bytes(have)}"


def _gpus(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number or auto, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text!r}")
    return value


def add_sharding_arguments(plan: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand's options for runs over several GPUs."""
    group = plan.add_argument_group("several GPUs (answers are per rank)")
    group.add_argument("--gpus", "--world-size", dest="gpus", type=_gpus, default=1, metavar="N|auto",
                       help="GPUs in the job (default 1); alone, N above 1 plans DDP (its gradient buckets count on "
                       "every rank); auto: the fewest GPUs that fit --micro-batch-size per rank")  # fmt: skip
    group.add_argument("--strategy", choices=CLI_STRATEGIES, help="how the job splits the model states: fsdp "
                       "(FSDP2 fully_shard / FULL_SHARD), fsdp-hybrid (sharded within a node, replicated across "
                       "nodes), zero1/zero2/zero3 (DeepSpeed ZeRO stages), ddp; with --gpus auto, the only one "
                       "tried (default: all)")  # fmt: skip
    group.add_argument("--offload", choices=OFFLOADS, help="what lives in host RAM: optimizer (ZeRO-Offload), "
                       "params (ZeRO-3 offload_param), all; FSDP's CPU offload is all (default none; --gpus auto "
                       "shows where offload would fit but chooses it only when asked)")  # fmt: skip
    group.add_argument("--offload-optimizer", dest="offload", action="store_const", const="optimizer",
                       help="the same as --offload optimizer")  # fmt: skip
    group.add_argument("--nodes", type=_positive, help="nodes the --gpus are spread over (default 1; --gpus auto "
                       "fills nodes of 8)")  # fmt: skip
    group.add_argument("--micro-batch-size", type=_positive, default=1, metavar="N",
                       help="the micro batch each rank must fit (default 1); --gpus auto searches for it")  # fmt: skip
    group.add_argument("--max-gpus", type=_positive, default=1024, metavar="N",
                       help="the most GPUs --gpus auto considers (default 1024)")  # fmt: skip


def is_sharded(args: argparse.Namespace) -> bool:
    """Whether the command line asks for a per-rank plan (else ``--gpus N`` is the DDP world size)."""
    return (
        args.strategy is not None
        or args.gpus == "auto"
        or args.nodes is not None
        or args.offload in ("params", "all")
        or args.micro_batch_size != 1
    )


def _options(args: argparse.Namespace) -> tuple[list[Option], list[Option]]:
    """The strategy and offload asked for, checked; for ``--gpus auto`` every allowed pair, in order, and
    the offloading ones it shows but does not choose unless ``--offload`` names one."""
    offload = args.offload
    if args.strategy is not None:
        _check(args.strategy, offload or "none")
    if args.gpus != "auto":
        if args.strategy is None:
            raise InvalidInputError(
                f"--offload {offload} needs --strategy zero3 or fsdp (or --gpus auto to choose one)"
                if offload in ("params", "all")
                else "a per-rank plan needs --strategy (ddp, fsdp, fsdp-hybrid, zero1, zero2, zero3) or --gpus auto"
            )
        return [Option(args.strategy, offload or "none")], []
    strategies = [args.strategy] if args.strategy else list(AUTO_STRATEGIES)

    def allowed(levels: list[str]) -> list[Option]:
        pairs = []
        for level in levels:
            for strategy in strategies:
                try:
                    _check(strategy, level)
                except InvalidInputError:
                    continue
                pairs.append(Option(strategy, level))
        return pairs

    options = allowed([offload or "none"])
    if not options:
        raise InvalidInputError(f"--offload {offload} goes with no strategy --gpus auto tries: use zero3 or fsdp")
    return options, ([] if offload else allowed(list(AUTO_OFFLOADS)))


def _check(strategy: str, offload: str) -> None:
    """One clear line for each strategy and offload that do not go together."""
    if offload == "none":
        return
    if strategy == "ddp":
        raise InvalidInputError(
            f"--offload {offload} needs sharded states: DDP keeps everything on every GPU; use --strategy zero1, "
            "zero2, zero3 or fsdp"
        )
    if strategy.startswith("fsdp") and offload != "all":
        raise InvalidInputError(
            f"--offload {offload} with --strategy {strategy}: FSDP's CPU offload moves parameters, gradients and "
            "the optimizer step to the host together; use --offload all, or a ZeRO strategy"
        )
    if offload in ("params", "all") and strategy in ("zero1", "zero2"):
        raise InvalidInputError(
            f"--offload {offload} needs sharded parameters: --strategy zero3 or fsdp, got {strategy} (which can "
            "offload the optimizer only: --offload optimizer)"
        )


def _check_layout(args: argparse.Namespace) -> None:
    gpus, nodes = args.gpus, args.nodes
    if args.inference:
        raise InvalidInputError("--inference plans one GPU's forward pass; drop --strategy, --offload and --nodes")
    if args.gpu and len(args.gpu) > 1:
        raise InvalidInputError("a per-rank plan is for one kind of GPU: give --gpu once")
    if args.plot:
        raise InvalidInputError("--plot draws single-GPU plans; drop it for a per-rank plan")
    if gpus == "auto":
        if nodes is not None:
            raise InvalidInputError("--gpus auto chooses the nodes too (8 GPUs a node); drop --nodes")
        return
    if nodes is not None:
        if nodes > gpus:
            raise InvalidInputError(f"--nodes {nodes} is more than --gpus {gpus}")
        if gpus % nodes:
            raise InvalidInputError(
                f"--gpus {gpus} cannot be split evenly over --nodes {nodes}: give a multiple of {nodes} GPUs"
            )
    if gpus == 1 and (args.strategy or "").startswith("fsdp") and args.offload not in (None, "none"):
        raise InvalidInputError(
            f"--strategy {args.strategy} --offload {args.offload} on one GPU: FSDP does not shard on one GPU "
            "(NO_SHARD), and memfit does not model NO_SHARD's CPU offload; plan --gpus 2 or more, or one GPU with "
            f"--strategy zero3 --offload {args.offload} (DeepSpeed offloads there too)"
        )
    if args.strategy == "fsdp-hybrid" and (nodes or 1) < 2:
        raise InvalidInputError(
            "--strategy fsdp-hybrid shards within a node and replicates across nodes: give --nodes 2 or more "
            "(on one node it is --strategy fsdp)"
        )
    if args.micro_batch_size != 1 and args.target_batch_size != "max":
        target = args.target_batch_size
        if target < args.micro_batch_size * gpus:
            raise InvalidInputError(
                f"--target-batch-size {target} is less than --micro-batch-size {args.micro_batch_size} x --gpus "
                f"{gpus} = {args.micro_batch_size * gpus}"
            )


def run_sharded(args: argparse.Namespace, finetune: FinetuneSpec | None = None) -> int:
    """Plan one rank of the job (or find the fewest GPUs) and print it; ``finetune``: LoRA adapters to add."""
    _check_layout(args)
    options, hints = _options(args)
    try:
        report = _plan(args, options, hints, finetune)
    except NoCountFitsError as error:
        if args.json:  # the answer is "no", with the figures of every count tried
            answers.json_answer({"fits": False, "error": " ".join(str(error).split()),
                                 "budget_bytes": error.budget_bytes, "considered": list(error.considered)})  # fmt: skip
        else:  # the answer is printed as a found count's is: a line per count tried
            for line in error.lines:
                print(line)
        print(f"memfit: error: {' '.join(str(error).split())}", file=sys.stderr)  # nothing fits: the answer is "no"
        return _EXIT_NOTHING_FITS
    if args.json:
        answers.json_answer(report.to_dict())
    else:
        _print(report)
    if report.row.plan is None:  # the answer is "no", said on stderr too
        print(f"memfit: error: {report.row.error}", file=sys.stderr)
        return _EXIT_NOTHING_FITS
    return 0


def _plan(args: argparse.Namespace, options: list[Option], hints: list[Option],
          finetune: FinetuneSpec | None) -> ShardedReport:  # fmt: skip
    return plan_sharded(
        hf_config=args.hf_config,
        model=args.model,
        gpu=args.gpu[0] if args.gpu else None,
        budget=args.budget,
        options=options,
        hints=hints,
        gpus=None if args.gpus == "auto" else args.gpus,
        nodes=args.nodes,
        max_gpus=args.max_gpus,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len[0],
        image_size=args.image_size,
        layers=args.layers,
        precision=args.precision,
        optimizer=args.optimizer,
        checkpointing=args.checkpointing,
        target_batch_size=args.target_batch_size,
        margin=args.margin,
        exact=args.exact,
        zero_grad=args.zero_grad,
        show_progress=not args.json,
        finetune=finetune,
    )


def _print(report: ShardedReport) -> None:
    from memfit.cli.console import stdout_console
    from memfit.reporting.tables import plan_table

    console = stdout_console(width=None if sys.stdout.isatty() else 200)
    for check in report.considered:
        console.print(check.summary(report.budget_bytes), highlight=False)
    if report.considered:  # the offload that fits on the fewest GPUs: its host RAM, when this machine has less
        fitting = [(check.host_bytes(label), label, check.gpus) for check in report.considered
                   for label, _, _, fits, _, _ in check.peaks if fits and check.host_bytes(label)]  # fmt: skip
        needed, _, gpus = min(fitting, key=lambda f: (f[2], f[0])) if fitting else (0, "", 0)  # the fewest GPUs
        if verdict := host_ram_verdict(needed):
            labels = ", ".join(dict.fromkeys(name for size, name, count in fitting if (size, count) == (needed, gpus)))
            console.print(f"offloading ({labels}) at {gpus} GPU(s) would need {format_bytes(needed)} of host RAM a "
                          f"node{verdict}", highlight=False)  # fmt: skip
    console.print(plan_table(report.report))
    if report.sharding is not None:
        console.print(rank_states_line(report), highlight=False)
        if report.host_offload_per_rank_bytes:
            console.print(
                f"host RAM for offloaded states (pinned): {format_bytes(report.host_offload_per_rank_bytes)} a rank, "
                f"{format_bytes(report.host_offload_per_node_bytes)} a node"
                + host_ram_verdict(report.host_offload_per_node_bytes),
                highlight=False,
            )
    from memfit.planning.gpu_report import traced_how

    searched = ("searched on traces at {low} and {high} blocks extrapolated in depth; the plan is confirmed on the "
                "whole model (--exact: search on it too)")  # fmt: skip
    for line in traced_how(report.report, extrapolated=searched):
        console.print(line, highlight=False)


def rank_states_line(report: ShardedReport) -> str:
    """What one rank keeps of the model between steps, from the estimate the table shows (the table's columns are
    the moment of the peak, when a unit's gradients may still be whole or none be born yet)."""
    from memfit.planning.sharded import describe

    terms = dict(report.model_states_bytes)
    gathered = terms.pop("gathered_parameters", None)
    kept = ", ".join(f"{name.replace('_', ' ')} {format_bytes(size)}" for name, size in terms.items())
    line = f"one rank of {describe(report.sharding)} keeps {kept}"
    if gathered:
        line += f"; it gathers up to {format_bytes(gathered)} of parameters while blocks run"
    return line + " (the table: the moment of the peak)"
