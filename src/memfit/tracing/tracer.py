"""Run real training steps of a user's model on fake tensors and log their memory.

One trace = two steps (forward, loss, backward, optimizer step, ``zero_grad``) at one batch size.
Two steps because optimizers create their state lazily in the first ``step()``; the second step is
the one every later step repeats.

When gradients are freed decides what the second forward carries. ``zero_grad="after_step"``
frees them after ``optimizer.step()`` (Hugging Face Trainer, most hand-written loops); Lightning's
automatic optimization calls ``zero_grad`` between ``training_step`` and ``backward``
(``"before_backward"``), so every forward runs with the last step's gradients alive. ``"in_place"`` is
``zero_grad(set_to_none=False)``, torch's default before 2.0: gradients are zeroed, never freed. With gradient
accumulation the second step stands for a later micro batch of a window: forward and backward
with the window's gradients alive, then the optimizer step.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from memfit.categories import Category, Phase
from memfit.devices import backend_for
from memfit.errors import InvalidInputError, MemfitError, TraceError, ValueDependentError
from memfit.precision import Precision
from memfit.simulation.runtime import CudaRuntime
from memfit.tracing.batch import Sample, call_model, describe, rebatch, sequence_length
from memfit.tracing.blocks import BlockContext, tensor_blocks
from memfit.tracing.checkpointing import CheckpointTarget, enable_checkpointing, find_blocks
from memfit.tracing.cuda_reductions import GridLimits
from memfit.tracing.cuda_scratch import CudaTarget
from memfit.tracing.cuda_semantics import CudaSemantics
from memfit.tracing.cudnn_rnn import CudnnRNNs, flatten_rnn_weights
from memfit.tracing.ddp import DDPConfig
from memfit.tracing.known_masks import eager_mask_skip, holds_only_ones
from memfit.tracing.model_state import (
    compilation_suspended,
    cudnn_rnn_disabled,
    has_compiled_modules,
    module_path_tracker,
    onednn_disabled,
    preserved_module_state,
    preserved_rng_state,
    swap_tensors_in,
)
from memfit.tracing.optimizers import OptimizerSpec, build_optimizer, stepping
from memfit.tracing.packed_sequences import eager_packing_check
from memfit.tracing.paged import PagedState, page_optimizer_state
from memfit.tracing.quantized import (
    bind_quantized_modules,
    bitsandbytes_kernels,
    fake_quantized_parameter,
    is_quantized_parameter,
    refuse_unsupported_quantization,
)
from memfit.tracing.rebinding import rebound
from memfit.tracing.recorder import StorageRecorder, symbolic_decompositions

__all__ = ["ZERO_GRAD_ORDERS", "StepTrace", "TraceSettings", "ZeroGrad", "trace_steps"]

ZeroGrad = Literal["after_step", "before_backward", "in_place"]
ZERO_GRAD_ORDERS: tuple[ZeroGrad, ...] = ("after_step", "before_backward", "in_place")

LossFn = Callable[[Any, Any], torch.Tensor]
ForwardFn = Callable[[nn.Module, Any], Any]

_VALUE_ERRORS = (DataDependentOutputException, DynamicOutputShapeException)
STEPS = 2


@dataclass(frozen=True)
class TraceSettings:
    """Everything about the step except the batch.

    ``target`` is the device whose memory is predicted; ``device`` the one the fake tensors live on
    (CPU when a CPU-only torch traces for CUDA, with ``emulate_cuda`` set).
    """

    target: torch.device
    device: torch.device
    emulate_cuda: bool
    precision: Precision
    optimizer: OptimizerSpec
    optimizer_kwargs: dict[str, Any] | None
    gradient_checkpointing: bool
    checkpoint_modules: CheckpointTarget | None
    loss_fn: LossFn | None
    forward_fn: ForwardFn | None
    workspace_bytes: int
    runtime: CudaRuntime
    inference: bool = False
    zero_grad: ZeroGrad = "after_step"
    accumulation_steps: int = 1
    ddp: DDPConfig | None = None
    extra_batches: int = 0
    compile_paths: bool = False  # take the branch models keep for torch.compile (see ``compile_paths``)
    record_blocks: bool = False  # log which repeated block each event is in (``memfit.tracing.depth``)
    # floating parameters and inputs in this dtype whatever ``precision`` keeps (FSDP's MixedPrecisionPolicy
    # param_dtype: the step computes on 16-bit copies of fp32 shards, under autocast or not)
    parameter_dtype: torch.dtype | None = None

    @property
    def targets_cuda(self) -> bool:
        return self.target.type == "cuda"


@dataclass
class StepTrace:
    """The storage log of one trace plus what the tracer learnt on the way."""

    batch_size: int
    recorder: StorageRecorder
    checkpointing: str | None
    substitutions: dict[str, int]
    ops: int
    compiled: bool = False  # the model holds torch.compile'd modules, traced eagerly
    paged: PagedState | None = None  # a paged optimizer's state in CUDA unified memory, outside the trace
    blocks: int = 0  # repeated blocks whose events the log tells apart (``TraceSettings.record_blocks``)
    seq_len: int | None = None  # the sample's sequence length, where it has one (``symbolic.sequence_length``)


@contextlib.contextmanager
def fake_tensor_errors_unlogged() -> Iterator[None]:
    """Keep torch's fake-tensor module from logging a traceback for an op that fails on fake tensors:
    the error reaches memfit, which says in one line what failed and where (``TraceError``)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    previous = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(previous)


def trace_steps(
    model: nn.Module,
    sample: Sample,
    sample_batch: int,
    batch_size: int,
    settings: TraceSettings,
    *,
    steps: int = STEPS,
    fake_mode: FakeTensorMode | None = None,
    sequence: tuple[int, Any] | None = None,
) -> StepTrace:
    """Trace ``steps`` training steps of ``model`` at ``batch_size`` and return the storage log.

    ``sample`` is a real (or meta) batch of ``sample_batch`` samples, or a callable
    ``batch_size -> batch``; only its shapes and dtypes are used. ``fake_mode`` (one with a shape
    environment) and a ``SymInt`` ``batch_size`` trace the step with the batch symbolic
    (``memfit.tracing.symbolic``); ``sequence`` ``(length, SymInt)`` makes every dimension 1 of the sample of that
    length symbolic too.
    """
    refuse_unsupported_quantization(model)
    fake_mode = fake_mode or FakeTensorMode(allow_non_fake_inputs=True)
    recorder = _recorder(settings, symbolic=fake_mode.shape_env is not None)
    semantics = _emulated_kernels(settings)
    if callable(sample) and not isinstance(sample, (torch.Tensor, dict, list, tuple)):
        sample = _call_sample_factory(sample, batch_size)
        sample_batch = batch_size

    # oneDNN's RNN kernels return a workspace whose size fake tensors cannot know (their fake kernel
    # says 0 bytes); with oneDNN off, RNNs decompose into ops whose saved tensors are all visible.
    branch = compile_paths() if settings.compile_paths else contextlib.nullcontext()
    # on fake CUDA tensors, RNNs run as cuDNN runs them (on fake CPU tensors ``semantics`` does that)
    lstms = CudnnRNNs() if settings.device.type == "cuda" else None
    compiled = has_compiled_modules(model)
    with (
        preserved_module_state(model),
        preserved_rng_state(),
        onednn_disabled(),
        lstms if lstms is not None else contextlib.nullcontext(),
        cudnn_rnn_disabled(model, lambda: lstms.calls)
        if lstms is not None
        else contextlib.nullcontext({}) as rnn_calls,
        fake_tensor_errors_unlogged(),
        branch,
        eager_packing_check(recorder.positions),
        eager_mask_skip(recorder.ones),
        compilation_suspended(model) as model,
    ):
        if settings.inference:
            inference = _trace_inference(
                model, sample, sample_batch, batch_size, settings, recorder, semantics, fake_mode, sequence
            )
            inference.compiled = compiled
            inference.substitutions.update(rnn_calls)
            return inference
        model.train()
        checkpointing = _checkpointing(model, settings, semantics, lstms)
        paths = module_path_tracker(model)
        paths.foreign_tensor_types = _foreign_tensor_types(model)
        blocks = _repeated_blocks(model, recorder) if settings.record_blocks else []
        with fake_mode, recorder, bitsandbytes_kernels(model), paths, _block_context(blocks, recorder):
            fakes = _swap_in_fakes(model, settings, recorder, tensor_blocks(blocks))
            if settings.targets_cuda:
                flatten_rnn_weights(model, lambda flat: recorder.track(flat, Category.PARAMETERS))
            trainable = [p for p in _unique(fakes.values()) if isinstance(p, nn.Parameter) and p.requires_grad]

            def fake_batch() -> Any:
                return rebatch(
                    sample,
                    sample_batch,
                    batch_size,
                    lambda t, shape: _fake_input(t, _sequenced(shape, sequence), settings, recorder),
                )

            batch = fake_batch()
            # Batches the loop holds besides the step's (a recovery that can replay the window), whole steps long.
            held = [fake_batch() for _ in range(settings.extra_batches)]
            optimizer = _build_optimizer(settings, fakes, trainable)
            paged = page_optimizer_state(optimizer, recorder) if settings.targets_cuda else None
            buckets = _DDPBuckets(settings.ddp, trainable, recorder) if settings.ddp else None
            for step in range(1, steps + 1):
                on_forward = buckets.rebuild if buckets is not None and step == 2 else None
                with warnings.catch_warnings():  # the model's own warnings, with fake sizes: the real run gives them
                    warnings.simplefilter("ignore")
                    _one_step(model, _own_container(batch), step, optimizer, trainable, settings, recorder,
                              semantics, paths, on_forward)  # fmt: skip
            recorder.close()
            del held
        if settings.ddp is not None and settings.ddp.gradient_as_bucket_view:
            recorder.free_on_allocation(Category.GRADIENTS)
    return StepTrace(
        batch_size=batch_size,
        recorder=recorder,
        checkpointing=checkpointing,
        substitutions={**(semantics.substitutions if semantics else {}), **rnn_calls},
        ops=recorder.ops,
        compiled=compiled,
        paged=paged,
        blocks=len(blocks),
        seq_len=sequence_length(sample, sample_batch),
    )


def _recorder(settings: TraceSettings, *, symbolic: bool) -> StorageRecorder:
    """The log the step is recorded into, with the target's cuBLAS workspace and kernel launch limits; a
    symbolic trace decomposes the ops whose fake kernels cannot take a symbolic size."""
    recorder = StorageRecorder(
        workspace_bytes=settings.workspace_bytes if settings.targets_cuda else 0,
        cuda_target=CudaTarget(
            settings.runtime.compute_capability,
            GridLimits(settings.runtime.multiprocessors, settings.runtime.max_threads_per_multiprocessor),
        ),
    )
    if symbolic:
        recorder.decompositions = symbolic_decompositions()
    return recorder


def _checkpointing(
    model: nn.Module, settings: TraceSettings, semantics: CudaSemantics | None, lstms: CudnnRNNs | None
) -> str | None:
    """Turn on the checkpointing asked for, and say which runs (``None``: none)."""
    already_on = _hf_checkpointing_on(model)
    if settings.gradient_checkpointing or (already_on and semantics is not None):
        # Emulated CUDA semantics must reach checkpointing's recomputation, so a model that
        # already checkpoints gets its checkpoint function re-wired for the trace.
        recompute = semantics.recomputation if semantics is not None else lstms.again if lstms is not None else None
        return enable_checkpointing(model, settings.checkpoint_modules, recompute_context=recompute)
    if already_on:
        return "the model's own checkpointing, as configured"
    return None


def _emulated_kernels(settings: TraceSettings) -> Any:
    """The target's kernels on fake CPU tensors, as its backend substitutes them (``memfit.devices``); ``None`` when
    the trace runs on the target's own fake tensors."""
    if not settings.emulate_cuda:
        return None
    autocast_dtype = settings.precision.compute_dtype if settings.precision.is_mixed else None
    return backend_for(settings.target).kernel_semantics(autocast_dtype, settings.runtime)


def _sequenced(shape: tuple, sequence: tuple[int, Any] | None) -> tuple:
    """``shape`` with its dimension 1 made the symbolic sequence length, where it is that length."""
    if sequence is None or len(shape) < 2 or shape[1] != sequence[0]:
        return shape
    return (shape[0], sequence[1], *shape[2:])


def _repeated_blocks(model: nn.Module, recorder: StorageRecorder) -> list[nn.Module]:
    """The model's longest run of identical blocks, with the recorder set to log which one each event is in."""
    try:
        blocks = find_blocks(model)
    except InvalidInputError:
        return []
    recorder.record_blocks()
    return blocks


def _block_context(blocks: list[nn.Module], recorder: StorageRecorder) -> contextlib.AbstractContextManager[Any]:
    return BlockContext(blocks, recorder) if blocks else contextlib.nullcontext()


def _trace_inference(
    model: nn.Module,
    sample: Sample,
    sample_batch: int,
    batch_size: int,
    settings: TraceSettings,
    recorder: StorageRecorder,
    semantics: CudaSemantics | None,
    fake_mode: FakeTensorMode,
    sequence: tuple[int, Any] | None = None,
) -> StepTrace:
    """One forward in eval mode under ``no_grad``; what it returns (logits, a KV cache) stays alive to
    the end, as a caller holding the outputs would keep it."""
    model.eval()
    paths = module_path_tracker(model)
    paths.foreign_tensor_types = _foreign_tensor_types(model)
    blocks = _repeated_blocks(model, recorder) if settings.record_blocks else []
    with fake_mode, recorder, bitsandbytes_kernels(model), paths, _block_context(blocks, recorder), torch.no_grad():
        _swap_in_fakes(model, settings, recorder, tensor_blocks(blocks))
        if settings.targets_cuda:
            flatten_rnn_weights(model, lambda flat: recorder.track(flat, Category.PARAMETERS))

        def fake_batch() -> Any:
            batch = rebatch(
                sample,
                sample_batch,
                batch_size,
                lambda t, shape: _fake_input(t, _sequenced(shape, sequence), settings, recorder),
            )
            if isinstance(batch, dict) and settings.forward_fn is None:
                batch = {k: v for k, v in batch.items() if k != "labels"}  # serving computes no loss
            return batch

        batch = fake_batch()
        held = [fake_batch() for _ in range(settings.extra_batches)]  # a loader reading ahead, say
        recorder.mark(1, Phase.FORWARD)
        with _autocast(settings, semantics), _failure("forward", model, batch, paths):
            output = settings.forward_fn(model, batch) if settings.forward_fn else call_model(model, batch)
            recorder.current_block = None
        recorder.settle_unclassified(Category.ACTIVATIONS, phase_index=0)
        recorder.close()
        del output, held
    return StepTrace(batch_size, recorder, None, dict(semantics.substitutions) if semantics else {}, recorder.ops,
                     blocks=len(blocks), seq_len=sequence_length(sample, sample_batch))  # fmt: skip


def _own_container(batch: Any) -> Any:
    """The batch in a container of its own for one step, holding the same tensors: a loop hands each step a new
    batch, so a step that takes something out of it (``batch.pop("idx")``) must not change the next step's."""
    return copy.copy(batch) if isinstance(batch, (MutableMapping, list)) else batch


def _one_step(
    model: nn.Module,
    batch: Any,
    step: int,
    optimizer: torch.optim.Optimizer | None,
    trainable: Sequence[torch.Tensor],
    settings: TraceSettings,
    recorder: StorageRecorder,
    semantics: CudaSemantics | None,
    paths: module_path_tracker,
    on_forward: Callable[[], None] | None = None,
) -> None:
    # With accumulation, step 1 keeps its gradients (its optimizer step only creates the state, as
    # earlier windows would have) and step 2 stands for a later micro batch: forward and backward with
    # the window's gradients alive, zeroed after the optimizer step. Without, they are freed where the
    # loop's zero_grad is.
    accumulating = settings.accumulation_steps > 1
    recorder.mark(step, Phase.FORWARD)
    forward_index = len(recorder.marks) - 1
    if on_forward is not None:
        on_forward()
    with _autocast(settings, semantics), _failure("forward", model, batch, paths):
        output = settings.forward_fn(model, batch) if settings.forward_fn else call_model(model, batch)
        recorder.current_block = None  # the model's call returned: the loop's own work is no block's
    with _autocast(settings, semantics), _failure("loss", model, batch, paths):
        loss = _loss_of(output, batch, settings.loss_fn)
    del output
    recorder.settle_unclassified(Category.ACTIVATIONS, phase_index=forward_index)
    if settings.zero_grad == "before_backward" and not accumulating:
        _zero_grad(trainable)

    recorder.mark(step, Phase.BACKWARD)
    with _failure("backward", model, batch, paths):
        loss.backward()
    recorder.current_block = None  # a first block whose input needs no gradient never says its backward ended
    del loss
    for param in trainable:
        if param.grad is not None:
            recorder.track(param.grad, Category.GRADIENTS)
            recorder.claim(param.grad, param)

    recorder.mark(step, Phase.OPTIMIZER)
    with _failure("optimizer step", model, batch, paths):
        if optimizer is not None:
            with stepping(optimizer):  # the step-size reads some optimizers make (Adafactor), answered
                optimizer.step()
            for param, state in optimizer.state.items():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        recorder.track(value, Category.OPTIMIZER_STATE)
                        if isinstance(param, torch.Tensor):
                            recorder.claim(value, param)
    if (settings.zero_grad in ("after_step", "in_place") and not accumulating) or (accumulating and step > 1):
        _zero_grad(trainable, in_place=settings.zero_grad == "in_place")


def _zero_grad(trainable: Sequence[torch.Tensor], in_place: bool = False) -> None:
    for param in trainable:
        if not in_place:
            param.grad = None  # zero_grad(set_to_none=True), the default in torch, Lightning and HF
        elif param.grad is not None:
            # zero_grad(set_to_none=False), torch's default before 2.0: the gradients are never freed, so
            # the next forward runs with them alive and the backward accumulates into them
            param.grad.zero_()


class _DDPBuckets:
    """DDP's gradient buckets in the trace: allocated with the wrapper, rebuilt at the second forward."""

    def __init__(self, config: DDPConfig, trainable: Sequence[torch.Tensor], recorder: StorageRecorder) -> None:
        self._config, self._trainable, self._recorder = config, trainable, recorder
        self._held = [recorder.allocate_untracked(size, Category.GRADIENT_BUCKETS) for size in
                      config.initial_bucket_bytes(trainable)]  # fmt: skip

    def rebuild(self) -> None:
        sizes = self._config.rebuilt_bucket_bytes(self._trainable)
        if sizes is None:
            return
        for sid in self._held:  # DDP frees the old buckets before it allocates the new ones
            self._recorder.free_untracked(sid)
        self._held = [self._recorder.allocate_untracked(size, Category.GRADIENT_BUCKETS) for size in sizes]


@contextlib.contextmanager
def _autocast(settings: TraceSettings, semantics: CudaSemantics | None) -> Iterator[None]:
    """Autocast for the forward: emulated CUDA lists, or the real thing on the traced device."""
    if not settings.precision.is_mixed:
        with semantics if semantics is not None else contextlib.nullcontext():
            yield
        return
    if semantics is not None:
        semantics.autocast_active = True
        semantics.cache_casts = True
        try:
            with semantics:
                yield
        finally:
            semantics.autocast_active = False
            semantics.cache_casts = False
            semantics.clear_cast_cache()
        return
    with torch.autocast(settings.device.type, dtype=settings.precision.compute_dtype):
        yield


def has_compile_paths() -> bool:
    """Whether ``compile_paths`` can change anything: transformers' ``is_torchdynamo_compiling`` is loaded."""
    return "transformers.utils.import_utils" in sys.modules


@contextlib.contextmanager
def compile_paths() -> Iterator[None]:
    """Make transformers' ``is_torchdynamo_compiling()`` true wherever it is bound.

    transformers 4.x guards the data checks in its models' forwards with it (BERT's "is the
    attention mask all ones?", say), as torch.compile cannot trace them either; the branch it takes
    then reads no values (it builds the mask), so fake tensors can trace it. Only transformers'
    own function is replaced, in every module that imported it: torch's behaviour is untouched.
    """
    import_utils = sys.modules.get("transformers.utils.import_utils")
    original = getattr(import_utils, "is_torchdynamo_compiling", None)
    if original is None:
        yield
        return
    with rebound("is_torchdynamo_compiling", original, _compiling):
        yield


def _compiling() -> bool:
    return True


@contextlib.contextmanager
def _failure(stage: str, model: nn.Module, batch: Any, paths: module_path_tracker) -> Iterator[None]:
    """Turn whatever the user's code raises under fake tensors into a memfit error that says what to do."""
    try:
        yield
    except MemfitError:  # already says what is wrong (memfit's own forward functions raise these)
        raise
    except _VALUE_ERRORS as exc:
        where = f" in module `{paths.current}`" if paths.current else ""
        raise ValueDependentError(
            f"the {stage} of {type(model).__name__} reads tensor values{where} ({_op_of(exc)}), but memfit "
            "traces with fake tensors that have shapes and no values. Make that code path value-free "
            "(e.g. skip data checks when torch.compiler.is_compiling() or under a flag), pass a forward_fn/"
            "loss_fn that avoids it, or use memfit.estimate_from_counts() for a formula estimate."
        ) from exc
    except UnsupportedOperatorException as exc:
        where = f" in module `{paths.current}`" if paths.current else ""
        raise TraceError(
            f"the {stage} of {type(model).__name__} uses an operator fake tensors cannot run{where} "
            f"({_op_of(exc)}); use memfit.estimate_from_counts() for a formula estimate."
        ) from exc
    except Exception as exc:
        where = f" in module `{paths.current}`" if paths.current and stage == "forward" else ""
        foreign, message = paths.foreign_tensor_types, str(exc)
        if "Tensor subclass" in message or (foreign and "FakeTensor" in message):
            # the model's own tensors (subclasses that fake tensors cannot stand in for), not the sample
            kinds = ", ".join(foreign) or "a tensor subclass"
            raise TraceError(
                f"the {stage} of {type(model).__name__} failed{where}: {type(exc).__name__}: {str(exc).strip()}. "
                f"The model holds {kinds}, which fake tensors cannot stand in for; use `memfit estimate` or "
                "memfit.estimate_from_counts() for a formula estimate."
            ) from exc
        hint = {
            "forward": f"check that the sample matches what the model expects (got {describe(batch)}); "
            "pass forward_fn=lambda model, batch: ... if the model is called another way",
            "loss": "pass loss_fn=lambda output, batch: <scalar loss>",
            "backward": "check that the loss depends on parameters that require grad",
            "optimizer step": "check the optimizer and its arguments",
        }[stage]
        detail = str(exc).strip().rstrip(".")
        raise TraceError(
            f"the {stage} of {type(model).__name__} failed{where}: {type(exc).__name__}: {detail}. {hint}."
        ) from exc


def _foreign_tensor_types(model: nn.Module) -> list[str]:
    """Names of the parameter and buffer classes of ``model`` that the trace has no stand-in for."""
    kinds = {
        type(t).__name__
        for t in [*model.parameters(), *model.buffers()]
        if type(t) not in (torch.Tensor, nn.Parameter) and not is_quantized_parameter(t)
    }
    return sorted(kinds)


def _op_of(exc: Exception) -> str:
    func = getattr(exc, "func", None)
    return str(func) if func is not None else type(exc).__name__


def _loss_of(output: Any, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    loss = loss_fn(output, batch) if loss_fn is not None else _builtin_loss(output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TraceError(
            f"the loss must be a scalar tensor, got {shape}; pass loss_fn=lambda output, batch: <scalar loss>"
        )
    if not loss.requires_grad:
        raise TraceError(
            "the loss does not require grad: no parameter of the model is trainable, or the loss is "
            "detached from the output; check requires_grad on the parameters"
        )
    return loss


def _builtin_loss(output: Any) -> torch.Tensor:
    """A loss the model computed itself: ``output.loss`` (Hugging Face), ``output["loss"]``, a scalar."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        loss = output[0] if output[0].numel() == 1 else None
    if loss is None and isinstance(output, torch.Tensor) and output.numel() == 1:
        loss = output
    if loss is None:
        what = f"a tensor of shape {list(output.shape)}" if isinstance(output, torch.Tensor) else type(output).__name__
        raise TraceError(
            f"the model returned {what}, not a loss; pass loss_fn=lambda output, batch: <scalar loss> "
            "(for Hugging Face models, include labels in the sample)"
        )
    return loss


def _swap_in_fakes(
    model: nn.Module, settings: TraceSettings, recorder: StorageRecorder, blocks: Mapping[int, int] | None = None
) -> dict[int, Any]:
    """Stand fake tensors in for the model's parameters and buffers (and bitsandbytes' quantization state).
    ``blocks`` (``id(tensor) -> block``) says which repeated block each tensor's fakes belong to.

    A failure here is about the model's own tensors, never the sample, and says so.
    """
    states: dict[int, torch.Tensor] = {}  # quantization-state tensors shared between weights stay shared

    def make_state(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in states:
            fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=settings.device)
            recorder.track(fake, Category.PARAMETERS)  # part of the frozen quantized weight
            states[id(tensor)] = fake
        return states[id(tensor)]

    def make(tensor: torch.Tensor, is_param: bool) -> Any:
        recorder.current_block = blocks.get(id(tensor)) if blocks else None
        fake = _fake_like(tensor, is_param, settings, recorder)
        return fake_quantized_parameter(tensor, fake, make_state) if is_param else fake

    try:
        fakes = swap_tensors_in(model, make)
        recorder.current_block = None
        bind_quantized_modules(model, make_state)
    except MemfitError:
        raise
    except Exception as exc:
        raise TraceError(
            f"memfit could not stand fake tensors in for the parameters and buffers of {type(model).__name__}: "
            f"{type(exc).__name__}: {exc}. It traces plain tensors and bitsandbytes weights; use `memfit estimate` "
            "or memfit.estimate_from_counts() for a formula estimate"
        ) from exc
    return fakes


def _fake_like(tensor: torch.Tensor, is_param: bool, settings: TraceSettings, recorder: StorageRecorder) -> Any:
    dtype = tensor.dtype
    if tensor.is_floating_point() and settings.precision.converts_to_half and not is_quantized_parameter(tensor):
        dtype = settings.precision.parameter_dtype  # Lightning's "*-true" converts the module
    elif is_param and tensor.is_floating_point() and settings.parameter_dtype and not is_quantized_parameter(tensor):
        dtype = settings.parameter_dtype  # FSDP's MixedPrecisionPolicy: parameters only, buffers stay
    fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=dtype, device=settings.device)
    if is_param:
        fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
    recorder.track(fake, Category.PARAMETERS if is_param else Category.BUFFERS)
    return fake


def _fake_input(tensor: torch.Tensor, shape: tuple, settings: TraceSettings, recorder: StorageRecorder) -> torch.Tensor:
    """A fake input of ``shape``; under ``*-true`` half precision a floating one arrives cast, as the precision
    plugins' ``convert_input`` casts the batch before the step (integer ids and masks stay as they are)."""
    dtype = tensor.dtype
    if tensor.is_floating_point() and settings.precision.converts_to_half:
        dtype = settings.precision.parameter_dtype
    elif tensor.is_floating_point() and settings.parameter_dtype is not None:
        dtype = settings.parameter_dtype  # FSDP casts floating forward inputs to param_dtype
    fake = torch.empty(shape, dtype=dtype, device=settings.device)
    recorder.track(fake, Category.INPUTS)
    if holds_only_ones(tensor):  # an attention mask without padding: transformers skips it in eager (known_masks)
        recorder.ones.mark(fake)
    return fake


def _build_optimizer(
    settings: TraceSettings, fakes: dict[int, Any], trainable: list[torch.Tensor]
) -> torch.optim.Optimizer | None:
    return build_optimizer(
        settings.optimizer,
        fakes,
        trainable,
        kwargs=settings.optimizer_kwargs,
        prefer_foreach=settings.targets_cuda,
    )


def _call_sample_factory(factory: Callable[[int], Any], batch_size: int) -> Any:
    try:
        return factory(batch_size)
    except Exception as exc:
        raise InvalidInputError(
            f"the sample factory failed for batch_size={batch_size}: {type(exc).__name__}: {exc}"
        ) from exc


def _hf_checkpointing_on(model: nn.Module) -> bool:
    return any(
        getattr(m, "gradient_checkpointing", False) is True and hasattr(m, "_gradient_checkpointing_func")
        for m in model.modules()
    )


def _unique(values: Any) -> list[Any]:
    seen: set[int] = set()
    out = []
    for value in values:
        if id(value) not in seen:
            seen.add(id(value))
            out.append(value)
    return out
