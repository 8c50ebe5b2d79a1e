"""Behaviour of memfit.estimate: what it reports, what it accepts, and that the model is left alone."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
import zoo
from memfit import Category, Phase
from memfit.integrations.huggingface.arguments import model_checkpointing
from memfit.simulation.allocator import round_size
from memfit.simulation.runtime import cublas_workspace_bytes


def _param_bytes(model: nn.Module, element_size: int | None = None) -> int:
    return sum(p.numel() * (element_size or p.element_size()) for p in model.parameters())


def _phase(estimate: memfit.MemoryEstimate, step: int, phase: Phase) -> memfit.PhasePeak:
    return next(p for p in estimate.phases if p.step == step and p.phase is phase)


def _snapshot(model: nn.Module) -> dict:
    return {
        "params": [
            (name, id(p), p.detach().clone(), p.device, p.requires_grad) for name, p in model.named_parameters()
        ],
        "buffers": [(name, id(b), b.clone()) for name, b in model.named_buffers()],
        "training": [m.training for m in model.modules()],
        "hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()],
        "instance_forward": ["forward" in vars(m) for m in model.modules()],
        "dict_keys": [sorted(vars(m)) for m in model.modules()],
    }


def _assert_same(before: dict, after: dict) -> None:
    assert [(n, i, d, r) for n, i, _, d, r in before["params"]] == [(n, i, d, r) for n, i, _, d, r in after["params"]]
    for (_, _, old, _, _), (_, _, new, _, _) in zip(before["params"], after["params"], strict=True):
        assert torch.equal(old, new)
    for (_, old_id, old), (_, new_id, new) in zip(before["buffers"], after["buffers"], strict=True):
        assert old_id == new_id and torch.equal(old, new)
    for key in ("training", "hooks", "instance_forward", "dict_keys"):
        assert before[key] == after[key], key


def test_reports_a_breakdown_that_adds_up_at_the_peak() -> None:
    case = zoo.gpt2_case()
    estimate = memfit.estimate(case.model, case.batch, target=memfit.Target("cpu"))
    assert estimate.peak_allocated_bytes == sum(estimate.breakdown.values())
    assert estimate.breakdown[Category.PARAMETERS] == _param_bytes(case.model)
    assert estimate.peak_phase in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
    assert estimate.peak_reserved_bytes == estimate.peak_allocated_bytes  # no caching allocator on CPU
    assert estimate.cuda_context_bytes is None
    assert json.loads(json.dumps(estimate.to_dict()))["peak_allocated_bytes"] == estimate.peak_allocated_bytes


def test_optimizer_state_of_adamw_is_two_moments_and_a_step_counter_per_parameter() -> None:
    case = zoo.resnet_case()
    estimate = memfit.estimate(
        case.model, case.batch, target=memfit.Target("cpu"), loss_fn=case.loss_fn, forward_fn=case.forward_fn
    )
    steady = _phase(estimate, 2, Phase.OPTIMIZER)
    n_params = len(list(case.model.parameters()))
    assert steady.breakdown[Category.OPTIMIZER_STATE] == 2 * _param_bytes(case.model) + 4 * n_params


@pytest.mark.parametrize(
    ("optimizer", "kwargs", "moments"),
    [
        ("sgd", None, 0),
        ("sgd-momentum", None, 1),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 1),
        (torch.optim.Adam, None, 2),
        (None, None, 0),
    ],
)
def test_optimizer_given_by_name_class_or_none(optimizer, kwargs, moments) -> None:
    case = zoo.resnet_case()
    estimate = memfit.estimate(
        case.model,
        case.batch,
        target=memfit.Target("cpu"),
        optimizer=optimizer,
        optimizer_kwargs=kwargs,
        loss_fn=case.loss_fn,
        forward_fn=case.forward_fn,
    )
    state = _phase(estimate, 2, Phase.OPTIMIZER).breakdown[Category.OPTIMIZER_STATE]
    step_counters = 4 * len(list(case.model.parameters())) if moments == 2 else 0
    assert state == moments * _param_bytes(case.model) + step_counters


def test_optimizer_instance_is_rebuilt_with_its_hyperparameters_and_left_alone() -> None:
    case = zoo.resnet_case()
    frozen = case.model.head
    for p in frozen.parameters():
        p.requires_grad_(False)
    trainable = [p for p in case.model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.1, momentum=0.9)
    estimate = memfit.estimate(
        case.model,
        case.batch,
        target=memfit.Target("cpu"),
        optimizer=optimizer,
        loss_fn=case.loss_fn,
        forward_fn=case.forward_fn,
    )
    state = _phase(estimate, 2, Phase.OPTIMIZER).breakdown[Category.OPTIMIZER_STATE]
    assert state == sum(p.numel() * 4 for p in trainable)
    gradients = _phase(estimate, 2, Phase.OPTIMIZER).breakdown[Category.GRADIENTS]
    assert gradients == sum(p.numel() * 4 for p in trainable)  # frozen head: no gradient
    assert optimizer.state == {}  # the user's optimizer never stepped


def test_factory_sample_gives_the_same_estimate_as_a_batch() -> None:
    case = zoo.resnet_case(batch=4)
    from_batch = memfit.estimate(
        case.model, case.batch, target=memfit.Target("cpu"), loss_fn=case.loss_fn, forward_fn=case.forward_fn
    )
    from_factory = memfit.estimate(
        case.model,
        lambda b: (torch.randn(b, 3, 16, 16), torch.zeros(b, dtype=torch.long)),
        batch_size=4,
        target=memfit.Target("cpu"),
        loss_fn=case.loss_fn,
        forward_fn=case.forward_fn,
    )
    assert from_factory.peak_allocated_bytes == from_batch.peak_allocated_bytes


def test_model_is_left_untouched_after_tracing_with_checkpointing() -> None:
    case = zoo.gpt2_case()
    case.model.eval()
    before = _snapshot(case.model)
    memfit.estimate(case.model, case.batch, gradient_checkpointing=True)
    _assert_same(before, _snapshot(case.model))
    assert not model_checkpointing(case.model)
    plain = zoo.resnet_case()
    before = _snapshot(plain.model)
    memfit.estimate(
        plain.model,
        plain.batch,
        gradient_checkpointing=True,
        loss_fn=plain.loss_fn,
        forward_fn=plain.forward_fn,
    )
    _assert_same(before, _snapshot(plain.model))


def test_checkpointing_keeps_fewer_activations_for_hf_and_plain_models() -> None:
    case = zoo.gpt2_case(batch=4, seq=96)
    full = memfit.estimate(case.model, case.batch)
    ckpt = memfit.estimate(case.model, case.batch, gradient_checkpointing=True)
    assert ckpt.activation_bytes < 0.5 * full.activation_bytes
    assert any("own checkpointing" in note for note in ckpt.notes)

    plain = zoo.resnet_case(batch=8)
    kwargs = {"loss_fn": plain.loss_fn, "forward_fn": plain.forward_fn}
    full = memfit.estimate(plain.model, plain.batch, **kwargs)
    auto = memfit.estimate(plain.model, plain.batch, gradient_checkpointing=True, **kwargs)
    named = memfit.estimate(
        plain.model, plain.batch, gradient_checkpointing=True, checkpoint_modules=[zoo.BasicBlock], **kwargs
    )
    assert auto.activation_bytes < 0.6 * full.activation_bytes
    assert named.activation_bytes == auto.activation_bytes
    assert any("BasicBlock" in note for note in auto.notes)


def test_cuda_target_rounds_blocks_adds_workspace_and_simulates_reserved() -> None:
    case = zoo.gpt2_case()
    estimate = memfit.estimate(case.model, case.batch, target=memfit.Target("cuda"))
    assert estimate.device == "cuda"
    assert estimate.breakdown[Category.WORKSPACE] == 2 * cublas_workspace_bytes((9, 0))
    assert estimate.peak_allocated_bytes % 512 == 0
    assert estimate.peak_reserved_bytes >= estimate.peak_allocated_bytes
    assert estimate.peak_reserved_bytes % (2 * 1024**2) == 0  # segments are whole 2 MiB multiples
    assert estimate.peak_bytes == estimate.peak_reserved_bytes + estimate.cuda_context_bytes


def test_cuda_target_models_foreach_adam_temporaries() -> None:
    case = zoo.gpt2_case()
    cuda = memfit.estimate(case.model, case.batch, target=memfit.Target("cuda"))
    cpu = memfit.estimate(case.model, case.batch, target=memfit.Target("cpu"))
    # foreach AdamW (CUDA's default) holds a temporary as large as all parameters; CPU's per-parameter
    # loop holds two temporaries of the largest parameter (sqrt, then the division) at most
    assert _phase(cuda, 2, Phase.OPTIMIZER).breakdown[Category.TEMPORARIES] >= _param_bytes(case.model)
    largest = max(p.numel() * p.element_size() for p in case.model.parameters())
    assert _phase(cpu, 2, Phase.OPTIMIZER).breakdown[Category.TEMPORARIES] == 2 * largest


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only emulation of CUDA kernels")
def test_cuda_attention_and_autocast_are_substituted_on_a_cpu_only_torch() -> None:
    case = zoo.gpt2_case(batch=2, seq=128)
    fp32 = memfit.estimate(case.model, case.batch, target=memfit.Target("cuda"))
    cpu = memfit.estimate(case.model, case.batch, target=memfit.Target("cpu"))
    mixed = memfit.estimate(case.model, case.batch, target=memfit.Target("cuda"), precision="bf16-mixed")
    assert any(note.startswith("efficient_attention") for note in fp32.notes)
    assert any(note.startswith("flash_attention") for note in mixed.notes)
    # no seq x seq attention matrix on CUDA: fewer activations than CPU's math path
    assert fp32.activation_bytes < cpu.activation_bytes
    assert mixed.activation_bytes < fp32.activation_bytes
    # mixed precision keeps fp32 weights (each in its own 512-byte-rounded block on CUDA)
    fp32_blocks = sum(round_size(p.numel() * 4) for p in case.model.parameters())
    assert mixed.breakdown[Category.PARAMETERS] == fp32_blocks


def test_pure_half_precision_halves_weights() -> None:
    case = zoo.resnet_case()
    kwargs = {"target": memfit.Target("cpu"), "loss_fn": case.loss_fn, "forward_fn": case.forward_fn}
    half = memfit.estimate(case.model, case.batch, precision="bf16", **kwargs)
    assert half.breakdown[Category.PARAMETERS] == _param_bytes(case.model, element_size=2)
    assert half.precision is memfit.Precision.BF16_TRUE


class _PatchClassifier(nn.Module):
    """A ViT-style stem that feeds its input straight to a convolution, as torchvision's ViT does (``conv_proj``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_proj = nn.Conv2d(3, 16, kernel_size=8, stride=8)
        self.head = nn.Linear(16, 3)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        features = self.conv_proj(images).flatten(2).mean(-1)
        return F.cross_entropy(self.head(features), labels)


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_true_half_precision_casts_floating_inputs_as_lightning_does(precision: str, dtype: torch.dtype) -> None:
    """Lightning's and Fabric's HalfPrecision.convert_input cast a batch's floating tensors (not its ids)."""
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 0])
    half = memfit.estimate(_PatchClassifier(), (images, labels), precision=precision, target=memfit.Target("cpu"))
    assert half.breakdown[Category.INPUTS] == images.numel() * dtype.itemsize + labels.numel() * labels.element_size()

    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                       image_size=32, patch_size=8, num_labels=3)  # fmt: skip
    vit = ViTForImageClassification(config)
    batch = {"pixel_values": images, "labels": labels}
    pixels = images.numel() * dtype.itemsize
    assert memfit.estimate(vit, batch, precision=precision, target=memfit.Target("cpu")).breakdown[Category.INPUTS] == (
        pixels + labels.numel() * labels.element_size()
    )
    # autocast leaves the batch alone
    mixed = memfit.estimate(vit, batch, precision="bf16-mixed", target=memfit.Target("cpu"))
    assert mixed.breakdown[Category.INPUTS] == images.numel() * 4 + labels.numel() * labels.element_size()


def test_meta_device_model_plans_like_the_real_one() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)
    real = GPT2LMHeadModel(config)
    with torch.device("meta"):
        meta = GPT2LMHeadModel(config)
    ids = torch.zeros(2, 64, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    assert memfit.estimate(meta, batch).peak_bytes == memfit.estimate(real, batch).peak_bytes


def test_at_and_max_batch_size_agree() -> None:
    case = zoo.gpt2_case()
    curve = memfit.trace(case.model, case.batch)
    estimate = curve.estimate
    at_traced = curve.at(estimate.batch_size)
    assert estimate.peak_allocated_bytes <= at_traced.allocated_bytes <= 1.01 * estimate.peak_allocated_bytes
    assert estimate.peak_reserved_bytes <= at_traced.reserved_bytes
    capacity = curve.at(10).device_bytes
    best = curve.max_batch_size(capacity, at_limit=False)  # by the peaks at() reads, with room to spare
    assert best is not None and best >= 10
    assert curve.at(best).device_bytes <= capacity < curve.at(best + 1).device_bytes
    at_limit = curve.max_batch_size(capacity)  # the allocator may free its cache and retry: never fewer
    assert at_limit is not None and at_limit >= best
    assert curve.max_batch_size(estimate.cuda_context_bytes) is None
    assert curve.at(8).allocated_bytes > curve.at(4).allocated_bytes


@pytest.mark.parametrize("batch", [1, 4])
def test_at_the_traced_batch_is_never_below_the_traced_peaks(batch: int) -> None:
    # BERT at seq 512 gets whole-block handouts from the allocator (allocated > the tensors' own sizes),
    # which the per-phase fits in tensor bytes do not see; at() scales them back in.
    from memfit.presets import from_hf_config

    spec = from_hf_config("bert-base", seq_len=512, layers=2)
    curve = memfit.trace(spec.model, spec.sample, batch_size=batch, precision="bf16-mixed")
    estimate = curve.estimate
    top = max(estimate.phases, key=lambda p: p.allocated_bytes)
    assert top.allocated_bytes > top.tensor_bytes  # the case this guards
    at_traced = curve.at(batch)
    assert estimate.peak_allocated_bytes <= at_traced.allocated_bytes <= 1.01 * estimate.peak_allocated_bytes
    assert estimate.peak_reserved_bytes <= at_traced.reserved_bytes <= 1.01 * estimate.peak_reserved_bytes


def test_one_trace_with_the_fit_of_another_gives_the_same_peaks() -> None:
    from memfit.prediction.estimator import trace_for_runtimes
    from memfit.presets import from_hf_config

    spec = from_hf_config("bert-base", seq_len=256, layers=1)

    def traced(batch: int, fits: list[memfit.MemoryEstimate] | None = None) -> memfit.StepCurve:
        (result,) = trace_for_runtimes(spec.model, spec.sample, runtimes=[memfit.CudaRuntime()], batch_size=batch,
                                       precision="bf16-mixed", batch_fits=fits)  # fmt: skip
        return result

    base, whole = traced(1).estimate, traced(6).estimate
    once_curve = traced(6, [base])
    once = once_curve.estimate
    assert (once.peak_allocated_bytes, once.peak_reserved_bytes) == (
        whole.peak_allocated_bytes,
        whole.peak_reserved_bytes,
    )
    assert once.breakdown == whole.breakdown and once.phase_models == base.phase_models
    assert (
        once_curve.at(6).allocated_bytes >= once.peak_allocated_bytes
        and once_curve.at(6).reserved_bytes >= once.peak_reserved_bytes
    )
    with pytest.raises(memfit.InvalidInputError, match="one estimate per runtime"):
        traced(6, [base, base])


def test_value_free_loss_from_output_dict_and_tuple() -> None:
    model = nn.Linear(8, 3)

    class DictOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor) -> dict:
            return {"loss": self.inner(x).square().mean()}

    estimate = memfit.estimate(DictOut(), torch.randn(4, 8), target=memfit.Target("cpu"))
    assert estimate.peak_allocated_bytes > 0
    estimate = memfit.estimate(
        model,
        torch.randn(4, 8),
        target=memfit.Target("cpu"),
        loss_fn=lambda out, batch: F.mse_loss(out, torch.zeros_like(out)),
    )
    assert estimate.batch_size == 4


def _mlp_step(**kwargs: object) -> memfit.MemoryEstimate:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return memfit.estimate(model, torch.randn(4, 16), optimizer="sgd", loss_fn=lambda out, _b: out.sum(), **kwargs)


def test_training_loop_and_target_objects_spelled_with_keywords_give_the_same_estimate() -> None:
    by_objects = _mlp_step(
        loop=memfit.TrainingLoop(zero_grad="before_backward", accumulation_steps=2, extra_batches=1),
        target=memfit.Target("cpu"),
    )
    by_keywords = _mlp_step(
        loop=memfit.TrainingLoop(zero_grad="before_backward", accumulation_steps=2, extra_batches=1),
        target=memfit.Target(device="cpu"),
    )
    assert by_objects.to_dict() | {"trace_seconds": 0} == by_keywords.to_dict() | {"trace_seconds": 0}
    assert by_objects.loop == memfit.TrainingLoop("before_backward", 2, 1)
    assert by_objects.device == "cpu" and by_objects.accumulation_steps == 2
    assert _mlp_step().loop == memfit.TrainingLoop() and _mlp_step().device == "cuda"


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"loop": memfit.TrainingLoop(), "accumulation_steps": 2}, ["loop=", "accumulation_steps="]),
        ({"loop": memfit.TrainingLoop(), "ddp": False, "zero_grad": "after_step"}, ["loop=", "ddp=", "zero_grad="]),
        ({"target": memfit.Target("cpu"), "device": "cpu"}, ["target=", "device="]),
        ({"target": memfit.Target(), "cuda_runtime": memfit.CudaRuntime()}, ["target=", "cuda_runtime="]),
    ],
)
def test_a_setting_given_both_as_keyword_and_in_its_object_is_refused(kwargs: dict, names: list[str]) -> None:
    with pytest.raises(memfit.InvalidInputError) as error:
        _mlp_step(**kwargs)
    assert all(name in str(error.value) for name in names)


@pytest.mark.parametrize(
    ("keyword", "value", "moved"),
    [
        ("zero_grad", "before_backward", "loop=memfit.TrainingLoop(zero_grad=...)"),
        ("accumulation_steps", 2, "loop=memfit.TrainingLoop(accumulation_steps=...)"),
        ("extra_batches", 1, "loop=memfit.TrainingLoop(extra_batches=...)"),
        ("ddp", True, "loop=memfit.TrainingLoop(ddp=...)"),
        ("device", "cpu", "target=memfit.Target(device=...)"),
        ("cuda_runtime", memfit.CudaRuntime(), "target=memfit.Target(runtime=...)"),
    ],
)
def test_a_keyword_that_moved_into_the_loop_or_target_names_its_new_place(
    keyword: str, value: object, moved: str
) -> None:
    with pytest.raises(memfit.InvalidInputError) as error:
        _mlp_step(**{keyword: value})
    assert str(error.value) == f"estimate({keyword}=...) moved: pass {moved}"


def test_moved_keywords_given_together_are_named_in_one_line() -> None:
    with pytest.raises(memfit.InvalidInputError) as error:
        _mlp_step(device="cpu", accumulation_steps=2)
    assert str(error.value) == (
        "estimate(accumulation_steps=..., device=...) moved: pass loop=memfit.TrainingLoop(accumulation_steps=...), "
        "target=memfit.Target(device=...)"
    )


def test_the_settings_objects_check_their_fields_when_built() -> None:
    assert memfit.TrainingLoop(ddp=True).ddp == memfit.DDPConfig()
    assert memfit.TrainingLoop(ddp=False).ddp is None
    assert memfit.Target(torch.device("cpu")) == memfit.Target("cpu")
    with pytest.raises(memfit.InvalidInputError, match="zero_grad must be one of"):
        memfit.TrainingLoop(zero_grad="never")  # type: ignore[arg-type]
    with pytest.raises(memfit.InvalidInputError, match="extra_batches must be a non-negative integer"):
        memfit.TrainingLoop(extra_batches=-1)
    with pytest.raises(memfit.InvalidInputError, match="device must be 'cuda' or 'cpu'"):
        memfit.Target("meta")
    with pytest.raises(memfit.InvalidInputError, match="CudaRuntime"):
        memfit.Target(runtime=(9, 0))  # type: ignore[arg-type]
    with pytest.raises(memfit.InvalidInputError, match="TrainingLoop"):
        _mlp_step(loop={"accumulation_steps": 2})


def test_a_forward_only_estimate_says_so_in_its_inference_flag() -> None:
    forward = _mlp_step(inference=True, loop=memfit.TrainingLoop(accumulation_steps=4, extra_batches=1))
    training = _mlp_step()
    assert forward.inference and not training.inference
    assert forward.to_dict()["inference"] is True and forward.optimizer == "none"
    assert forward.loop == memfit.TrainingLoop(extra_batches=1)  # of the loop only the batches held apply
    memfit.evaluation_peak(training, forward)
    with pytest.raises(memfit.InvalidInputError, match="forward-only"):
        memfit.evaluation_peak(training, training)


def test_a_step_that_takes_something_out_of_its_batch_leaves_the_next_steps_batch_whole() -> None:
    """A loop hands each step a new batch; a forward that pops a key (an index it logs) sees it in both traced
    steps, and the estimate is the one without the pop."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x).sum()

    def popping(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch.pop("idx")
        return model(batch["x"])

    sample = {"x": torch.zeros(4, 8), "idx": torch.arange(4)}
    popped = memfit.estimate(Model(), sample, forward_fn=popping, target=memfit.Target("cpu"))
    reading = memfit.estimate(Model(), sample, forward_fn=lambda m, b: m(b["x"]), target=memfit.Target("cpu"))
    assert popped.peak_allocated_bytes == reading.peak_allocated_bytes
    assert set(sample) == {"x", "idx"}  # the user's own sample is untouched
