"""Run a user's module on fake tensors and hand it back exactly as it was."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from memfit.devices import registered_backends

__all__ = [
    "compilation_suspended",
    "cudnn_rnn_disabled",
    "has_compiled_modules",
    "module_path_tracker",
    "onednn_disabled",
    "preserved_module_state",
    "preserved_rng_state",
    "swap_tensors_in",
]


@contextmanager
def preserved_module_state(model: nn.Module) -> Iterator[None]:
    """Restore every submodule's attributes, parameters, buffers, hooks and training flags, and the attributes of
    the configurations they hold, on exit.

    The trace swaps parameters for fake ones, switches to train mode, may turn on checkpointing
    (which sets attributes and registers hooks); all of it must be undone, even on error.
    """
    saved: list[tuple[nn.Module, dict[str, Any], list[tuple[Any, Any]]]] = []
    configs = _configs_of(model)
    for module in model.modules():
        attributes = dict(module.__dict__)
        containers: list[tuple[Any, Any]] = []
        for value in attributes.values():
            if isinstance(value, dict):
                containers.append((value, dict(value)))
            elif isinstance(value, set):
                containers.append((value, set(value)))
        saved.append((module, attributes, containers))
    try:
        yield
    finally:
        for module, attributes, containers in saved:
            for container, content in containers:
                container.clear()
                container.update(content)
            module.__dict__.clear()
            module.__dict__.update(attributes)
        for config, attributes in configs:
            config.__dict__.clear()
            config.__dict__.update(attributes)


def _configs_of(model: nn.Module) -> list[tuple[Any, dict[str, Any]]]:
    """Each configuration object the modules hold (``module.config``, and the configs inside it), with its
    attributes: a model's forward may write to it (transformers' classification loss sets ``config.problem_type``
    on the first batch with labels), which a trace must not leave behind."""
    found: dict[int, tuple[Any, dict[str, Any]]] = {}
    pending = [module.__dict__.get("config") for module in model.modules()]
    while pending:
        config = pending.pop()
        if config is None or isinstance(config, nn.Module) or id(config) in found:
            continue
        if not callable(getattr(config, "to_dict", None)) or not hasattr(config, "__dict__"):
            continue
        found[id(config)] = (config, dict(config.__dict__))
        pending.extend(value for value in config.__dict__.values() if callable(getattr(value, "to_dict", None)))
    return list(found.values())


def _optimized_module_type() -> type | None:
    """``OptimizedModule`` if dynamo is loaded; without it nothing can have been compiled."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def has_compiled_modules(model: nn.Module) -> bool:
    """Whether ``model`` is, or holds, a ``torch.compile``'d module (a wrapper or ``module.compile()``)."""
    wrapper = _optimized_module_type()
    if wrapper is None:
        return False
    return any(isinstance(m, wrapper) or m.__dict__.get("_compiled_call_impl") is not None for m in model.modules())


@contextmanager
def compilation_suspended(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``torch.compile``'d code eagerly during the trace; yield ``model`` without compile wrappers.

    Dynamo refuses to compile a frame while a non-infra dispatch mode is active (the trace's
    ``FakeTensorMode`` and recorder) and caches that skip on the frame's code object: every later
    call of that code, in this module or any other of its class, then runs eagerly for the rest of
    the process. So dynamo must never see a frame during the trace. Each ``OptimizedModule`` is
    replaced in its parent by the module it wraps and ``module.compile()``'s compiled call is
    dropped (call inside ``preserved_module_state``, which puts both back); the ``force_eager``
    stance, where torch has it, covers compiled functions the model calls.
    """
    wrapper = _optimized_module_type()
    if wrapper is None:
        yield model
        return
    for module in list(model.modules()):
        if module.__dict__.get("_compiled_call_impl") is not None:
            module.__dict__["_compiled_call_impl"] = None
        for name, child in list(module._modules.items()):
            if isinstance(child, wrapper):
                module._modules[name] = _unwrapped(child, wrapper)
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    with set_stance("force_eager") if set_stance is not None else nullcontext():
        yield _unwrapped(model, wrapper)


def _unwrapped(module: nn.Module, wrapper: type) -> nn.Module:
    while isinstance(module, wrapper):
        module = module._orig_mod
    return module


@contextmanager
def preserved_rng_state() -> Iterator[None]:
    """Keep the user's random streams where they were: torch's CPU (and, if initialised, CUDA) ones and
    Python's, which datasets' random transforms and shuffling streams draw from."""
    cpu_state, python_state = torch.random.get_rng_state(), random.getstate()
    device_states = [(backend, backend.rng_states()) for backend in registered_backends()]
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu_state)
        random.setstate(python_state)
        for backend, states in device_states:
            if states is not None:
                backend.set_rng_states(states)


@contextmanager
def onednn_disabled() -> Iterator[None]:
    """Turn oneDNN (mkldnn) off for the trace and back to what it was after.

    Done through the plain switch rather than ``torch.backends.mkldnn.flags``, which also resets
    TF32 settings and warns on builds without Intel GPU support.
    """
    previous = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(previous)


@contextmanager
def cudnn_rnn_disabled(model: nn.Module, emulated: Callable[[], int] | None = None) -> Iterator[dict[str, int]]:
    """Run the model's RNN modules without cuDNN while tracing on fake CUDA tensors.

    cuDNN's RNN has no fake kernel that knows its memory: ``_cudnn_rnn``'s meta kernel returns the
    weight buffer it was given (none, since fake weights cannot be flattened into one), which the
    backward then rejects, and reports a 0-byte reserve space. LSTMs, GRUs and plain RNNs run
    ``memfit.tracing.cudnn_rnn``'s stand-in for cuDNN's kernels instead (``emulated`` counts its calls); what it
    does not stand in for (packed sequences, projections) runs PyTorch's native CUDA RNN kernels
    (``_thnn_fused_lstm_cell`` and the decomposed GRU / RNN cells), which have fake kernels and save what cuDNN's
    reserve space holds (the gates of every step). cuDNN stays on everywhere else
    (convolutions). Yields the count of RNN forwards so run, by module type and kernels.
    """
    calls: dict[str, int] = {}
    rnns = [m for m in model.modules() if isinstance(m, nn.RNNBase)]
    if not rnns:
        yield calls
        return
    previous = torch.backends.cudnn.enabled
    stack: list[tuple[bool, int]] = []

    def off(module: nn.Module, _args: Any) -> None:
        stack.append((torch.backends.cudnn.enabled, emulated() if emulated is not None else 0))
        torch.backends.cudnn.enabled = False

    def restore(module: nn.Module, _args: Any, _output: Any) -> None:
        enabled, before = stack.pop() if stack else (previous, 0)
        torch.backends.cudnn.enabled = enabled
        if emulated is not None and emulated() > before:
            key = f"{type(module).__name__} on cuDNN's kernels (workspace and reserve space modelled)"
        else:
            key = f"{type(module).__name__} on PyTorch's native CUDA RNN kernels (cuDNN's reserve space is not known)"
        calls[key] = calls.get(key, 0) + 1

    handles = [h for m in rnns for h in (m.register_forward_pre_hook(off), m.register_forward_hook(restore))]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
        torch.backends.cudnn.enabled = previous


def swap_tensors_in(model: nn.Module, make: Callable[[torch.Tensor, bool], torch.Tensor]) -> dict[int, Any]:
    """Replace parameters and buffers by ``make(tensor, is_parameter)``; shared tensors stay shared.

    Returns the mapping ``id(original) -> replacement``. Call inside ``preserved_module_state``.
    """
    replacements: dict[int, Any] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in replacements:
                replacements[id(param)] = make(param, True)
            module._parameters[name] = replacements[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is None:
                continue
            if id(buffer) not in replacements:
                replacements[id(buffer)] = make(buffer, False)
            module._buffers[name] = replacements[id(buffer)]
        if isinstance(module, nn.RNNBase):
            # RNN modules run from their own list of weights, which assigning ``_parameters`` leaves stale: without
            # this, the RNN would compute with (and accumulate gradients into) the original tensors
            module._flat_weights = [getattr(module, name, None) for name in module._flat_weights_names]
    return replacements


class module_path_tracker:
    """Know which submodule is running, so a failure can name it (``encoder.layer.3.attention``)."""

    def __init__(self, model: nn.Module) -> None:
        self._names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
        self.stack: list[str] = []
        # classes of the model's own tensors that fake tensors cannot stand in for (the tracer notes them
        # before the swap), so a failure can blame those rather than the sample
        self.foreign_tensor_types: list[str] = []
        self._handles: list[Any] = []

    @property
    def current(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def __enter__(self) -> module_path_tracker:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def pre(module: nn.Module, _args: Any) -> None:
            name = self._names.get(id(module))
            if name is not None:
                self.stack.append(name)

        def post(module: nn.Module, _args: Any, _out: Any) -> None:
            if id(module) in self._names and self.stack:
                self.stack.pop()

        self._handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
