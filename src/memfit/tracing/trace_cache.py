"""Traces kept on disk, so that a question asked again (another GPU, budget or batch) skips the trace.

A trace is the slow part of an answer: seconds of fake-tensor work for a small model, most of a minute for a
quantized 8B one. Its log depends only on the step (the model's structure and code, the sample's shapes and values,
the precision, optimizer and loop options) and on the code that runs it, so it can be kept.

What makes an entry safe:

* **Its key is everything the trace reads.** Every module's class and its plain attributes, every parameter and
  buffer (name, shape, dtype, gradient, class), hooks, a Hugging Face config in full, the sample (shapes, dtypes and
  a hash of its values), the step settings, torch's attention and determinism switches, ``MEMFIT_*`` variables,
  and the versions of Python, torch and every installed distribution whose code the step runs (memfit by a hash
  of its own source files). Code outside an installed distribution (a model class in the user's script) has no
  version that says when it changed, so such a step is never cached: a stale entry cannot exist.
* **It is data, not code.** Entries are gzip'd JSON. Symbolic sizes are expression trees read back only through a
  fixed table of sympy and torch classes; nothing in an entry is imported, evaluated or unpickled. An entry whose
  key differs from the question's (a collision, a copy from elsewhere), that cannot be read, or that names a class
  outside the table is ignored, deleted, and traced again, with one warning for the folder however many are.
* **Replays are kept too.** What the allocator's replays read off a kept trace (``ExactPeaks``: phase peaks, a
  limit's verdict, the least reserve) is a function of that trace, the runtime and the replay's arguments, so it is
  kept under the step's key with those in its part. One rank's log of a sharded run is a rewrite of the trace; its
  replays are kept with the data the rewrite reads (the sharding and the model's facts) in the part as well.
* **It is only a cache.** Deleting the folder at any time is safe (``memfit cache --clear``).

Location: ``MEMFIT_CACHE_DIR``, else the platform's user cache folder (``platformdirs``: ``~/.cache/memfit`` on
Linux) under ``traces/``. ``MEMFIT_CACHE=off`` turns it off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import gzip
import hashlib
import importlib.metadata
import inspect
import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sympy
import torch
from torch import nn

from memfit.cache_identity import CACHE_DIR_ENV, CACHE_ENV, cache_root, enabled, installed_distributions
from memfit.cache_identity import memfit_source_digest as _memfit_source_hash
from memfit.devices import registered_backends
from memfit.diagnostics import warn_once
from memfit.tracing.known_masks import holds_only_ones

__all__ = [
    "CACHE_DIR_ENV",
    "CACHE_ENV",
    "Uncacheable",
    "cache_dir",
    "clear",
    "enabled",
    "holds",
    "load",
    "sample_digest",
    "session_key",
    "store",
    "trace_part",
]

FORMAT = 2  # bump when what an entry holds, or how, changes (2: a trace's in-place gradient sums)


class Uncacheable(Exception):
    """The step holds something whose identity cannot be written down (code outside an installed distribution)."""


def cache_dir() -> Path:
    """Where entries live: ``MEMFIT_CACHE_DIR``, else the platform's user cache folder for memfit, ``traces/``."""
    return cache_root() / "traces"


def clear() -> int:
    """Delete every entry; how many there were."""
    removed = 0
    folder = cache_dir()
    if folder.is_dir():
        for path in folder.glob("*.json.gz"):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


# ---------------------------------------------------------------------------------------------------- the key


def session_key(model: nn.Module, sample: Any, sample_batch: int, settings: Any) -> str | None:
    """The key of one step's traces, as canonical JSON; ``None`` where the step cannot be cached."""
    if not enabled():
        return None
    try:
        key = {
            "format": FORMAT,
            "environment": _environment(),
            "model": _model_key(model),
            # a factory's batches are keyed per trace, by what it returns there (``sample_digest``)
            "sample": _canonical(sample) if not _is_factory(sample) else "factory",
            "sample_batch": sample_batch,
            "settings": _canonical(_as_traced(settings, model)),
        }
    except Uncacheable:
        return None
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def _as_traced(settings: Any, model: nn.Module) -> Any:
    """The settings as the trace reads them: gradient accumulation as "more than one micro batch" (every count above
    one traces the same step), so targets that accumulate differently share their traces; of the GPU's runtime
    facts, the kernels' (compute capability and launch limits), not its CUDA context, which only the replays add,
    so GPUs of one kind share their traces; an optimizer instance (a Trainer's) as its class, groups and state."""
    if getattr(settings, "accumulation_steps", 1) > 2:  # the trace reads it as "more than one micro batch" only
        settings = dataclasses.replace(settings, accumulation_steps=2)
    runtime = getattr(settings, "runtime", None)
    if dataclasses.is_dataclass(runtime) and hasattr(runtime, "cuda_context_bytes"):
        settings = dataclasses.replace(settings, runtime=dataclasses.replace(runtime, cuda_context_bytes=0))
    optimizer = getattr(settings, "optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer):
        settings = dataclasses.replace(settings, optimizer=_optimizer_key(optimizer, model))
    return settings


def _optimizer_key(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[Any]:
    """An optimizer instance as what a trace of its step reads: its class, each group's hyperparameters and
    parameters (by name in the model), and the state it already holds (shapes and plain values)."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    groups = []
    for group in optimizer.param_groups:
        members = []
        for parameter in group["params"]:
            if id(parameter) not in names:
                raise Uncacheable("the optimizer holds a parameter outside the model")
            members.append(names[id(parameter)])
        settings = {k: _canonical(v) for k, v in sorted(group.items()) if k != "params"}
        groups.append([members, settings])
    state = sorted(
        [names.get(id(p), "?"), {k: _shape_of(v) for k, v in sorted(values.items())}]
        for p, values in optimizer.state.items()
    )
    return ["optimizer", *_code(type(optimizer)), groups, state]


def sample_digest(factory: Callable[[int], Any], batch: int) -> str:
    """What a sample factory returns at ``batch``, by structure, shapes and dtypes (a trace runs on fake tensors and
    never reads values, so a factory of random tokens keys the same every time), hashed."""
    return hashlib.sha256(json.dumps(_shapes(_built_on_meta(factory, batch)), sort_keys=True).encode()).hexdigest()[:32]


def trace_part(part: str, sample: Any, batch: int) -> str:
    """A trace's part of its entry's name: for a sample factory, with what it returns at the traced ``batch`` (what
    the trace reads; the session key holds only ``"factory"``).

    Raises:
        Uncacheable: the factory's batch cannot be written down.
    """
    return f"{part}:{sample_digest(sample, batch)}" if _is_factory(sample) else part


def _built_on_meta(factory: Callable[[int], Any], batch: int) -> Any:
    """``factory(batch)`` with the tensors it makes on the default device made on ``meta``: their shapes and dtypes
    without their memory (a batch of images at a large batch is hundreds of MiB, and zeroing it took most of
    the key's time). A factory that cannot build there (it reads a value, or copies to a device) builds as it
    would."""
    try:
        with torch.device("meta"):
            return factory(batch)
    except Exception:
        return factory(batch)


def _shapes(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), str(value.dtype)]
    if isinstance(value, dict):
        return ["dict", sorted(([_canonical(k), _shapes(v)] for k, v in value.items()), key=json.dumps)]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_shapes(v) for v in value]]
    return _canonical(value)


def _is_factory(sample: Any) -> bool:
    return callable(sample) and not isinstance(sample, (torch.Tensor, dict, list, tuple))


def _environment() -> dict[str, Any]:
    return {
        "python": sys.version,
        "machine": platform.machine(),
        "packages": installed_distributions(),
        "memfit_source": _memfit_source_hash(),
        **{key: value for backend in registered_backends() for key, value in backend.trace_environment().items()},
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "mkldnn": torch._C._get_mkldnn_enabled(),
        "variables": sorted(
            (k, v) for k, v in os.environ.items() if k.startswith("MEMFIT_") and not k.startswith(CACHE_ENV)
        ),
    }


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    """``importlib.metadata.packages_distributions()``, read once: it reads every distribution's file list."""
    return importlib.metadata.packages_distributions()


@functools.cache
def _distribution_of(top_level: str) -> str | None:
    """The installed distribution that provides the import package ``top_level``, with its version."""
    names = _packages_distributions().get(top_level)
    if not names:
        return None
    return ";".join(f"{n.lower()}=={_version(n)}" for n in sorted(names))


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _code(obj: Any) -> list[str]:
    """Where a class or function comes from, versioned: its module and name, and the distribution (or, for
    memfit, the source hash; for the standard library, Python's version) that says when its code changed."""
    if isinstance(obj, functools.partial):
        return ["partial", *_code(obj.func), json.dumps(_canonical([obj.args, obj.keywords]), sort_keys=True)]
    if inspect.ismethod(obj):
        return ["method", *_code(obj.__func__), json.dumps(_canonical(obj.__self__), sort_keys=True)]
    module_name = getattr(obj, "__module__", None) or ""
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    if "<locals>" in qualname:  # a closure: what it captured is not written down
        raise Uncacheable(f"{qualname} is defined inside a function")
    top = module_name.split(".")[0]
    if top == "memfit":
        return [module_name, qualname, "memfit"]
    if top in sys.stdlib_module_names or top == "builtins":
        return [module_name, qualname, "python"]
    distribution = _distribution_of(top) if top else None
    if distribution is None:
        raise Uncacheable(f"{module_name}.{qualname} is not part of an installed distribution")
    return [module_name, qualname, distribution]


def _model_key(model: nn.Module) -> list[Any]:
    modules = []
    classes: dict[type, list[Any]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        attributes = {k: _canonical(v) for k, v in sorted(vars(module).items()) if _plain(v) and k != "training"}
        # code set on the module in place of its class's (``module.forward = ...``) runs instead of it
        attributes.update({k: _method_code(_unbound(v, module)) for k, v in sorted(vars(module).items())
                           if _is_code(v) and hasattr(type(module), k)})  # fmt: skip
        if type(module) not in classes:
            classes[type(module)] = _replaced_methods(type(module))
        hooks = [_code(h) for d in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
                 for h in getattr(module, d, {}).values()]  # fmt: skip
        config = getattr(module, "config", None)
        config_text = None
        if config is not None and hasattr(config, "to_json_string"):
            try:
                config_text = [config.to_json_string(use_diff=False), getattr(config, "_attn_implementation", None)]
            except Exception as exc:  # a config that cannot write itself down is not a key
                raise Uncacheable(f"the config of {name or 'the model'} cannot be written as JSON") from exc
        modules.append([name, _code(type(module)), classes[type(module)], module.training, attributes, hooks,
                        config_text])  # fmt: skip
    tensors = [
        [name, _code(type(t)), list(t.shape), str(t.dtype), t.requires_grad, t.device.type,
         {k: _canonical(v) for k, v in sorted(vars(t).items()) if _plain(v)}]
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    ]  # fmt: skip
    return [modules, tensors, _code(type(model))]


def _is_code(value: Any) -> bool:
    return inspect.isfunction(value) or inspect.ismethod(value) or isinstance(value, functools.partial)


def _unbound(value: Any, module: nn.Module) -> Any:
    """A method bound to the module itself as its function (the module is the key's already)."""
    return value.__func__ if inspect.ismethod(value) and value.__self__ is module else value


def _replaced_methods(cls: type) -> list[Any]:
    """The methods of ``cls`` and its bases that are not the ones their class defines (an assignment such as
    ``GPT2MLP.forward = patched``, or an alias ``__call__ = _call_impl``), by where their code comes from: a class's
    name and version do not say that its methods were replaced."""
    replaced = []
    for klass in cls.__mro__[:-1]:  # not object
        for name, value in sorted(vars(klass).items()):
            function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if inspect.isfunction(function) and function.__qualname__ != f"{klass.__qualname__}.{name}":
                replaced.append([klass.__qualname__, name, _method_code(function)])
    return replaced


def _method_code(function: Any) -> list[str]:
    """``_code`` of a method set in place of another; one an installed library defines inside a function (as
    transformers adds ``nn.Module.smart_apply``) is versioned by that library. User code is not cacheable."""
    try:
        return _code(function)
    except Uncacheable:
        module = getattr(function, "__module__", None) or ""
        top = module.split(".")[0]
        distribution = "memfit" if top == "memfit" else _distribution_of(top) if top else None
        if distribution is None or not inspect.isfunction(function):
            raise
        return [module, function.__qualname__, distribution]


def _plain(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str, type(None), torch.dtype, torch.device, enum.Enum)):
        return True
    return isinstance(value, tuple) and all(_plain(v) for v in value)


def _canonical(value: Any) -> Any:
    """``value`` as JSON that changes whenever anything a trace could read from it changes."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return ["float", repr(value)]
    if isinstance(value, enum.Enum):
        return ["enum", *_code(type(value)), str(value.value)]
    if isinstance(value, (torch.device, torch.dtype)):
        return ["torch", str(value)]
    if isinstance(value, torch.Tensor):
        return _tensor_key(value)
    if isinstance(value, dict):
        return ["dict", sorted(([_canonical(k), _canonical(v)] for k, v in value.items()), key=json.dumps)]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_canonical(v) for v in value]]
    if isinstance(value, (set, frozenset)):
        return ["set", sorted((_canonical(v) for v in value), key=json.dumps)]
    if isinstance(value, (type, functools.partial)) or inspect.isfunction(value) or inspect.ismethod(value):
        return ["code", *_code(value)]
    if dataclasses.is_dataclass(value):
        fields = {f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return ["dataclass", *_code(type(value)), fields]
    keyed = getattr(type(value), "memfit_cache_key", None)
    if keyed is not None:  # an object that says what of it a trace reads (or why nothing can be kept)
        return ["keyed", *_code(type(value)), _canonical(keyed(value))]
    if isinstance(value, nn.Module):  # a module as a loss or forward function: its settings and weights count
        return ["module", _model_key(value)]
    if callable(value) and hasattr(value, "__dict__") and not isinstance(value, type):
        # a callable object (a loss with settings): its class and every attribute it could read
        return ["object", *_code(type(value)), _canonical(dict(vars(value)))]
    if callable(value) and hasattr(value, "__module__"):  # e.g. a builtin
        return ["code", *_code(value)]
    raise Uncacheable(f"a {type(value).__name__} in the step cannot be written down")


def _shape_of(value: Any) -> Any:
    """A state tensor by shape, dtype and device (its values are never read by a trace, and can be gigabytes)."""
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), str(value.dtype), value.device.type]
    return _canonical(value)


def _tensor_key(tensor: torch.Tensor) -> list[Any]:
    key: list[Any] = ["tensor", list(tensor.shape), str(tensor.dtype), tensor.device.type]
    if tensor.device.type == "meta" and holds_only_ones(tensor):  # an all-ones mask is traced as none (known_masks)
        return [*key, "ones"]
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return key
    if tensor.numel() > 1 << 24:
        raise Uncacheable("the sample is too large to hash")
    values = tensor.detach().to("cpu").contiguous()
    if values.dtype == torch.bfloat16:
        values = values.view(torch.int16)
    return [*key, hashlib.sha256(values.numpy().tobytes()).hexdigest()]


# ------------------------------------------------------------------------------------------------- the store


def _path(key: str) -> Path:
    return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()}.json.gz"


def holds(key: str, part: str) -> bool:
    """Whether an entry ``part`` of the step ``key`` is on disk (read or not: ``load`` says whether it is sound)."""
    return _path(f"{key}|{part}").is_file()


def load(key: str, part: str, decode: Callable[[Any], Any]) -> Any | None:
    """The entry ``part`` of the step ``key`` decoded by ``decode``, or ``None`` (absent, or ignored as damaged)."""
    path = _path(f"{key}|{part}")
    try:
        with gzip.open(path, "rt", encoding="utf-8") as file:
            entry = json.load(file)
        if entry.get("format") != FORMAT or entry.get("key") != key or entry.get("part") != part:
            raise ValueError("it was written for another question")
        return decode(entry["value"])
    except FileNotFoundError:
        return None
    except Exception as exc:  # a damaged, foreign or tampered entry: never trusted, traced again
        warn_once(  # once per folder: every entry of a damaged cache is ignored, and one line says so
            f"trace-cache:{path.parent}",
            f"memfit ignored the trace cache entry {path} ({type(exc).__name__}: {str(exc)[:120]}) and traces "
            f"again; delete {path.parent} or set {CACHE_ENV}=off if this repeats",
        )
        with contextlib.suppress(OSError):  # a read-only cache keeps its damaged entry: it is ignored every time
            path.unlink(missing_ok=True)
        return None


def store(key: str, part: str, value: Any) -> None:
    """Write an entry atomically; a cache that cannot be written is skipped silently (it is only a cache)."""
    path = _path(f"{key}|{part}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".part")
        with os.fdopen(handle, "wb") as raw, gzip.open(raw, "wt", encoding="utf-8", compresslevel=3) as file:
            json.dump({"format": FORMAT, "key": key, "part": part, "value": value}, file, separators=(",", ":"))
        os.replace(temporary, path)
    except OSError:
        return


# ----------------------------------------------------------------------------------- traces as data and back

_SYMPY: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        sympy.Add, sympy.Mul, sympy.Pow, sympy.Max, sympy.Min, sympy.Mod, sympy.floor, sympy.ceiling,
        sympy.Eq, sympy.Ne, sympy.Lt, sympy.Le, sympy.Gt, sympy.Ge, sympy.And, sympy.Or, sympy.Not,
        sympy.Piecewise, sympy.functions.elementary.piecewise.ExprCondPair,
    )
}  # fmt: skip


def _torch_functions() -> dict[str, type]:
    from torch.utils._sympy import functions

    return {name: cls for name, cls in vars(functions).items()
            if isinstance(cls, type) and issubclass(cls, sympy.Basic)}  # fmt: skip


def _memfit_functions() -> dict[str, type]:
    from memfit.tracing.cuda_reductions import ReductionStaging

    return {"ReductionStaging": ReductionStaging}


@functools.cache
def _expression_classes() -> dict[str, type]:
    return {**_SYMPY, **_torch_functions(), **_memfit_functions()}


def encode_expr(expr: Any) -> Any:
    """A sympy expression as a tree of lists: integers, symbols with their assumptions, and classes by name."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, sympy.Integer):
        return int(expr)
    if isinstance(expr, sympy.Rational):
        return ["Rational", int(expr.p), int(expr.q)]
    if expr is sympy.true or expr is sympy.false:
        return ["Bool", bool(expr)]
    if isinstance(expr, sympy.Symbol):
        return ["Symbol", expr.name, {k: v for k, v in expr.assumptions0.items() if v is not None}]
    name = type(expr).__name__
    if _expression_classes().get(name) is not type(expr):
        raise Uncacheable(f"the expression class {name} is not one memfit reads back")
    return [name, *(encode_expr(arg) for arg in expr.args)]


def decode_expr(tree: Any) -> Any:
    if isinstance(tree, int) and not isinstance(tree, bool):
        return sympy.Integer(tree)
    if not isinstance(tree, list) or not tree or not isinstance(tree[0], str):
        raise ValueError(f"not an expression: {str(tree)[:60]}")
    head = tree[0]
    if head == "Rational":
        return sympy.Rational(int(tree[1]), int(tree[2]))
    if head == "Bool":
        return sympy.true if tree[1] else sympy.false
    if head == "Symbol":
        assumptions = {str(k): bool(v) for k, v in tree[2].items()}
        return sympy.Symbol(str(tree[1]), **assumptions)
    cls = _expression_classes().get(head)
    if cls is None:
        raise ValueError(f"the expression class {head!r} is not one memfit reads back")
    return cls(*(decode_expr(arg) for arg in tree[1:]))
