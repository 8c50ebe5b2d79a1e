"""`memfit plan --gpus N|auto --strategy ... --offload ... --nodes ...`: one rank's plan, and the fewest GPUs.

A small Llama config (a config.json in tmp_path, built on meta and traced on fake tensors) whose
model states are large next to its activations, so sharding decides what fits.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from memfit.cli.main import main
from memfit.units import MiB

_CONFIG = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
    "max_position_embeddings": 128,
}
_STATES = ("parameters", "gradients", "optimizer_state")


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama") / "config.json"
    path.write_text(json.dumps(_CONFIG))
    return str(path)


def _plan(capsys: pytest.CaptureFixture[str], config: str, *extra: str, budget: str = "2GiB") -> dict[str, Any]:
    code = main(["plan", "--hf-config", config, "--seq-len", "32", "--budget", budget, "--json", *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_fsdp_model_states_per_rank_are_the_hand_arithmetic_over_n(
    capsys: pytest.CaptureFixture[str], config: str
) -> None:
    """bf16-mixed AdamW under FSDP: fp32 parameters (4 B), fp32 gradients (4 B) and two fp32 Adam moments
    (8 B) per parameter, divided by the GPU count; DDP keeps all of them on every rank."""
    answers = {n: _plan(capsys, config, "--gpus", str(n), "--strategy", "fsdp") for n in (2, 4, 8)}
    ddp = _plan(capsys, config, "--gpus", "4", "--strategy", "ddp")
    parameters = ddp["parameters"]
    hand = {"parameters": 4 * parameters, "gradients": 4 * parameters, "optimizer_state": 8 * parameters}
    for name in _STATES:
        # the trace's blocks are rounded to 512 B each and Adam keeps a step count per tensor: within 3 %
        assert ddp["model_states_per_rank_bytes"][name] == pytest.approx(hand[name], rel=0.03)
        for n, answer in answers.items():
            assert answer["model_states_per_rank_bytes"][name] == pytest.approx(hand[name] / n, rel=0.03)
    for few, many in ((2, 4), (4, 8)):
        rows = answers[few]["gpus"][0], answers[many]["gpus"][0]
        assert rows[1]["breakdown_bytes"]["optimizer_state"] < rows[0]["breakdown_bytes"]["optimizer_state"]
        assert rows[1]["largest_micro_batch"] >= rows[0]["largest_micro_batch"]
    row = answers[8]["gpus"][0]
    assert row["fits"] and row["world_size"] == 8
    assert row["effective_batch_size"] == row["micro_batch_size"] * row["accumulate_grad_batches"] * 8


def test_a_rank_that_does_not_fit_keeps_its_sharded_states_and_is_told_to_shard_further(
    capsys: pytest.CaptureFixture[str], config: str
) -> None:
    """Without a plan the model-state line is still the rank's own terms (the arithmetic over N, as with a plan),
    and the advice for a sharded run is more GPUs or offload, not "sharding"."""
    fits = _plan(capsys, config, "--gpus", "2", "--strategy", "fsdp")
    code = main(["plan", "--hf-config", config, "--seq-len", "32", "--budget", "800MiB", "--gpus", "2", "--strategy",
                 "fsdp", "--json"])  # fmt: skip
    captured = capsys.readouterr()
    refused = json.loads(captured.out)
    assert code == 1 and not refused["gpus"][0]["fits"]
    assert refused["model_states_per_rank_bytes"] == fits["model_states_per_rank_bytes"]
    assert "Use more GPUs than 2" in refused["gpus"][0]["error"] and "sharding (FSDP/ZeRO)" not in captured.err


def test_zero_stages_hold_less_the_more_they_shard(capsys: pytest.CaptureFixture[str], config: str) -> None:
    totals = {}
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        # DeepSpeed's default buckets are 5e8 elements: room for them
        answer = _plan(capsys, config, "--gpus", "4", "--strategy", strategy, budget="8GiB")
        assert answer["sharding"]["strategy"] == strategy and answer["sharding"]["shard_group_size"] in (1, 4)
        states = answer["model_states_per_rank_bytes"]
        totals[strategy] = sum(size for name, size in states.items() if name != "gathered_parameters")
    assert totals["zero3"] < totals["zero2"] < totals["zero1"] < totals["ddp"]


def test_accumulation_keeps_the_effective_batch_across_ranks(capsys: pytest.CaptureFixture[str], config: str) -> None:
    answer = _plan(capsys, config, "--gpus", "4", "--strategy", "zero2", "--target-batch-size", "64")
    row = answer["gpus"][0]
    assert row["effective_batch_size"] == 64 == row["micro_batch_size"] * row["accumulate_grad_batches"] * 4


def test_offload_and_nodes_in_the_json(capsys: pytest.CaptureFixture[str], config: str) -> None:
    plain = _plan(capsys, config, "--gpus", "8", "--nodes", "2", "--strategy", "zero3", budget="8GiB")
    offloaded = _plan(capsys, config, "--gpus", "8", "--nodes", "2", "--strategy", "zero3", "--offload", "all",
                      budget="8GiB")  # fmt: skip
    sharding = offloaded["sharding"]
    assert sharding["nodes"] == 2 and sharding["gpus_per_node"] == 4 and sharding["shard_group_size"] == 8
    assert sharding["offload_optimizer"] and sharding["offload_params"] and sharding["offload"] == "all"
    assert plain["host_offload_per_rank_bytes"] == 0 == plain["host_offload_per_node_bytes"]
    per_rank = offloaded["host_offload_per_rank_bytes"]
    assert per_rank > 0 and offloaded["host_offload_per_node_bytes"] == 4 * per_rank
    # what left the device is what the host holds: more than the device's optimizer state was
    assert per_rank > plain["model_states_per_rank_bytes"]["optimizer_state"]
    assert offloaded["model_states_per_rank_bytes"]["optimizer_state"] == 0
    assert sum(offloaded["model_states_per_rank_bytes"].values()) < sum(plain["model_states_per_rank_bytes"].values())
    hybrid = _plan(capsys, config, "--gpus", "8", "--nodes", "2", "--strategy", "fsdp-hybrid")
    assert hybrid["sharding"]["shard_group_size"] == 4  # sharded within a node, replicated across the two


def test_gpus_auto_picks_the_smallest_count_its_own_answers_say_fits(
    capsys: pytest.CaptureFixture[str], config: str
) -> None:
    one = _plan(capsys, config, "--gpus", "1", "--strategy", "ddp", "--target-batch-size", "1", "--margin", "0")
    eight = _plan(capsys, config, "--gpus", "8", "--strategy", "fsdp", "--target-batch-size", "8", "--margin", "0")
    low, high = (answer["gpus"][0]["predicted_peak_bytes"] for answer in (eight, one))
    assert low < high
    budget = f"{(low + high) // 2 // MiB}MiB"  # between what one GPU and a rank of eight need
    auto = _plan(capsys, config, "--gpus", "auto", "--checkpointing", "off", "--margin", "0", budget=budget)
    chosen = auto["sharding"]["gpus"]
    considered = auto["considered"]
    assert [check["gpus"] for check in considered] == [1, 2, 4, 8][: len(considered)]
    assert considered[-1]["gpus"] == chosen and 1 < chosen <= 8
    for check in considered[:-1]:  # every smaller count: nothing fits, by the screen or by the rank's own estimate
        assert not check["fits"] and check["chosen"] is None
        estimated = [o for o in check["options"] if o["estimated"]]
        assert {o["option"] for o in estimated} == set(check["not_confirmed"])
        assert not any(o["fits"] for o in estimated)
    # offload is weighed and shown at every count, but chosen only when asked for
    assert {"offload" in o["option"] for o in considered[0]["options"]} == {True, False}
    assert all(("offload" in o["option"]) is not o["choosable"] for o in considered[0]["options"])
    last = considered[-1]
    assert last["fits"] and last["chosen"] == auto["sharding"]["strategy"]
    chosen_option = next(o for o in last["options"] if o["option"] == last["chosen"])
    assert chosen_option["estimated"] and chosen_option["peak_bytes"] <= auto["budget_bytes"]
    row = auto["gpus"][0]
    assert row["fits"] and row["predicted_peak_bytes"] <= row["budget_bytes"] == auto["budget_bytes"]
    assert auto["auto"] is True and row["world_size"] == chosen


def test_gpus_auto_with_no_count_that_fits_answers_no_in_json_too(
    capsys: pytest.CaptureFixture[str], config: str
) -> None:
    argv = ["plan", "--hf-config", config, "--seq-len", "32", "--budget", "100MiB", "--gpus", "auto", "--max-gpus",
            "4", "--checkpointing", "on", "--offload", "all", "--json"]  # fmt: skip
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 1
    answer = json.loads(captured.out)
    assert answer["fits"] is False and answer["budget_bytes"] == 100 * MiB * 985 // 1000
    assert [check["gpus"] for check in answer["considered"]] == [1, 2, 4]
    assert not any(check["fits"] for check in answer["considered"])
    assert captured.err.startswith("memfit: error: ") and captured.err.count("\n") == 1
    # checkpointing and offloading everything were asked for: the advice does not suggest them again
    assert "--offload all" not in answer["error"] and "try checkpointing" not in answer["error"]
    assert "a larger --max-gpus" in answer["error"]
    # the text answer prints each count's line on stdout, as a found count's answer does, and says "no" on stderr
    assert main(argv[:-1]) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert [line.split(" GPU(s)")[0] for line in lines] == ["1", "2", "4"] and all("does not fit" in x for x in lines)
    assert captured.err.startswith("memfit: error: ") and captured.err.count("\n") == 1


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (["--gpus", "4", "--strategy", "zero2", "--offload", "params"], ["needs sharded parameters", "zero3 or fsdp"]),
        (["--gpus", "8", "--nodes", "3", "--strategy", "fsdp"], ["--gpus 8 cannot be split evenly over --nodes 3"]),
        (["--gpus", "4", "--strategy", "ddp", "--offload", "optimizer"], ["DDP keeps everything"]),
        (["--gpus", "4", "--strategy", "fsdp", "--offload", "optimizer"], ["use --offload all"]),
        (["--gpus", "4", "--offload", "params"], ["needs --strategy zero3 or fsdp"]),
        (["--gpus", "auto", "--nodes", "2"], ["--gpus auto chooses the nodes"]),
        (["--gpus", "8", "--strategy", "fsdp-hybrid"], ["give --nodes 2 or more"]),
        (["--gpus", "2", "--nodes", "4", "--strategy", "fsdp"], ["--nodes 4 is more than --gpus 2"]),
        (["--gpus", "0"], ["--gpus", "positive whole number or auto", "'0'"]),
        (["--gpus", "4", "--strategy", "zero4"], ["--strategy", "zero4"]),
        (["--gpus", "4", "--strategy", "fsdp", "--inference"], ["--inference"]),
        (["--gpus", "auto", "--gpu", "h100", "--gpu", "a100"], ["give --gpu once"]),
        (["--gpus", "4", "--strategy", "fsdp", "--lora-r", "8", "--quantize", "nf4"], ["--quantize nf4", "QLoRA"]),
    ],
)
def test_bad_combinations_are_one_clear_line(
    capsys: pytest.CaptureFixture[str], config: str, extra: list[str], fragments: list[str]
) -> None:
    argv = ["plan", "--hf-config", config, "--seq-len", "32", *extra]
    if "--gpu" not in extra:
        argv += ["--budget", "2GiB"]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfit: error:")
    for fragment in fragments:
        assert fragment in lines[0]


def test_lora_under_sharding_counts_states_for_the_adapters_only(
    capsys: pytest.CaptureFixture[str], config: str
) -> None:
    """LoRA on a bf16 base (peft keeps the adapters fp32) under ZeRO-3 and FSDP on 4 GPUs: the frozen base is
    sharded, and only the adapters have gradients and (fp32) Adam state, a quarter of them on each rank."""
    # (DeepSpeed's default buckets, 5e8 elements, are allocated whole whatever the model: a larger budget)
    full = _plan(capsys, config, "--gpus", "4", "--strategy", "zero3", budget="8GiB")
    for strategy in ("zero3", "fsdp"):
        lora = _plan(capsys, config, "--gpus", "4", "--strategy", strategy, "--lora-r", "8", "--lora-targets",
                     "all-linear", budget="8GiB")  # fmt: skip
        trainable = lora["trainable_parameters"]
        assert 0 < trainable < lora["parameters"] // 20
        states = lora["model_states_per_rank_bytes"]
        assert states["optimizer_state"] == pytest.approx(8 * trainable / 4, rel=0.1), strategy
        assert states["optimizer_state"] < full["model_states_per_rank_bytes"]["optimizer_state"] / 10


def test_gpus_auto_screen_table_and_states_come_from_one_estimate(config: str) -> None:
    """The chosen count's screen figure, the table's row and the model-state line are one per-rank estimate's."""
    from memfit.planning.sharded_plan import AUTO_STRATEGIES, Option, plan_sharded

    options = [Option(strategy) for strategy in AUTO_STRATEGIES]
    common = {"hf_config": config, "model": None, "gpu": None, "seq_len": 32, "checkpointing": "off", "margin": 0.0}
    one = plan_sharded(**common, budget="2GiB", options=[Option("ddp")], gpus=1, target_batch_size=1)
    eight = plan_sharded(**common, budget="2GiB", options=[Option("fsdp")], gpus=8, target_batch_size=8)
    budget = (one.row.plan.predicted_peak_bytes + eight.row.plan.predicted_peak_bytes) // 2  # one GPU cannot hold it
    report = plan_sharded(**common, budget=f"{budget}B", options=options, gpus=None)
    last = report.considered[-1]
    _, figure, _, fits, _, estimated = next(p for p in last.peaks if p[0] == last.confirmed)
    assert report.sharding is not None and report.sharding.world_size == last.gpus > 1 and fits and estimated
    estimate, curve = report.row.estimate, report.row.base
    assert estimate is not None and estimate.sharding == report.sharding
    assert curve is not None and curve.estimate.sharding == report.sharding
    assert figure == curve.least_device_bytes(1)  # the table's estimate, at the screened micro batch
    assert report.model_states_bytes == dict(estimate.rank_terms)
    assert report.row.plan.predicted_peak_bytes == curve.least_device_bytes(report.row.plan.micro_batch_size)
    plan = report.row.plan  # the count's line says the table's figure beside the screened one where they differ
    assert last.planned == (plan.micro_batch_size, plan.gradient_checkpointing, plan.predicted_peak_bytes)
    table_figure = f"planned at micro batch {plan.micro_batch_size}"
    assert (table_figure in last.summary(report.budget_bytes)) is (figure != plan.predicted_peak_bytes)
    assert last.to_dict()["planned"]["predicted_peak_bytes"] == plan.predicted_peak_bytes


def _per_rank(config: str, option: Any, gpus: int) -> Any:
    """One rank's step traced by ``memfit.trace`` itself, as ``--gpus auto`` asks it at ``gpus`` GPUs:
    bf16-mixed AdamW, micro batch 1, no checkpointing, the GPU a budget is planned on."""
    import memfit
    from memfit.precision import Precision
    from memfit.presets import from_hf_config
    from memfit.simulation.runtime import CudaRuntime
    from memfit.tracing.config import Target, TrainingLoop

    spec = from_hf_config(config, seq_len=32)
    sharding = option.config(gpus, min(gpus, 8), Precision.BF16_MIXED)
    loop, target = TrainingLoop(sharding=sharding), Target("cuda", runtime=CudaRuntime())
    return memfit.trace(spec.model, spec.sample, batch_size=1, precision="bf16-mixed", loop=loop, target=target)


def test_gpus_auto_screens_fsdp_on_one_gpu_as_its_own_per_rank_estimate(config: str) -> None:
    """FSDP on one GPU is NO_SHARD: the plain step on fp32 weights, not the two-GPU estimate's 16-bit step read
    at a shard group of one (which halved its model states). Its screen line, not planned where DDP fits first,
    is that estimate's own peak, and the two-GPU estimate refuses to be read there."""
    from memfit.errors import InvalidInputError
    from memfit.planning.sharded import rescaled
    from memfit.planning.sharded_plan import AUTO_STRATEGIES, Option, plan_sharded

    common = {"hf_config": config, "model": None, "gpu": None, "seq_len": 32, "checkpointing": "off", "margin": 0.0}
    hints = [Option("fsdp", "all")]
    report = plan_sharded(**common, budget="2GiB", options=[Option(s) for s in AUTO_STRATEGIES], hints=hints, gpus=None)
    assert report.sharding is not None and (report.sharding.strategy, report.sharding.world_size) == ("ddp", 1)
    figures = {label: (peak, estimated) for label, peak, _, _, _, estimated in report.considered[0].peaks}
    assert "fsdp+offload-all" not in figures  # NO_SHARD's CPU offload is not modelled: not screened on one GPU
    for option in (Option("fsdp"),):
        one = _per_rank(config, option, 1)
        assert figures[option.label] == (one.at(1).device_bytes, False), option.label
        fp32_weights = 4 * report.report.parameters
        assert one.estimate.rank_terms["parameters"] == pytest.approx(fp32_weights, rel=0.03)
        with pytest.raises(InvalidInputError, match="another step"):
            rescaled(_per_rank(config, Option("fsdp"), 2), one.estimate.sharding)


def test_fsdp_offload_on_one_gpu_is_refused_in_one_line(capsys: pytest.CaptureFixture[str], config: str) -> None:
    """One GPU's FSDP is NO_SHARD, whose CPU offload memfit does not model: refused, with what to plan instead."""
    assert main(["plan", "--hf-config", config, "--budget", "2GiB", "--strategy", "fsdp", "--offload", "all",
                 "--gpus", "1"]) == 2  # fmt: skip
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "NO_SHARD" in error and "--strategy zero3 --offload all" in error


@pytest.mark.parametrize(("strategy", "gpus"), [("zero1", 2), ("zero2", 2), ("zero3", 2), ("fsdp", 2), ("fsdp", 1)])
def test_gpus_auto_line_table_and_breakdown_are_the_per_rank_estimate_at_the_chosen_count(
    config: str, strategy: str, gpus: int
) -> None:
    """A budget that ``gpus`` GPUs hold and fewer do not (by ``memfit.estimate``'s own per-rank answers): the
    search chooses that count, and its screen figure, the table's row and the model-state line are those of the
    per-rank estimate there; a count planned and refused shows what its estimate needs."""
    from memfit.planning.sharded_plan import Option, plan_sharded

    option = Option(strategy)
    need = {n: _per_rank(config, option, n) for n in (1, 2)}
    least = {n: curve.least_device_bytes(1) for n, curve in need.items()}
    assert least[2] < least[1]
    budget = least[1] + MiB if gpus == 1 else (least[1] + least[2]) // 2
    common = {"hf_config": config, "model": None, "gpu": None, "seq_len": 32, "checkpointing": "off", "margin": 0.0}
    report = plan_sharded(**common, budget=f"{budget}B", options=[option], gpus=None)
    assert report.sharding == need[gpus].estimate.sharding
    for check in report.considered[:-1]:
        for label, figure, _, fits, _, estimated in check.peaks:
            if estimated:
                assert figure == need[check.gpus].least_device_bytes(1) and not fits, label
    last = report.considered[-1]
    assert (last.gpus, last.confirmed) == (gpus, strategy)
    on_card = need[gpus].at_limit(1, budget)
    assert on_card is not None and on_card.fits
    assert last.peaks[0][1] == on_card.peak_reserved_bytes + (need[gpus].estimate.cuda_context_bytes or 0)
    estimate, curve = report.row.estimate, report.row.base
    assert estimate is not None and curve is not None and report.row.plan is not None
    assert dict(estimate.rank_terms) == dict(need[gpus].estimate.rank_terms) == report.model_states_bytes
    assert report.row.plan.predicted_peak_bytes == curve.least_device_bytes(report.row.plan.micro_batch_size)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_gpus_auto_chosen_line_is_the_peak_its_table_prints(tmp_path: Any, strategy: str) -> None:
    """A step that fits with room to spare reaches more on the card than the least it runs in at the allocator's
    limit (a wide vocabulary's logits leave gaps in the pool): the chosen count's line gives the table's predicted
    peak at that micro batch, not a smaller figure above it."""
    from memfit.planning.sharded_plan import Option, plan_sharded

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_CONFIG, "vocab_size": 32000}))
    common = {"hf_config": str(path), "model": None, "gpu": None, "seq_len": 128, "checkpointing": "off"}
    report = plan_sharded(**common, margin=0.0, budget="8GiB", options=[Option(strategy)], gpus=None,
                          target_batch_size=1)  # fmt: skip
    last = report.considered[-1]
    _, figure, _, fits, _, estimated = next(p for p in last.peaks if p[0] == last.confirmed)
    plan, curve = report.row.plan, report.row.base
    assert plan is not None and curve is not None and plan.micro_batch_size == 1 and fits and estimated
    assert figure == plan.predicted_peak_bytes
    assert figure >= (curve.least_device_bytes(1) or 0)
