"""The GPU catalog: forgiving lookups, clear errors, and the facts the estimate uses."""

from __future__ import annotations

import pytest

from memfit import InvalidInputError
from memfit.planning.capacity import parse_budget
from memfit.planning.gpus import gpu_by_name, known_gpus
from memfit.units import MiB

REQUIRED = ["T4", "V100-16GB", "V100-32GB", "A10G", "L4", "RTX3090", "RTX4090", "RTX5090", "A100-40GB",
            "A100-80GB", "L40S", "H100", "H200", "B200", "MI300X", "M3-Max-128GB", "M2-Ultra-192GB"]  # fmt: skip


def test_catalog_covers_the_common_training_gpus() -> None:
    assert {gpu.name for gpu in known_gpus()} >= set(REQUIRED)


@pytest.mark.parametrize(
    ("spelling", "name"),
    [
        ("h100", "H100"),
        ("H100-80GB", "H100"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("rtx 4090", "RTX4090"),
        ("GeForce RTX 3090", "RTX3090"),
        ("a100 80gb", "A100-80GB"),
        ("A100-SXM4-40GB", "A100-40GB"),
        ("mi300x", "MI300X"),
        ("m3 max", "M3-Max-128GB"),
    ],
)
def test_lookup_forgives_case_and_spelling(spelling: str, name: str) -> None:
    assert gpu_by_name(spelling).name == name


def test_ambiguous_and_unknown_names_list_the_candidates() -> None:
    with pytest.raises(InvalidInputError, match="ambiguous: A100-40GB, A100-80GB"):
        gpu_by_name("a100")
    with pytest.raises(InvalidInputError, match="did you mean H100, H200"):
        gpu_by_name("h1000")


def test_facts_that_change_the_estimate() -> None:
    h100, t4, apple = gpu_by_name("h100"), gpu_by_name("t4"), gpu_by_name("m2 ultra")
    assert h100.memory_bytes == 81559 * MiB and h100.bf16 and h100.fp8
    assert h100.cublas_workspace_bytes == 32 * MiB
    assert t4.cublas_workspace_bytes == 8 * MiB + 128 * 1024 and not t4.bf16
    assert apple.approximate and not h100.approximate
    assert parse_budget("h200") == gpu_by_name("H200").memory_bytes


def test_the_precision_a_card_is_planned_in() -> None:
    """The catalog's bf16 flag decides the default and refuses bf16 where the card has none."""
    from memfit import Precision

    h100, t4, v100 = gpu_by_name("h100"), gpu_by_name("t4"), gpu_by_name("v100-32gb")
    assert h100.precision_for(None) is Precision.BF16_MIXED
    assert h100.precision_for(None, inference=True) is Precision.BF16_TRUE
    for card in (t4, v100):
        assert card.precision_for(None) is Precision.FP16_MIXED
        assert card.precision_for(None, inference=True) is Precision.FP16_TRUE
        assert card.precision_for("fp32") is Precision.FP32 and card.precision_for("16-mixed") is Precision.FP16_MIXED
    with pytest.raises(InvalidInputError, match=r"T4 \(Turing\) has no bf16.*`precision` 16-mixed"):
        t4.precision_for("bf16-mixed")
    with pytest.raises(InvalidInputError, match=r"V100-32GB \(Volta\) has no bf16.*`precision` 16-true"):
        v100.precision_for("bf16")
