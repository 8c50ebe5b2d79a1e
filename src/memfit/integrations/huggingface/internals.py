"""Every private of the Trainer and accelerate memfit reads or replaces, in one place.

The Trainer's own state: it copies the batch size out of its arguments in ``__init__``
(``self._train_batch_size = args.train_batch_size``) and reads the rest of them from ``self.args`` in
``train()``, so a plan applies to a built Trainer by giving it new arguments and that copy
(:func:`apply_arguments`). Callbacks are never handed the Trainer, so a callback finds the one calling it on
the stack (:func:`calling_trainer`). OOM recovery replaces ``training_step``, ``compute_loss`` and the
optimizer's ``step`` on the instances (:func:`replace_attribute`, undone by :func:`restore_attributes`).

What the Trainer and accelerate decide about sharding, read where they keep it.

transformers has no public answer to "will this run be sharded, and how": ``TrainingArguments``
keeps the FSDP options it hands accelerate (``fsdp_plugin_args``, transformers 5) and the DeepSpeed
config it processed (``hf_deepspeed_config``); ``accelerate launch`` passes its choices in
environment variables (``ACCELERATE_USE_FSDP``, ``FSDP_*``, ``ACCELERATE_USE_DEEPSPEED``) that
accelerate's plugins read; and accelerate applies FSDP only when its ``PartialState`` runs several
processes on GPU-type devices (``AcceleratorState``: FSDP for ``MULTI_GPU`` and the like, never for
``MULTI_CPU``), DeepSpeed only when that state is ``DEEPSPEED``. Those reads live here, with the
versions they are tested on (transformers 5.23, accelerate 1.x; 4.x arguments fall back to
``fsdp``/``fsdp_config`` as written); everything else of the integration reads public arguments.

The command line builds models on the meta device: :func:`lean_model_imports` imports transformers' modelling code
there without the optional libraries and docstrings the build never uses.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib
import importlib.util
import inspect
import os
import pkgutil
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from memfit.run.recovery import OOMRecovery, chunk_runner, is_out_of_memory
from memfit.tracing.sharding_sources import load_deepspeed_config

__all__ = [
    "apply_arguments",
    "calling_trainer",
    "changed_arguments",
    "deepspeed_auto_values",
    "deepspeed_config",
    "defer_optional_libraries",
    "distributed_type",
    "fsdp_options",
    "fsdp_requested",
    "install_chunked_step",
    "keep_configured_loss",
    "lean_model_imports",
    "local_world_size",
    "loss_sums_micro_batches",
    "replace_attribute",
    "restore_attributes",
    "world_size",
]

_TRUE = ("1", "true", "yes", "on")
# accelerate.utils.constants.FSDP_SHARDING_STRATEGY: FSDP_SHARDING_STRATEGY=<index + 1> means that name
_ACCELERATE_SHARDING = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]


# What every model build imports that imports optional libraries at import time, under these checks, for functions
# only some runs call: assisted generation (scikit-learn's ROC curve) and the losses (scipy's matching); a package
# stands for each of its modules.
_LIGHTENED = ("transformers.generation.candidate_generator", "transformers.loss")
_OPTIONAL_LIBRARIES = ("is_sklearn_available", "is_scipy_available")

_UNSET = object()
Replaced = tuple[Any, str, Any]  # (owner, attribute, what it held before; _UNSET: nothing of its own)


def changed_arguments(args: Any, changes: dict[str, Any]) -> Any:
    """A shallow copy of ``TrainingArguments`` with ``changes`` (a plan's batch, accumulation, checkpointing).

    Not ``dataclasses.replace``: that runs ``__post_init__``, whose first ``.device`` on the new instance resets
    accelerate's shared state (``TrainingArguments._setup_devices`` calls ``AcceleratorState._reset_state``) under
    any Accelerator already built, a Trainer's included. A copy keeps the device set-up (a cached property) and
    leaves the arguments the user holds as they were."""
    copied = copy.copy(args)
    for name, value in changes.items():
        setattr(copied, name, value)
    return copied


def apply_arguments(trainer: Any, changes: dict[str, Any]) -> None:
    """Set a plan's arguments on a built Trainer. ``Trainer.__init__`` copied ``args.train_batch_size`` into
    ``_train_batch_size``, which its train dataloader and ``auto_find_batch_size`` use; accumulation and
    checkpointing it reads from ``self.args`` when ``train()`` runs (transformers 4.57 to 5.x)."""
    trainer.args = changed_arguments(trainer.args, changes)
    trainer._train_batch_size = trainer.args.train_batch_size


def loss_sums_micro_batches(trainer: Any) -> bool:
    """Whether this Trainer would add up the micro batches' mean losses under accumulation instead of averaging
    them: it leaves the division by the accumulation steps to the model when ``model_accepts_loss_kwargs`` (any
    forward with ``**kwargs``, transformers 4.46+), but a model whose forward computes its loss without the
    ``loss_function`` that takes ``num_items_in_batch`` (BERT's sequence classification: a mean
    ``CrossEntropyLoss``) returns each micro batch's mean, so the window's loss and gradients grow with the
    accumulation steps."""
    if not getattr(trainer, "model_accepts_loss_kwargs", False) or getattr(trainer, "compute_loss_func", None):
        return False
    model = trainer.accelerator.unwrap_model(trainer.model)
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):  # no source (compiled, built at run time): nothing to say
        return False
    return "loss_function" not in source and "num_items_in_batch" not in source


def keep_configured_loss(trainer: Any, plan: Any) -> str | None:
    """Keep the loss and gradients of the run as configured when ``plan`` changed its accumulation and the Trainer
    would add up the micro batches' mean losses (``loss_sums_micro_batches``); why, in plain words, or ``None``.

    ``model_accepts_loss_kwargs = False`` (what transformers advises) makes the Trainer divide each micro batch's
    loss by the planned steps, so the window's loss is the mean. A run configured with ``k > 1`` steps added up its
    ``k`` means instead: each training micro batch's loss is then multiplied by ``k`` (``compute_loss`` on the
    instance; evaluation's is left alone). Applied once per Trainer."""
    configured, planned = plan.configured_accumulation, plan.accumulate_grad_batches
    if not configured or configured == planned or trainer in _LOSS_KEPT or not loss_sums_micro_batches(trainer):
        return None
    _LOSS_KEPT.add(trainer)
    trainer.model_accepts_loss_kwargs = False
    reason = (
        f"{type(trainer.model).__name__}'s loss ignores num_items_in_batch, so the Trainer would add up the "
        f"{planned} micro batches' mean losses (and gradients) instead of averaging them: memfit sets "
        "trainer.model_accepts_loss_kwargs = False, as transformers advises"
    )
    exactly = (
        " (exactly for a loss averaged over samples; one averaged over tokens differs slightly where micro batches "
        "hold different numbers of tokens)"
    )
    other = _other_batch(plan)
    if configured == 1:
        kept = "those of the configured batch" if not other else "a mean over the step's samples, as configured"
        return f"{reason}, so the loss and gradients stay {kept}{exactly}{other}"
    original = trainer.compute_loss

    def compute_loss(model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
        output = original(model, inputs, return_outputs=return_outputs, **kwargs)
        if not model.training:  # an evaluation's loss is reported as the model computes it
            return output
        return (output[0] * configured, *output[1:]) if return_outputs else output * configured

    trainer.compute_loss = compute_loss
    return (
        f"{reason}, and multiplies each micro batch's loss by {configured}: the run as configured added up its "
        f"{configured} micro batches' mean losses, and its loss and gradients stay that sum{exactly}{other}"
    )


def _other_batch(plan: Any) -> str:
    """What the loss line must add where the plan's effective batch is not the configured one (the plan's reasons
    say why: a target no split that fits hits exactly)."""
    target, effective = plan.target_batch_size, plan.effective_batch_size
    if not target or target == effective:
        return ""
    return (
        f"; each optimizer step now takes {effective} samples, not the configured {target} (the plan's reasons say why)"
    )


_LOSS_KEPT: weakref.WeakSet[Any] = weakref.WeakSet()  # the Trainers whose loss keep_configured_loss kept


def calling_trainer(kind: type) -> Any:
    """The ``kind`` (``transformers.Trainer``) instance whose method is calling the current callback event,
    found on the stack (``CallbackHandler`` hands callbacks the model and loaders, never the Trainer); ``None``
    when the event does not come from one."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, kind):
            return candidate
        frame = frame.f_back
    return None


def replace_attribute(owner: Any, name: str, value: Any, replaced: list[Replaced]) -> None:
    """Set ``owner.name`` (an instance's method: the Trainer's ``training_step``), remembering what to restore."""
    replaced.append((owner, name, vars(owner).get(name, _UNSET)))
    setattr(owner, name, value)


def install_chunked_step(
    trainer: Any,
    model: Any,
    inner: Any,
    recovery: OOMRecovery,
    optimizer_oom: Callable[[], None],
    replaced: list[Replaced],
) -> None:
    """Replace the Trainer's ``training_step`` (the batch in chunks through ``recovery``: the last chunk
    through the wrapped ``model``, the others through the ``inner`` module), its ``compute_loss`` (each
    chunk's loss weighted by its share; where the backward begins) and its optimizer's ``step`` (an
    out-of-memory error there calls ``optimizer_oom`` before it propagates), on the instances.

    Reads what the Trainer decides per step: ``accelerator.gradient_state.sync_gradients`` (the window's
    last micro batch), and whether the loss it computes is already divided by the window's item count
    (``model_accepts_loss_kwargs`` with ``num_items_in_batch``, or a ``compute_loss_func``): such losses
    add up over chunks unweighted (transformers 4.57 to 5.x)."""
    original_step, original_loss = trainer.training_step, trainer.compute_loss
    chunk_state = {"weight": 1.0, "in_step": False, "window_done": True}

    def compute_loss(model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
        output = original_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        if not chunk_state["in_step"]:
            return output  # evaluation
        recovery.backward_started()
        weight = chunk_state["weight"]
        if weight == 1.0:
            return output
        return (output[0] * weight, *output[1:]) if return_outputs else output * weight

    def training_step(model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        if chunk_state["window_done"]:
            recovery.start_window()
        sync = bool(trainer.accelerator.gradient_state.sync_gradients)
        additive = (num_items_in_batch is not None and trainer.model_accepts_loss_kwargs) or (
            trainer.compute_loss_func is not None
        )

        def step_of(module: Any) -> Callable[[Any, float], torch.Tensor]:
            def run(chunk: Any, weight: float) -> torch.Tensor:
                chunk_state["weight"], chunk_state["in_step"] = (1.0 if additive else weight), True
                try:
                    return original_step(module, chunk, num_items_in_batch)
                finally:
                    chunk_state["in_step"] = False

            return run

        run_chunk = chunk_runner(model, through_wrapper=step_of(model), bare=step_of(inner))
        losses = recovery.run_batch(inputs, run_chunk, step=trainer.state.global_step, sync=sync)
        chunk_state["window_done"] = sync
        return sum(losses[1:], losses[0])

    optimizer = trainer.optimizer
    original_optimizer_step = getattr(optimizer, "step", None)

    def optimizer_step(*args: Any, **kwargs: Any) -> Any:
        try:
            return original_optimizer_step(*args, **kwargs)
        except Exception as error:
            if is_out_of_memory(error):
                optimizer_oom()
            raise

    replace_attribute(trainer, "training_step", training_step, replaced)
    replace_attribute(trainer, "compute_loss", compute_loss, replaced)
    if original_optimizer_step is not None:
        if hasattr(original_optimizer_step, "_wrapped_by_lr_sched"):
            # torch's LR scheduler marks the step it wraps; the mark keeps it from warning that step was replaced
            optimizer_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        replace_attribute(optimizer, "step", optimizer_step, replaced)


def restore_attributes(replaced: list[Replaced]) -> None:
    """Undo :func:`replace_attribute` calls, newest first; an instance that had no attribute of its own shows its
    class's method again."""
    for owner, name, before in reversed(replaced):
        if before is _UNSET:
            vars(owner).pop(name, None)
        else:
            setattr(owner, name, before)
    replaced.clear()


@contextlib.contextmanager
def lean_model_imports() -> Iterator[None]:
    """While memfit's own command line builds transformers models: their imports without what building never uses.

    Building a preset on the meta device imports transformers' modelling code, and with it two optional libraries
    and a docstring generator none of which the build uses (``benchmarks/model_build_imports.py`` times them):

    - assisted generation imports scikit-learn (with scipy and pandas) for a ROC curve, and the object-detection
      losses import scipy for a matching, at import time, when they are installed
      (:func:`defer_optional_libraries`). Those modules are imported with the availability checks answering no;
      the checks are then given back and each function they guarded bound to one that imports it from its library
      when first called, so the modules do what they would have done.
    - ``@auto_docstring`` writes each model class's docstring from its signature (more than a second for one
      model's classes on a 2-core laptop); while the block runs, classes keep the docstring they were written with.

    Everything is restored when the block ends: a module imported after it is what it would be. A process where
    those modules are imported already, or without transformers, is left as it is. Never used in a user's
    process: the callbacks run in their training, whose imports are their own."""
    if importlib.util.find_spec("transformers") is None:
        yield
        return
    utils = importlib.import_module("transformers.utils")
    defer_optional_libraries(utils)
    real_docstrings = getattr(utils, "auto_docstring", None)
    if real_docstrings is not None:
        utils.auto_docstring = _undocumented
    try:
        yield
    finally:
        if real_docstrings is not None:
            utils.auto_docstring = real_docstrings


def defer_optional_libraries(utils: Any) -> None:
    """Import the ``_LIGHTENED`` modules with ``utils``' ``_OPTIONAL_LIBRARIES`` checks answering no, then give
    every module imported meanwhile the real checks back, with what each check guarded bound to import when
    called (where the library is installed)."""
    checks = {name: getattr(utils, name) for name in _OPTIONAL_LIBRARIES if callable(getattr(utils, name, None))}
    modules = [name for name in _lightened_modules() if name not in sys.modules]
    if not checks or not modules:  # imported already, or a transformers without the checks
        return
    before = set(sys.modules)
    for name in checks:
        setattr(utils, name, _absent)
    try:
        for name in modules:
            with contextlib.suppress(ImportError):  # a transformers without the module: nothing to keep light
                importlib.import_module(name)
    finally:
        for name, real in checks.items():
            setattr(utils, name, real)
        for name in set(sys.modules) - before:
            if (module := sys.modules.get(name)) is not None:
                _give_checks_back(module, checks)


def _lightened_modules() -> list[str]:
    names = []
    for name in _LIGHTENED:
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        if spec.submodule_search_locations is None:
            names.append(name)
        else:
            names.extend(f"{name}.{found.name}" for found in pkgutil.iter_modules(spec.submodule_search_locations))
    return names


def _give_checks_back(module: ModuleType, checks: dict[str, Callable[[], bool]]) -> None:
    namespace = vars(module)
    for check, real in checks.items():
        if namespace.get(check) is not _absent:
            continue
        namespace[check] = real
        if not real():
            continue
        for name, (library, attribute) in _guarded_imports(module, check).items():
            if attribute is None:  # ``import library``: the module it binds, imported now as it would have been
                importlib.import_module(library)
                namespace[name] = sys.modules[library if name != library.split(".")[0] else name]
            else:
                namespace[name] = _imported_when_called(library, attribute)


def _guarded_imports(module: ModuleType, check: str) -> dict[str, tuple[str, str | None]]:
    """What ``module`` imports at its top level under ``if check():``: each name it binds, and the library module
    and attribute it comes from (no attribute for ``import library``)."""
    origin = getattr(getattr(module, "__spec__", None), "origin", None)
    if not origin or not origin.endswith(".py"):
        return {}
    try:
        tree = ast.parse(Path(origin).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return {}
    names: dict[str, tuple[str, str | None]] = {}
    for node in tree.body:
        test = node.test if isinstance(node, ast.If) else None
        if not (isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == check):
            continue
        for statement in node.body:
            if isinstance(statement, ast.ImportFrom) and statement.level == 0 and statement.module:
                for alias in statement.names:
                    names[alias.asname or alias.name] = (statement.module, alias.name)
            elif isinstance(statement, ast.Import):
                for alias in statement.names:
                    names[alias.asname or alias.name.split(".")[0]] = (alias.name, None)
    return names


def _imported_when_called(library: str, name: str) -> Callable[..., Any]:
    def imported(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(library), name)(*args, **kwargs)

    imported.__name__ = imported.__qualname__ = name
    return imported


def _undocumented(obj: Any = None, **options: Any) -> Any:
    """``auto_docstring`` leaving docstrings as written, used bare (``@auto_docstring``) or with options."""
    return obj if obj is not None else _as_it_is


def _as_it_is(obj: Any) -> Any:
    return obj


def _absent() -> bool:
    return False


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in _TRUE


def fsdp_requested(args: Any) -> bool:
    """The arguments, or ``accelerate launch --use_fsdp``, ask for FSDP."""
    return bool(getattr(args, "fsdp", None)) or _env_flag("ACCELERATE_USE_FSDP")


def deepspeed_requested(args: Any) -> bool:
    """The arguments, or ``accelerate launch --use_deepspeed``, ask for DeepSpeed."""
    return bool(getattr(args, "deepspeed", None)) or _env_flag("ACCELERATE_USE_DEEPSPEED")


def distributed_type(args: Any) -> str:
    """accelerate's ``DistributedType`` name for this process (``NO``, ``MULTI_CPU``, ``MULTI_GPU``,
    ``DEEPSPEED``, ...), as ``TrainingArguments`` set up its ``PartialState``."""
    _ = args.device  # sets up ``distributed_state`` (a cached property)
    state = getattr(args, "distributed_state", None)
    kind = getattr(state, "distributed_type", None)
    return str(getattr(kind, "name", kind or "NO"))


def fsdp_applies(kind: str) -> bool:
    """Whether accelerate wraps the model in FSDP under this ``DistributedType`` (several processes on
    GPU-type devices: ``AcceleratorState`` turns ``MULTI_GPU``, ``MULTI_NPU``, ... into ``FSDP``)."""
    return kind.startswith("MULTI_") and kind != "MULTI_CPU"


def world_size(args: Any) -> int:
    """Processes in the job: the process group's size when there is one, else ``args.world_size``.
    (Under DeepSpeed's CPU accelerator, accelerate 1.x reports ``num_processes == 1`` to ``TrainingArguments``
    in a two-process ``torchrun`` job, while ZeRO shards across both.)"""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return int(distributed.get_world_size())
    return int(args.world_size)


def local_world_size(args: Any) -> int:
    """Processes on this node (torchrun's ``LOCAL_WORLD_SIZE``), else the whole world size."""
    world = world_size(args)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    return local if local > 0 and world % local == 0 else world


def fsdp_options(args: Any) -> dict[str, Any]:
    """The FSDP plugin's options: ``fsdp_version``, ``sharding`` (an FSDP1 ``ShardingStrategy`` name, or
    ``None`` for FSDP2), ``reshard_after_forward`` (FSDP2), ``cpu_offload``, ``activation_checkpointing``,
    ``auto_wrap_policy``, ``wrap_classes`` (the transformer layer class names it wraps): from
    ``args.fsdp_plugin_args`` (what the Trainer hands accelerate), else from ``accelerate launch``'s
    ``FSDP_*`` variables, else from ``fsdp``/``fsdp_config`` as written."""
    plugin = getattr(args, "fsdp_plugin_args", None)
    if plugin:
        version = int(plugin.get("fsdp_version", 2))
        reshard = plugin.get("reshard_after_forward", True if version == 2 else "full_shard")
        return _options(version, reshard, plugin.get("cpu_offload", False), plugin.get("activation_checkpointing"),
                        plugin.get("auto_wrap_policy"), plugin.get("transformer_cls_names_to_wrap"))  # fmt: skip
    if getattr(args, "fsdp", None):  # transformers 4.x: the arguments as written
        items = args.fsdp.split() if isinstance(args.fsdp, str) else [str(i) for i in args.fsdp or []]
        items = [str(getattr(i, "value", i)).lower() for i in items]
        config = getattr(args, "fsdp_config", None) or {}
        version = int(config.get("version", config.get("fsdp_version", 1)))
        named = next((i for i in items if i.upper() in _ACCELERATE_SHARDING), "full_shard")
        reshard = config.get("reshard_after_forward", named != "shard_grad_op" if version == 2 else named)
        offload = "offload" in items or bool(config.get("cpu_offload", False))
        wrap = "TRANSFORMER_BASED_WRAP" if "auto_wrap" in items else config.get("auto_wrap_policy")
        classes = config.get("transformer_layer_cls_to_wrap")
        classes = ",".join(classes) if isinstance(classes, (list, tuple)) else classes
        return _options(version, reshard, offload, config.get("activation_checkpointing"), wrap, classes)
    version = int(os.environ.get("FSDP_VERSION", "1"))  # accelerate's plugin reads these, with these defaults
    sharding = os.environ.get("FSDP_SHARDING_STRATEGY") or os.environ.get(
        "FSDP_RESHARD_AFTER_FORWARD", "true" if version == 2 else "FULL_SHARD"
    )
    return _options(version, sharding, _env_flag("FSDP_OFFLOAD_PARAMS"), _env_flag("FSDP_ACTIVATION_CHECKPOINTING"),
                    os.environ.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP"),
                    os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP"))  # fmt: skip


def _options(version: int, reshard: Any, offload: Any, checkpointing: Any, wrap: Any, classes: Any) -> dict[str, Any]:
    def flag(value: Any) -> bool:
        return value if isinstance(value, bool) else str(value).lower() in _TRUE

    if version == 2:
        sharding, reshard_after_forward = None, flag(reshard)
    else:
        name = str(reshard).upper()
        if name.isdigit():
            name = _ACCELERATE_SHARDING[int(name) - 1]
        sharding, reshard_after_forward = ("_" + name if name == "HYBRID_SHARD_ZERO2" else name), None
    return {
        "fsdp_version": version,
        "sharding": sharding,
        "reshard_after_forward": reshard_after_forward,
        "cpu_offload": flag(offload),
        "activation_checkpointing": flag(checkpointing or False),
        "auto_wrap_policy": str(wrap or "NO_WRAP").upper(),
        "wrap_classes": tuple(name.strip() for name in str(classes).split(",") if name.strip()) if classes else None,
    }


def deepspeed_config(args: Any) -> dict[str, Any] | None:
    """The DeepSpeed config the run will use: ``deepspeed=`` as ``TrainingArguments`` processed it
    (batch sizes filled in), else the one ``accelerate launch --use_deepspeed`` built its plugin from."""
    processed = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if isinstance(processed, dict):
        return processed
    if getattr(args, "deepspeed", None):
        return load_deepspeed_config(args.deepspeed)
    plugin = getattr(args, "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None)
    return dict(config) if isinstance(config, dict) else None


def deepspeed_auto_values(model: Any, zero3: bool) -> dict[str, int]:
    """The values the Trainer puts in place of ``"auto"`` bucket sizes, from the model's hidden size
    (``HfTrainerDeepSpeedConfig.trainer_config_finalize``); empty when the model's config has none."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None)
    hidden = None
    for source in (config, text):
        if source is None:
            continue
        if getattr(source, "hidden_size", None):
            hidden = source.hidden_size
        elif getattr(source, "hidden_sizes", None):
            hidden = max(source.hidden_sizes)
        if hidden:
            break
    if not hidden:
        return {}
    values = {"reduce_bucket_size": hidden * hidden}
    if zero3:
        values["stage3_prefetch_bucket_size"] = int(0.9 * hidden * hidden)
        values["stage3_param_persistence_threshold"] = 10 * hidden
    return values
