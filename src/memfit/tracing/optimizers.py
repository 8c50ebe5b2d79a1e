"""Build the user's optimizer again over fake parameters, so its state is traced too."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.optim import Optimizer
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.errors import InvalidInputError

__all__ = [
    "BLOCK_8BIT",
    "MIN_8BIT_SIZE",
    "OPTIMIZERS",
    "OPTIMIZER_NAMES",
    "OptimizerInfo",
    "OptimizerSpec",
    "build_optimizer",
    "embeddings_in_32_bits",
    "optimizer_info",
    "optimizer_name",
    "stepping",
]

OptimizerSpec = Optimizer | str | Callable[..., Optimizer] | None


MIN_8BIT_SIZE = 4096
"""bitsandbytes' ``min_8bit_size`` default: a tensor with fewer elements keeps its optimizer state in fp32."""
BLOCK_8BIT = 256
"""bitsandbytes' blockwise 8-bit optimizer state: one fp32 absmax per this many elements."""


@dataclass(frozen=True)
class OptimizerInfo:
    """One optimizer known by name: how the trace builds it and what state it keeps per parameter element.

    The formula tier and the host-RAM offload line read ``state_bytes``; the trace builds the class
    at ``class_path`` (``torch.optim.AdamW``, ``bitsandbytes.optim.AdamW8bit``) with ``defaults``.
    ``states`` are tensors the size of the parameter kept in the state dtype (fp32 unless the weights
    are pure fp16/bf16); ``fixed_bytes`` are bytes per element whatever the precision (a stand-in for
    factored states); ``eight_bit_states`` are bitsandbytes' blockwise 8-bit states, which it keeps in
    32 bits for a tensor under ``MIN_8BIT_SIZE`` elements (``tensor_state_bytes`` has the exact rule).
    """

    name: str
    aliases: tuple[str, ...] = ()
    class_path: str | None = None  # None: nothing to build ("none"), or see ``untraceable``
    defaults: Mapping[str, Any] = field(default_factory=dict, hash=False)
    states: int = 0
    fixed_bytes: int = 0
    approximate: bool = False  # ``state_bytes`` is a stand-in for the formula tier; the trace builds the real one
    untraceable: str | None = None  # why a fake-tensor trace cannot run it
    package: str | None = None  # the pip package the class needs, when it is not torch
    eight_bit_states: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))

    def state_bytes(self, state_dtype_bytes: int) -> int:
        """Optimizer state per trainable parameter element, with states of ``state_dtype_bytes`` each (8-bit
        states at their byte, the size of a tensor of ``MIN_8BIT_SIZE`` elements or more, less its block scales)."""
        return self.states * state_dtype_bytes + self.fixed_bytes + self.eight_bit_states

    def tensor_state_bytes(self, numel: int, state_dtype_bytes: int) -> int:
        """Optimizer state of one trainable tensor of ``numel`` elements, as the optimizer allocates it.

        bitsandbytes' ``Optimizer2State.init_state`` (and ``Optimizer1State``'s): a tensor under ``min_8bit_size``
        (``MIN_8BIT_SIZE``) gets fp32 states; a larger one uint8 states and an fp32 absmax per block of
        ``BLOCK_8BIT`` elements for each.
        """
        own = numel * (self.states * state_dtype_bytes + self.fixed_bytes)
        if not self.eight_bit_states:
            return own
        if numel < MIN_8BIT_SIZE:
            return own + self.eight_bit_states * 4 * numel
        return own + self.eight_bit_states * (numel + 4 * math.ceil(numel / BLOCK_8BIT))

    def optimizer_state_bytes(self, tensor_numels: Iterable[int], state_dtype_bytes: int) -> int:
        """Optimizer state of trainable tensors of ``tensor_numels`` elements: each tensor's, and what the
        optimizer shares between them (bitsandbytes' two 256-entry fp32 code books, once any state is 8-bit)."""
        numels = list(tensor_numels)
        total = sum(self.tensor_state_bytes(n, state_dtype_bytes) for n in numels)
        if self.eight_bit_states and any(n >= MIN_8BIT_SIZE for n in numels):
            total += 2 * 256 * 4  # name2qmap's "dynamic" and "udynamic" maps, moved to the parameters' device
        return total

    def count_state_bytes(self, numel: int, state_dtype_bytes: int) -> int:
        """Optimizer state of ``numel`` trainable elements whose tensor sizes are unknown.

        For most optimizers the state is per element, so the count decides it. bitsandbytes' 8-bit ones
        decide per tensor (``tensor_state_bytes``), which a count cannot: the rule here reads the count as
        ``MIN_8BIT_SIZE - 1`` elements in small tensors (32-bit state) and the rest in large ones (8-bit).
        It is exact under ``MIN_8BIT_SIZE`` (every tensor of such a count is small), about 24 KiB above a count
        whose every tensor is large, and never falls as the count grows: training a part of a model never needs
        more state than training the whole, as for real, where the state adds up tensor by tensor.
        """
        if not self.eight_bit_states or numel < MIN_8BIT_SIZE:
            return self.optimizer_state_bytes([numel] if numel else [], state_dtype_bytes)
        small = MIN_8BIT_SIZE - 1
        large = numel - small
        own = large * (self.states * state_dtype_bytes + self.fixed_bytes)
        eight_bit = self.eight_bit_states * (large + 4 * math.ceil(large / BLOCK_8BIT)) + 2 * 256 * 4
        return self.tensor_state_bytes(small, state_dtype_bytes) + own + eight_bit


OPTIMIZERS: Mapping[str, OptimizerInfo] = MappingProxyType({
    info.name: info
    for info in (
        OptimizerInfo("none"),
        OptimizerInfo("sgd", class_path="torch.optim.SGD", defaults={"lr": 1e-3}),
        OptimizerInfo("sgd-momentum", ("momentum", "sgdm"), "torch.optim.SGD", {"lr": 1e-3, "momentum": 0.9}, states=1),
        OptimizerInfo("adam", class_path="torch.optim.Adam", states=2),
        OptimizerInfo("adamw", class_path="torch.optim.AdamW", states=2),
        # Factored second moment, O(rows + cols) per matrix, plus the update: 4 B per element is the
        # figure Hugging Face's "anatomy of model memory" guide uses. The trace runs torch's own.
        OptimizerInfo("adafactor", class_path="torch.optim.Adafactor", fixed_bytes=4, approximate=True),
        OptimizerInfo("adagrad", class_path="torch.optim.Adagrad", states=1),
        OptimizerInfo("rmsprop", class_path="torch.optim.RMSprop", states=1),
        # Two 1-byte states with an fp32 scale per block of 256 and two 256-entry code books, and
        # 32-bit states for tensors under 4096 elements (``tensor_state_bytes``).
        OptimizerInfo(
            "adam-8bit",
            ("adamw-8bit", "adam8bit", "adamw8bit", "bnb-adam8bit", "bnb-adamw8bit"),
            "bitsandbytes.optim.AdamW8bit",
            package="bitsandbytes",
            eight_bit_states=2,
        ),
    )
})  # fmt: skip
"""Every optimizer known by name: the one table the formula tier, the trace, the CLI and the host line read."""

_BY_ALIAS: dict[str, OptimizerInfo] = {key: info for info in OPTIMIZERS.values() for key in (info.name, *info.aliases)}

OPTIMIZER_NAMES = tuple(name for name, info in OPTIMIZERS.items() if info.untraceable is None)
"""Names a trace can build (``estimate(optimizer=...)``, ``memfit plan --optimizer``)."""


def optimizer_info(name: str | None) -> OptimizerInfo:
    """The registry entry for ``name`` or one of its aliases (case-insensitive; ``None`` means ``"none"``)."""
    if name is None:
        return OPTIMIZERS["none"]
    if not isinstance(name, str):
        raise InvalidInputError(f"optimizer must be a name such as 'adamw' or None, got {name!r}")
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    try:
        return _BY_ALIAS[key]
    except KeyError:
        aliases = ", ".join(sorted(set(_BY_ALIAS) - set(OPTIMIZERS)))
        raise InvalidInputError(
            f"optimizer must be one of {', '.join(OPTIMIZERS)} (or an alias: {aliases}), got {name!r}"
        ) from None


def optimizer_name(spec: OptimizerSpec) -> str:
    """A readable name for reports: ``AdamW``, ``sgd-momentum``, ``none``."""
    if spec is None:
        return "none"
    if isinstance(spec, str):
        return spec.lower()
    if isinstance(spec, Optimizer):
        return type(spec).__name__
    return getattr(spec, "__name__", None) or getattr(getattr(spec, "func", None), "__name__", type(spec).__name__)


def build_optimizer(
    spec: OptimizerSpec,
    params: Mapping[int, torch.Tensor],
    trainable: Iterable[torch.Tensor],
    *,
    kwargs: Mapping[str, Any] | None = None,
    prefer_foreach: bool = False,
) -> Optimizer | None:
    """Return an optimizer of the user's kind over the fake tensors.

    ``params`` maps ``id(real parameter)`` to its fake twin (to rebuild an existing instance's
    groups); ``trainable`` are the fake parameters that get gradients. ``prefer_foreach`` sets
    ``foreach=True`` where the user left it unset, as torch does by default for CUDA tensors
    (its automatic choice does not recognise fake tensors).
    """
    trainable = list(trainable)
    kwargs = dict(kwargs or {})
    if spec is None:
        return None
    if isinstance(spec, str):
        optimizer = _from_name(spec, trainable, kwargs)
        if optimizer is None:
            return None
    elif isinstance(spec, Optimizer):
        optimizer = _rebuild(spec, params)
    elif callable(spec):
        try:
            # a class goes through _construct: bitsandbytes' 8-bit classes read values as they are built
            optimizer = _construct(spec, trainable, **kwargs) if isinstance(spec, type) else spec(trainable, **kwargs)
        except Exception as exc:
            raise InvalidInputError(
                f"calling optimizer={optimizer_name(spec)!r} with the model's parameters failed: "
                f"{type(exc).__name__}: {exc}; pass an optimizer class, a name such as 'adamw' or an instance"
            ) from exc
        if not isinstance(optimizer, Optimizer):
            raise InvalidInputError(
                f"optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer"
            )
    else:
        raise InvalidInputError(
            f"optimizer must be a torch.optim.Optimizer, an optimizer class or factory, a name "
            f"({', '.join(OPTIMIZER_NAMES)}) or None; got {spec!r}"
        )
    if prefer_foreach:
        for group in optimizer.param_groups:
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = True
    return optimizer


def _from_name(name: str, trainable: list[torch.Tensor], kwargs: dict[str, Any]) -> Optimizer | None:
    try:
        info = optimizer_info(name)
    except InvalidInputError:
        raise InvalidInputError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZER_NAMES)}") from None
    if info.name == "none":
        return None
    if info.untraceable is not None:
        raise InvalidInputError(info.untraceable)
    return _construct(_load_class(info), trainable, **{**info.defaults, **kwargs})


def _load_class(info: OptimizerInfo) -> type[Optimizer]:
    module_name, _, class_name = (info.class_path or "").rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        need = f"pip install {info.package}" if info.package else "a newer torch"
        raise InvalidInputError(
            f"optimizer {info.name!r} is traced with {info.class_path}, which cannot be loaded here "
            f"({type(error).__name__}: {error}); {need}, or use "
            f"memfit.estimate_from_counts(..., optimizer={info.name!r}) for a formula estimate"
        ) from error


def _rebuild(original: Optimizer, params: Mapping[int, torch.Tensor]) -> Optimizer:
    groups = []
    for group in original.param_groups:
        fakes = [params[id(p)] for p in group["params"] if id(p) in params]
        if fakes:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fakes})
    if not groups:
        raise InvalidInputError(
            f"the {type(original).__name__} passed as optimizer holds none of the model's parameters; "
            "build it from model.parameters() or pass its class instead"
        )
    accepted = inspect.signature(type(original).__init__).parameters
    init_kwargs = {k: v for k, v in original.defaults.items() if k in accepted}
    named = [k for k, p in accepted.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    # Keywords the optimizer keeps as attributes rather than in ``defaults``: bitsandbytes keeps
    # ``is_paged`` and ``args`` so, and ``optim_bits``/``min_8bit_size`` inside ``args``; without
    # them an 8-bit optimizer would be traced as a 32-bit one.
    kept = getattr(original, "args", None)
    for name in named:
        value = getattr(original, name, getattr(kept, name, None))
        if name not in init_kwargs and name not in ("self", "params") and _plain(value):
            init_kwargs[name] = value
    try:
        rebuilt = _construct(type(original), groups, **init_kwargs)
    except Exception as exc:
        raise InvalidInputError(
            f"could not rebuild {type(original).__name__} for tracing ({type(exc).__name__}: {exc}); "
            "pass its class and keyword arguments instead: optimizer=MyOptimizer, optimizer_kwargs={...}"
        ) from exc
    _copy_bnb_overrides(original, rebuilt, params)
    return rebuilt


def _plain(value: Any) -> bool:
    """A keyword value safe to hand to the rebuilt optimizer: nothing that holds the real tensors."""
    if value is None or isinstance(value, (torch.Tensor, torch.nn.Module, Optimizer)):
        return False
    return not (isinstance(value, (list, tuple, dict, set)) and any(isinstance(v, torch.Tensor) for v in value))


def _copy_bnb_overrides(original: Optimizer, rebuilt: Optimizer, params: Mapping[int, torch.Tensor]) -> None:
    """Give a rebuilt bitsandbytes optimizer the original's per-parameter overrides, in a manager of its own.

    bitsandbytes reads them (``optim_bits=32`` for embeddings, which the HF Trainer registers) from
    a process-wide ``GlobalOptimManager`` keyed by module, by ``id(parameter)`` and by group index,
    and writes into it at its first step. The rebuilt optimizer gets a private copy: module
    overrides resolve to the fake parameters the modules hold during the trace, overrides by
    parameter are moved to the fake twins, and the user's manager is left as it was.
    """
    manager = getattr(original, "mng", None)
    if manager is None or not hasattr(manager, "module_weight_config_triple"):
        return
    private = type(manager).__new__(type(manager))
    private.initialize()
    private.module_weight_config_triple = list(manager.module_weight_config_triple)
    private.uses_config_override = manager.uses_config_override
    for pid, config in manager.pid2config.items():
        if pid in params:
            private.pid2config[id(params[pid])] = config
    for gindex, group in enumerate(rebuilt.param_groups):
        for pindex, param in enumerate(group["params"]):
            if id(param) in private.pid2config:
                private.index2config[(gindex, pindex)] = private.pid2config[id(param)]
    rebuilt.mng = private  # type: ignore[attr-defined]


def _classes(*paths: str) -> tuple[type, ...]:
    """The classes at ``paths`` whose modules are already imported (an optimizer of a module never
    imported cannot exist, and looking it up must not import transformers or bitsandbytes)."""
    found = []
    for path in paths:
        module_name, _, name = path.rpartition(".")
        cls = getattr(sys.modules.get(module_name), name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


# Optimizers that compute constants from tensor values: bitsandbytes' 8-bit optimizers build two
# quantization code books (256 fp32 values each) with ``.tolist()``, in the constructor or at the
# first step. They are built here, with fake mode off, so the code books are real tensors of their
# real size (the step moves them to the parameters' device, as on a GPU); the parameters and
# everything the step allocates stay fake.
_VALUE_READING_CONSTRUCTORS = ("bitsandbytes.optim.optimizer.Optimizer8bit",)


def _construct(cls: type[Optimizer], *args: Any, **kwargs: Any) -> Optimizer:
    if not issubclass(cls, _classes(*_VALUE_READING_CONSTRUCTORS)):
        return cls(*args, **kwargs)
    with unset_fake_temporarily():
        optimizer = cls(*args, **kwargs)
        if "dynamic" not in optimizer.name2qmap:  # type: ignore[attr-defined]
            optimizer.fill_qmap()  # type: ignore[attr-defined]
    return optimizer


# Optimizers whose step reads tensor values only to size the step: ``Tensor.item()`` on the step
# counter and on norms (torch's Adafactor: ``step_t.item()``, ``param.norm(2).item()``,
# ``update.norm(2).item()``), ``max(eps, RMS)`` and an ``alpha=`` made of a 0-d tensor
# (transformers' Adafactor with ``scale_parameter=True``, its default). Those numbers scale the
# update and never decide a shape, a dtype or a branch that allocates, so ``stepping`` answers
# every such read with 1 and the step allocates exactly its real state and temporaries.
_STEP_SIZE_READERS = ("torch.optim.Adafactor", "transformers.optimization.Adafactor")


class _StepSizeReads(TorchDispatchMode):
    """Answer ``aten._local_scalar_dense`` (``.item()``, ``float()``, ``bool()`` of a tensor) with 1."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            tensor = args[0]
            return True if tensor.dtype is torch.bool else 1.0 if tensor.is_floating_point() else 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def stepping(optimizer: Optimizer | None) -> Iterator[None]:
    """The context ``optimizer.step()`` runs in under fake tensors.

    For the optimizers of ``_STEP_SIZE_READERS`` the value reads of their step are answered with 1
    (see there); every other optimizer runs as it is, and a value it reads fails the trace.
    """
    if not isinstance(optimizer, _classes(*_STEP_SIZE_READERS)):
        yield
        return
    with _StepSizeReads():
        yield


def embeddings_in_32_bits(optimizer: Any, model: torch.nn.Module) -> None:
    """Keep a bitsandbytes 8-bit optimizer's state of embeddings in 32 bits, as ``Trainer.create_optimizer`` does.

    The Trainer registers that override in bitsandbytes' process-wide manager; this optimizer gets a
    manager of its own with the same overrides (and whatever was registered before), so planning
    leaves the process's manager as it was. The trace rebuilds the optimizer with a copy of it.
    """
    shared = optimizer.mng
    private = type(shared).__new__(type(shared))
    private.initialize()
    private.module_weight_config_triple = list(shared.module_weight_config_triple)
    private.pid2config = dict(shared.pid2config)
    private.uses_config_override = shared.uses_config_override
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            private.register_module_override(module, "weight", {"optim_bits": 32})
    optimizer.mng = private
