"""Formula tier: the seed examples exactly, each accounting rule, and input validation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch import nn

import memfit
from memfit.categories import Category, Phase
from memfit.errors import InvalidInputError
from memfit.precision import Precision
from memfit.prediction.formula import OPTIMIZERS, FormulaEstimate, estimate_from_counts, normalize_optimizer
from memfit.tracing.optimizers import optimizer_info
from memfit.units import MiB, format_bytes

COMPONENT_KEYS = [
    "parameters_bytes",
    "gradients_bytes",
    "master_weights_bytes",
    "optimizer_state_bytes",
    "activations_bytes",
]


# --- seed examples -------------------------------------------------------------------------------


def test_seed_fp32_no_optimizer_with_activations() -> None:
    est = estimate_from_counts(
        parameters=20_000_000,
        batch_size=32,
        activations_per_sample=1_000_000,
        precision="fp32",
        optimizer="none",
    )
    assert est.parameters_bytes == 80_000_000
    assert est.gradients_bytes == 80_000_000
    assert est.master_weights_bytes == 0
    assert est.optimizer_state_bytes == 0
    assert est.activations_bytes == 128_000_000
    assert est.total_bytes == 288_000_000
    assert round(est.total_bytes / MiB, 1) == 274.7


def test_seed_fp32_sgd_momentum() -> None:
    est = estimate_from_counts(parameters=19_072_984, precision="fp32", optimizer="sgd-momentum")
    assert est.parameters_bytes == 4 * 19_072_984
    assert est.gradients_bytes == 4 * 19_072_984
    assert est.optimizer_state_bytes == 4 * 19_072_984
    assert est.activations_bytes == 0
    assert est.total_bytes == 228_875_808
    assert format_bytes(est.total_bytes) == "218.27 MiB"


def test_seed_7b_pure_fp16_weights() -> None:
    est = estimate_from_counts(parameters=7_000_000_000, precision="fp16", optimizer="none")
    assert est.parameters_bytes == 14_000_000_000


def test_seed_7b_fp32_adam_moments() -> None:
    est = estimate_from_counts(parameters=7_000_000_000, precision="fp32", optimizer="adam")
    assert est.optimizer_state_bytes == 56_000_000_000


def test_seed_7b_mixed_precision_adam_is_16_bytes_per_parameter() -> None:
    est = estimate_from_counts(parameters=7_000_000_000, precision="16-mixed", optimizer="adam")
    assert est.parameters_bytes == 14_000_000_000  # fp16 working copy
    assert est.gradients_bytes == 14_000_000_000  # fp16 gradients
    assert est.master_weights_bytes == 28_000_000_000  # fp32 master copy
    assert est.optimizer_state_bytes == 56_000_000_000  # fp32 m and v
    assert est.activations_bytes == 0
    assert est.total_bytes == 112_000_000_000


# --- rules ---------------------------------------------------------------------------------------

# precision -> (weight/gradient bytes, master bytes, optimizer-state dtype bytes, activation bytes)
PRECISION_RULES = {
    "fp32": (4, 0, 4, 4),
    "16-mixed": (2, 4, 4, 2),
    "bf16-mixed": (2, 4, 4, 2),
    "fp16": (2, 0, 2, 2),
    "16-true": (2, 0, 2, 2),
    "bf16": (2, 0, 2, 2),
    "bf16-true": (2, 0, 2, 2),
}


@pytest.mark.parametrize("precision", sorted(PRECISION_RULES))
def test_precision_rules(precision: str) -> None:
    weight, master, state, activation = PRECISION_RULES[precision]
    est = estimate_from_counts(
        parameters=1000, batch_size=3, activations_per_sample=10, precision=precision, optimizer="adamw"
    )
    assert est.parameters_bytes == 1000 * weight
    assert est.gradients_bytes == 1000 * weight
    assert est.master_weights_bytes == 1000 * master
    assert est.optimizer_state_bytes == 1000 * 2 * state
    assert est.activations_bytes == 30 * activation


@pytest.mark.parametrize(
    ("optimizer", "fp32_bytes", "pure_half_bytes"),
    [
        ("none", 0, 0),
        ("sgd", 0, 0),
        ("sgd-momentum", 4, 2),
        ("adam", 8, 4),
        ("adamw", 8, 4),
        ("adafactor", 4, 4),
        ("adagrad", 4, 2),
        ("rmsprop", 4, 2),
        ("adam-8bit", 8, 8),  # bitsandbytes keeps a tensor under 4096 elements in two fp32 states
    ],
)
def test_optimizer_state_per_trainable_parameter(optimizer: str, fp32_bytes: int, pure_half_bytes: int) -> None:
    assert estimate_from_counts(parameters=1000, optimizer=optimizer).optimizer_state_bytes == 1000 * fp32_bytes
    mixed = estimate_from_counts(parameters=1000, optimizer=optimizer, precision="bf16-mixed")
    assert mixed.optimizer_state_bytes == 1000 * fp32_bytes
    pure = estimate_from_counts(parameters=1000, optimizer=optimizer, precision="bf16")
    assert pure.optimizer_state_bytes == 1000 * pure_half_bytes


def test_every_canonical_optimizer_is_covered() -> None:
    assert set(OPTIMIZERS) == {
        "none", "sgd", "sgd-momentum", "adam", "adamw", "adafactor", "adagrad", "rmsprop", "adam-8bit"
    }  # fmt: skip


# The trace counts each parameter's step counter (a scalar tensor) as optimizer state; the formula does not.
_STEP_COUNTER_BYTES = torch.tensor(0.0).element_size()


@pytest.mark.parametrize("precision", ["fp32", "bf16-true"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_formula_state_agrees_with_the_trace(name: str, precision: str) -> None:
    """Every registered optimizer: the formula's state bytes are what two traced steps keep as optimizer state."""
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 128))  # tensors on both sides of 4096
    sizes = [p.numel() for p in model.parameters()]
    parameters = sum(sizes)
    formula = estimate_from_counts(
        parameters=parameters, precision=precision, optimizer=name, trainable_sizes=sizes
    ).optimizer_state_bytes
    info = optimizer_info(name)
    if info.untraceable is not None:
        with pytest.raises(InvalidInputError, match="estimate_from_counts"):
            memfit.estimate(model, torch.randn(4, 32), optimizer=name, precision=precision, target=memfit.Target("cpu"))
        assert formula == parameters * info.state_bytes(2 if precision == "bf16-true" else 4)
        return
    traced = memfit.estimate(model, torch.randn(4, 32), optimizer=name, precision=precision,
                             target=memfit.Target("cpu"), loss_fn=lambda out, _batch: out.sum())  # fmt: skip
    last_step = [p for p in traced.phases if p.phase is Phase.OPTIMIZER][-1]
    state = last_step.breakdown.get(Category.OPTIMIZER_STATE, 0)
    if info.approximate:  # the formula's figure is a stand-in; tests/test_optimizers.py checks the trace is exact
        assert state > 0
        assert state <= formula  # adafactor keeps O(rows + cols) per matrix, under 4 B per element
        return
    assert formula <= state <= formula + _STEP_COUNTER_BYTES * len(list(model.parameters()))
    assert (state > 0) == (info.state_bytes(4) > 0)


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        (None, "none"),
        ("none", "none"),
        ("None", "none"),
        ("SGD", "sgd"),
        ("sgd-momentum", "sgd-momentum"),
        ("sgd_momentum", "sgd-momentum"),
        ("Momentum", "sgd-momentum"),
        ("Adam", "adam"),
        ("ADAMW", "adamw"),
        ("adafactor", "adafactor"),
        ("adam-8bit", "adam-8bit"),
        ("adamw-8bit", "adam-8bit"),
        ("adam8bit", "adam-8bit"),
        ("bnb-adam8bit", "adam-8bit"),
        ("bnb_adam8bit", "adam-8bit"),
        (" adamw ", "adamw"),
    ],
)
def test_optimizer_aliases(name: str | None, canonical: str) -> None:
    assert normalize_optimizer(name) == canonical
    assert estimate_from_counts(parameters=1, optimizer=name).optimizer == canonical


def test_default_is_fp32_adamw_batch_one() -> None:
    est = estimate_from_counts(parameters=10)
    assert est.precision is Precision.FP32
    assert est.optimizer == "adamw"
    assert est.batch_size == 1
    assert est.total_bytes == 10 * (4 + 4 + 8)


def test_trainable_fraction_scales_only_trained_state() -> None:
    est = estimate_from_counts(parameters=1000, precision="16-mixed", optimizer="adam", trainable_fraction=0.25)
    assert est.trainable_parameters == 250
    assert est.parameters_bytes == 250 * 2 + 750 * 4  # every weight is still stored; autocast keeps frozen ones fp32
    assert est.gradients_bytes == 250 * 2
    assert est.master_weights_bytes == 250 * 4
    assert est.optimizer_state_bytes == 250 * 8


def test_trainable_fraction_rounds_to_nearest_parameter() -> None:
    est = estimate_from_counts(parameters=3, optimizer="sgd", trainable_fraction=0.6)
    assert est.trainable_parameters == 2  # round(1.8)
    assert est.gradients_bytes == 2 * 4


def test_frozen_model_has_weights_only() -> None:
    est = estimate_from_counts(parameters=1000, precision="bf16-mixed", optimizer="adamw", trainable_fraction=0)
    assert est.components() == {
        "parameters_bytes": 4000,  # autocast keeps frozen weights in fp32
        "gradients_bytes": 0,
        "master_weights_bytes": 0,
        "optimizer_state_bytes": 0,
        "activations_bytes": 0,
    }


def test_whole_float_parameter_count_is_accepted() -> None:
    assert estimate_from_counts(parameters=7e9, precision="fp16", optimizer="none").parameters_bytes == 14 * 10**9


def test_precision_enum_is_accepted() -> None:
    est = estimate_from_counts(parameters=10, precision=Precision.BF16_MIXED)
    assert est.precision is Precision.BF16_MIXED


# --- the dataclass -------------------------------------------------------------------------------


def test_components_order_and_total() -> None:
    est = estimate_from_counts(parameters=123, batch_size=4, activations_per_sample=7, precision="16-mixed")
    assert list(est.components()) == COMPONENT_KEYS
    assert est.total_bytes == sum(est.components().values())


def test_estimate_is_frozen() -> None:
    est = estimate_from_counts(parameters=1)
    with pytest.raises(AttributeError):
        est.parameters_bytes = 0  # type: ignore[misc]


def test_to_dict_is_json_ready() -> None:
    est = estimate_from_counts(
        parameters=20_000_000,
        batch_size=32,
        activations_per_sample=1_000_000,
        precision="fp32",
        optimizer="none",
    )
    data = json.loads(json.dumps(est.to_dict()))
    for key in COMPONENT_KEYS:
        assert data[key] == getattr(est, key)
    assert data["total_bytes"] == 288_000_000
    assert data["parameters"] == 20_000_000
    assert data["batch_size"] == 32
    assert data["activations_per_sample"] == 1_000_000
    assert data["precision"] == "fp32"
    assert data["optimizer"] == "none"
    assert data["trainable_fraction"] == 1.0


def test_to_dict_uses_short_precision_names() -> None:
    assert estimate_from_counts(parameters=1, precision="16-true").to_dict()["precision"] == "fp16"
    assert estimate_from_counts(parameters=1, precision="bf16-mixed").to_dict()["precision"] == "bf16-mixed"


def test_is_a_formula_estimate() -> None:
    assert isinstance(estimate_from_counts(parameters=1), FormulaEstimate)


@example(  # 8-bit state: training 3/4 of 4096 elements was counted as more than training them all
    parameters=4096,
    batch_size=1,
    activations_per_sample=0,
    precision="16-mixed",
    optimizer="adam-8bit",
    trainable_fraction=0.75,
)
@given(
    parameters=st.integers(min_value=0, max_value=10**12),
    batch_size=st.integers(min_value=1, max_value=4096),
    activations_per_sample=st.integers(min_value=0, max_value=10**10),
    precision=st.sampled_from(sorted(PRECISION_RULES)),
    optimizer=st.sampled_from(OPTIMIZERS),
    trainable_fraction=st.floats(min_value=0.0, max_value=1.0),
)
def test_properties(
    parameters: int,
    batch_size: int,
    activations_per_sample: int,
    precision: str,
    optimizer: str,
    trainable_fraction: float,
) -> None:
    kwargs = {
        "parameters": parameters,
        "activations_per_sample": activations_per_sample,
        "precision": precision,
        "optimizer": optimizer,
        "trainable_fraction": trainable_fraction,
    }
    est = estimate_from_counts(batch_size=batch_size, **kwargs)
    assert all(isinstance(v, int) and v >= 0 for v in est.components().values())
    assert est.total_bytes == sum(est.components().values())
    assert 0 <= est.trainable_parameters <= parameters
    # Only activations depend on the batch size, and linearly.
    bigger = estimate_from_counts(batch_size=batch_size + 1, **kwargs)
    assert bigger.total_bytes - est.total_bytes == est.activations_bytes // batch_size
    # Training everything never needs less than training a part.
    everything = estimate_from_counts(batch_size=batch_size, **{**kwargs, "trainable_fraction": 1.0})
    assert everything.total_bytes >= est.total_bytes


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"parameters": -1}, ["parameters", ">= 0", "got -1"]),
        ({"parameters": 1.5}, ["parameters", "whole number", "got 1.5"]),
        ({"parameters": "7B"}, ["parameters", "got '7B'"]),
        ({"parameters": True}, ["parameters", "got True"]),
        ({"parameters": math.nan}, ["parameters", "got nan"]),
        ({"parameters": 10, "batch_size": 0}, ["batch_size", ">= 1", "got 0"]),
        ({"parameters": 10, "batch_size": False}, ["batch_size", "got False"]),
        ({"parameters": 10, "batch_size": 2.5}, ["batch_size", "got 2.5"]),
        ({"parameters": 10, "activations_per_sample": -5}, ["activations_per_sample", ">= 0", "got -5"]),
        ({"parameters": 10, "activations_per_sample": True}, ["activations_per_sample", "got True"]),
        ({"parameters": 10, "trainable_fraction": 1.5}, ["trainable_fraction", "between 0 and 1", "got 1.5"]),
        ({"parameters": 10, "trainable_fraction": -0.1}, ["trainable_fraction", "got -0.1"]),
        ({"parameters": 10, "trainable_fraction": math.nan}, ["trainable_fraction", "got nan"]),
        ({"parameters": 10, "trainable_fraction": True}, ["trainable_fraction", "got True"]),
        ({"parameters": 10, "trainable_fraction": "half"}, ["trainable_fraction", "got 'half'"]),
        ({"parameters": 10, "precision": "fp8"}, ["precision", "fp32", "bf16-mixed", "got 'fp8'"]),
        (
            {"parameters": 10, "optimizer": "lion"},
            ["optimizer", "adamw", "sgd-momentum", "adam-8bit", "got 'lion'"],
        ),
        ({"parameters": 10, "optimizer": 3}, ["optimizer", "got 3"]),
    ],
)
def test_invalid_input_is_rejected_with_a_useful_message(kwargs: dict, fragments: list[str]) -> None:
    with pytest.raises(InvalidInputError) as info:
        estimate_from_counts(**kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message


def test_invalid_input_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        estimate_from_counts(parameters=1, batch_size=-3)


def test_arguments_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        estimate_from_counts(10)  # type: ignore[misc]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_frozen_weights_under_mixed_precision_count_as_the_trace_does(precision: str) -> None:
    """Autocast keeps weights in fp32: a frozen base (LoRA) is 4 B per parameter, as memfit's trace counts it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(8)])
    for layer in list(model)[:-1]:
        layer.weight.requires_grad_(False)
    traced = memfit.estimate(model, torch.randn(2, 64), precision=precision, optimizer="sgd",
                             target=memfit.Target("cpu"), loss_fn=lambda out, batch: out.float().sum())  # fmt: skip
    counted = memfit.estimate_from_counts(parameters=8 * 64 * 64, precision=precision, trainable_fraction=1 / 8)
    # the trace's fp32 weights: the frozen ones, and the trainable ones the formula calls master weights
    half_working_copies = counted.trainable_parameters * 2
    fp32_weights = counted.parameters_bytes - half_working_copies + counted.master_weights_bytes
    assert fp32_weights == traced.breakdown[memfit.Category.PARAMETERS]


def test_quantizing_a_model_whose_every_parameter_trains_is_refused() -> None:
    """bitsandbytes' quantized weights are frozen: quantized full fine-tuning is not a thing to estimate."""
    with pytest.raises(InvalidInputError, match=r"cannot train quantized weights.*trainable_parameters="):
        estimate_from_counts(parameters=7_000_000_000, quantize="nf4")


def test_a_quantized_model_served_is_its_packed_weights_as_bitsandbytes_packs_them() -> None:
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as F

    weight = torch.randn(96, 256)
    packed, state = F.quantize_4bit(weight, compress_statistics=False, quant_type="nf4")
    real = sum(t.numel() * t.element_size() for t in (packed, state.absmax, state.code))
    served = estimate_from_counts(parameters=weight.numel(), quantize="nf4", double_quant=False, trainable_fraction=0)
    assert served.quantized_weights_bytes == real and served.total_bytes == real
    nothing = estimate_from_counts(parameters=100, trainable_fraction=0.5, quantize="nf4", quantized_parameters=0)
    assert nothing.quantized_weights_bytes == 0  # no code books for no quantized weight


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_count_never_needs_less_state_than_a_smaller_one(optimizer: str) -> None:
    """The state grows with the trainable count whatever the optimizer: a part of a model never needs more than
    the whole. Checked at every count around bitsandbytes' min_8bit_size and its blocks, where a count read as
    one tensor drops from 32-bit to 8-bit states."""
    counts = [*range(0, 600), *range(3500, 4700), *range(8000, 8400), 10**6, 10**9]
    states = [estimate_from_counts(parameters=n, optimizer=optimizer).optimizer_state_bytes for n in counts]
    assert states == sorted(states), optimizer


def test_8bit_state_of_a_count_reads_small_tensors_then_large_ones() -> None:
    """Without tensor sizes: under 4096 elements every tensor is small (fp32 states, exact); above, 4095 elements
    are read as small tensors and the rest as large ones, which is within 24 KiB of a model of large tensors."""
    under = estimate_from_counts(parameters=4095, optimizer="adam-8bit")
    assert under.optimizer_state_bytes == 8 * 4095
    assert (
        under.optimizer_state_bytes
        == estimate_from_counts(parameters=4095, optimizer="adam-8bit", trainable_sizes=[4095]).optimizer_state_bytes
    )
    big = 7 * 10**6
    counted = estimate_from_counts(parameters=big, optimizer="adam-8bit").optimizer_state_bytes
    large_tensors = estimate_from_counts(
        parameters=big, optimizer="adam-8bit", trainable_sizes=[10**6] * 7
    ).optimizer_state_bytes
    assert 0 < counted - large_tensors <= 6 * 4095 + 8 * 2


def test_8bit_optimizer_state_is_what_bitsandbytes_allocates() -> None:
    """bitsandbytes' AdamW8bit, stepped for real: fp32 states under 4096 elements, 8-bit states with block scales
    and shared code books from 4096 up."""
    bnb = pytest.importorskip("bitsandbytes")
    model = nn.Sequential(nn.Linear(64, 16), nn.Linear(16, 512), nn.Linear(512, 24))  # 1024, 8192, 12288 elements
    sizes = [p.numel() for p in model.parameters()]
    optimizer = bnb.optim.AdamW8bit(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    state = {id(t): t for entry in optimizer.state.values() for t in entry.values() if isinstance(t, torch.Tensor)}
    real = sum(t.numel() * t.element_size() for t in state.values())
    formula = estimate_from_counts(parameters=sum(sizes), optimizer="adam-8bit", trainable_sizes=sizes)
    assert formula.optimizer_state_bytes == real
    small = estimate_from_counts(parameters=1024, optimizer="adam-8bit", precision="bf16")
    assert small.optimizer_state_bytes == 8 * 1024  # fp32 states, whatever the weights' precision
    with pytest.raises(InvalidInputError, match="trainable_sizes add up to 10"):
        estimate_from_counts(parameters=100, optimizer="adam-8bit", trainable_sizes=[4, 6])


def test_counted_adapters_report_the_share_they_are_not_the_unset_fraction(capsys: pytest.CaptureFixture) -> None:
    """QLoRA counted from a config: 21M adapters of 8B parameters is a share of about 0.26 %, in the object and in
    the command line's JSON (about 1 % for BERT-base at r8), not the 1.0 an unset ``trainable_fraction`` would read."""
    from memfit.cli.main import main

    counted = estimate_from_counts(parameters=8_000_000, trainable_parameters=20_000, quantize="nf4")
    assert counted.trainable_fraction == pytest.approx(0.0025)
    assert counted.to_dict()["trainable_fraction"] == pytest.approx(0.0025)
    assert main(["estimate", "--hf-config", "bert-base", "--lora-r", "8", "--quantize", "nf4", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["trainable_fraction"] == pytest.approx(answer["trainable_parameters"] / answer["parameters"])
    assert 0 < answer["trainable_fraction"] < 0.05  # LoRA r8 on every linear layer of BERT-base: about 1 %
