"""Well-known public architectures, built on the ``meta`` device from their published configs.

No weights are ever materialised or downloaded: the config values below are the published
architecture facts (layers, widths, heads, vocabulary), and the model is built under
``torch.device("meta")`` so a 8B model costs no memory. Each preset also knows what a batch of
it looks like (token ids, or images).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import json
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.errors import InvalidInputError, TraceError

__all__ = ["PRESETS", "ModelSpec", "factory_loss", "from_factory", "from_hf_config", "load_attribute"]

Batch = Callable[[int], Any]
LossFn = Callable[[Any, Any], torch.Tensor]

# The loss the command line's --loss names, for the factories loaded while it is set (see ``factory_loss``).
_FACTORY_LOSS: ContextVar[tuple[LossFn, str] | None] = ContextVar("memfit_factory_loss", default=None)


@dataclass(frozen=True)
class ModelSpec:
    """A model to plan and how to make a batch of it."""

    name: str
    model: nn.Module
    sample: Batch


# name -> (transformers config class, its published arguments, task)
PRESETS: dict[str, tuple[str, dict[str, Any], str]] = {
    "gpt2": ("GPT2Config", {}, "causal-lm"),
    "bert-base": ("BertConfig", {}, "masked-lm"),
    "t5-base": ("T5Config", {"d_model": 768, "d_ff": 3072, "num_layers": 12, "num_heads": 12, "d_kv": 64,
                             "vocab_size": 32128, "decoder_start_token_id": 0, "pad_token_id": 0}, "seq2seq-lm"),
    "llama-3-8b": ("LlamaConfig", {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                                   "max_position_embeddings": 8192, "rope_theta": 500000.0}, "causal-lm"),
    "mistral-7b": ("MistralConfig", {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32768,
                                     "max_position_embeddings": 32768, "sliding_window": None}, "causal-lm"),
    "qwen2.5-7b": ("Qwen2Config", {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                                   "max_position_embeddings": 32768, "tie_word_embeddings": False}, "causal-lm"),
    "llama-3-70b": ("LlamaConfig", {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                                    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                                    "max_position_embeddings": 8192, "rope_theta": 500000.0}, "causal-lm"),
    "llama-2-70b": ("LlamaConfig", {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                                    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000,
                                    "max_position_embeddings": 4096}, "causal-lm"),
    "qwen2.5-72b": ("Qwen2Config", {"hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                                    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064,
                                    "max_position_embeddings": 32768, "tie_word_embeddings": False}, "causal-lm"),
    "vit-base": ("ViTConfig", {}, "image-classification"),
}  # fmt: skip

_TASK_MODELS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
}


def from_hf_config(
    name_or_path: str, *, seq_len: int = 1024, image_size: int | None = None, layers: int | None = None
) -> ModelSpec:
    """A preset name (``llama-3-8b``) or a local ``config.json`` (or a folder holding one)."""
    transformers = _transformers()
    key = name_or_path.lower()
    if key in PRESETS:
        class_name, arguments, task = PRESETS[key]
        config = getattr(transformers, class_name)(**arguments)
    else:
        path = Path(name_or_path)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            close = difflib.get_close_matches(key, list(PRESETS), n=1, cutoff=0.8)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise InvalidInputError(
                f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file; {hint}"
                "memfit never downloads configs"
            )
        config = _config_from(transformers, path)
        task = _task_of(config)
    if layers is not None:
        _set_depth(config, layers)
    if image_size is not None and hasattr(config, "image_size"):
        config.image_size = image_size
    _built_in_fp32(config)
    with torch.device("meta"):
        model = getattr(transformers, _TASK_MODELS[task]).from_config(config)
    return ModelSpec(name_or_path, model, _sample_for(task, config, seq_len, image_size))


def _built_in_fp32(config: Any) -> None:
    """Build the weights in fp32 whatever dtype the config was saved in (``"torch_dtype": "bfloat16"`` in
    most published LLM configs): transformers builds a model in its config's dtype, and memfit's precision
    decides the run's dtypes (``bf16-mixed`` keeps fp32 weights, ``bf16-true`` casts them)."""
    field = "dtype" if "dtype" in dir(type(config)) or "dtype" in vars(config) else "torch_dtype"
    setattr(config, field, torch.float32)


def load_attribute(target: str, option: str, what: str) -> Any:
    """What ``package.module:name`` names in the user's code (``option`` says which flag gave it, ``what`` what it
    should be); each way it can fail is one ``InvalidInputError`` naming ``target``."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise InvalidInputError(f"{option} must look like 'package.module:{what}', got {target!r}")
    said = "" if option == "--model" else f"{option} "
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise InvalidInputError(
            f"cannot load {said}{target!r}: {error}; run memfit from the folder that holds it, or add that folder to "
            "PYTHONPATH"
        ) from error
    except Exception as error:  # the module itself raised while importing
        raise InvalidInputError(
            f"cannot load {said}{target!r}: importing {module_name} raised {_said(error)}"
        ) from error
    if not hasattr(module, attribute):
        raise InvalidInputError(f"cannot load {said}{target!r}: module {module_name!r} has no attribute {attribute!r}")
    return getattr(module, attribute)


def from_factory(target: str, *, seq_len: int = 1024, loss_fn: LossFn | None = None) -> ModelSpec:
    """``module.path:factory`` from the user's code: ``factory()`` returns a module, or a
    ``(module, sample)`` pair where ``sample(batch_size)`` makes one batch; a bare module gets
    ``input_ids``/``labels`` token batches of ``seq_len``. Whatever goes wrong in the user's code
    comes back as one ``InvalidInputError`` naming ``target``.

    ``loss_fn(output, batch) -> scalar loss`` (default: the one ``factory_loss`` set, the command line's
    ``--loss``) makes the module's forward return that loss, for a module whose forward returns logits."""
    factory = load_attribute(target, "--model", "factory")
    if not callable(factory):
        raise InvalidInputError(
            f"{target} is {type(factory).__name__}, not a function: --model names a function that takes no "
            "arguments and returns a module or (module, sample)"
        )
    _check_no_arguments(factory, target)
    try:
        made = factory()
    except Exception as error:
        raise InvalidInputError(f"{target}() raised {_said(error)}; memfit calls it to build the model") from error
    if isinstance(made, tuple) and len(made) != 2:
        raise InvalidInputError(
            f"{target} returned a tuple of {len(made)} items; return a module or (module, sample), where "
            "sample(batch_size) makes one batch"
        )
    model, sample = made if isinstance(made, tuple) else (made, None)
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"{target} returned {type(model).__name__}, not a torch.nn.Module")
    if sample is not None and not callable(sample):
        raise InvalidInputError(
            f"{target} returned (module, {type(sample).__name__}); the sample must be a function batch_size -> "
            "batch, e.g. lambda batch_size: torch.zeros(batch_size, 16)"
        )
    if sample is None:
        vocab = getattr(getattr(model, "config", None), "vocab_size", 1000)
        sample = _tokens(vocab, seq_len)
    given = (loss_fn, getattr(loss_fn, "__qualname__", repr(loss_fn))) if loss_fn is not None else None
    if (loss := given or _FACTORY_LOSS.get()) is not None:
        sample = _with_loss(model, sample, *loss)
    return ModelSpec(target, model, sample)


@contextlib.contextmanager
def factory_loss(loss_fn: LossFn | None, name: str = "") -> Iterator[None]:
    """Within it, ``from_factory`` makes each module it loads return ``loss_fn(output, batch)``: the command
    line's ``--loss`` (``name``, as the user wrote it, is what its errors say), for planners that load the factory
    themselves."""
    token = _FACTORY_LOSS.set((loss_fn, name or getattr(loss_fn, "__qualname__", "loss")) if loss_fn else None)
    try:
        yield
    finally:
        _FACTORY_LOSS.reset(token)


class _ForwardWithLoss:
    """``model.forward`` followed by the loss: the module called with a batch as a training loop calls it
    (``**dict``, ``*tuple``, the tensor itself) returns ``loss_fn(output, batch)``, the same batch, rebuilt from
    the call as its sample made it. Under ``no_grad`` (a forward-only plan) the output is returned as it is."""

    def __init__(self, forward: Callable[..., Any], loss_fn: LossFn, name: str, kind: list[type]) -> None:
        self.forward, self.loss_fn, self.name, self.kind = forward, loss_fn, name, kind

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = self.forward(*args[: self._inputs(len(args))], **kwargs)
        if not torch.is_grad_enabled():
            return output
        batch = self._batch(args, kwargs)
        try:
            loss = self.loss_fn(output, batch)
        except Exception as error:
            from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

            if isinstance(error, (DataDependentOutputException, DynamicOutputShapeException)):
                raise  # values a fake-tensor trace lacks: the trace says what that means
            raise TraceError(
                f"the --loss function {self.name} raised {_said(error)}; memfit calls it as {self.name}(output, "
                f"batch) with what the module returned and the batch it was called with"
            ) from error
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TraceError(f"the --loss function {self.name} returned {what}, not a scalar loss; reduce it (.mean())")
        return loss

    def _inputs(self, given: int) -> int:
        """How many of a tuple batch's items the forward takes: an ``(inputs, labels)`` batch, as a plain or Lightning
        loop unpacks it, calls ``forward(inputs)``, and the labels reach the loss only."""
        try:
            parameters = inspect.signature(self.forward).parameters.values()
        except (TypeError, ValueError):  # no signature to read: the forward takes what it is given
            return given
        if any(p.kind is p.VAR_POSITIONAL for p in parameters):
            return given
        positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)
        return min(given, max(positional, 1))

    def _batch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kind = self.kind[0] if self.kind else (Mapping if kwargs else tuple if len(args) != 1 else torch.Tensor)
        if issubclass(kind, Mapping):
            return dict(kwargs)
        if issubclass(kind, (list, tuple)):
            return list(args) if issubclass(kind, list) else tuple(args)
        return args[0]


def _with_loss(model: nn.Module, sample: Batch, loss_fn: LossFn, name: str) -> Batch:
    """Make ``model``'s forward return ``loss_fn(output, batch)`` (once, however often the factory hands back the
    same module), and the sample that tells it how the batch was shaped."""
    kind: list[type] = []
    own = vars(model).get("forward")
    forward = own.forward if isinstance(own, _ForwardWithLoss) else model.forward
    model.forward = _ForwardWithLoss(forward, loss_fn, name, kind)  # type: ignore[method-assign]

    def shaped(batch_size: int) -> Any:
        batch = sample(batch_size)
        kind[:] = [type(batch)]
        return batch

    return shaped


def _check_no_arguments(factory: Callable[..., Any], target: str) -> None:
    """memfit calls the factory with no arguments: say which ones it would need instead of a TypeError."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read (a builtin): calling it tells
        return
    try:
        signature.bind()
    except TypeError:
        required = [name for name, p in signature.parameters.items()
                    if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]  # fmt: skip
        raise InvalidInputError(
            f"{target} needs arguments ({', '.join(required)}) but memfit calls it with no arguments; give them "
            "defaults, or point --model at a function without arguments that calls it"
        ) from None


def _said(error: BaseException) -> str:
    """``Type: message`` of an exception, on one line."""
    detail = " ".join(str(error).split())
    return f"{type(error).__name__}: {detail}" if detail else type(error).__name__


def _config_from(transformers: Any, path: Path) -> Any:
    """A transformers config from a config.json, each way it can be wrong said in one line naming the file."""
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise InvalidInputError(
            f"{path} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
        ) from error
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidInputError(f"cannot read {path}: {_said(error)}") from error
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise InvalidInputError(f"{path} has no model_type; is it a transformers config.json?")
    model_type = raw["model_type"]
    known = list(transformers.CONFIG_MAPPING.keys())
    if model_type not in known:
        close = difflib.get_close_matches(str(model_type), known, n=3)
        hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
        raise InvalidInputError(
            f"{path}: transformers {transformers.__version__} knows no model_type {model_type!r}; {hint}check "
            "the spelling, or upgrade transformers if the architecture is newer"
        )
    try:
        config = transformers.AutoConfig.for_model(**raw)
    except Exception as error:
        raise InvalidInputError(
            f"{path}: transformers cannot make a {model_type} config of it ({_said(error)})"
        ) from error
    _warn_of_defaulted_sizes(path, raw, config)
    return config


# the sizes that decide a transformer's memory, by transformers' common names (``attribute_map`` renames them)
_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def _warn_of_defaulted_sizes(path: Path, raw: Mapping[str, Any], config: Any) -> None:
    """One warning naming each size the file leaves out, which transformers fills from its class's defaults (a
    0.5B config without its hidden size is planned as its family's default, often billions of parameters)."""
    renamed = getattr(type(config), "attribute_map", {}) or {}
    missing = []
    for name in _SIZES:
        field = renamed.get(name, name)
        if (name in raw or field in raw) or not hasattr(config, field):
            continue
        missing.append(f"{field} {getattr(config, field)}")
    if missing:
        from memfit.diagnostics import warn_once

        warn_once(
            f"defaulted-sizes:{path}",
            f"{path} gives no {', '.join(m.split()[0] for m in missing)}: transformers' {type(config).__name__} "
            f"defaults were used ({', '.join(missing)}); write the model's own sizes in the file",
        )


def _task_of(config: Any) -> str:
    """The head a config is built with. An encoder-decoder's is its sequence-to-sequence LM, never a causal LM
    (BART has one of its decoder alone, Whisper too: not the model the config describes)."""
    transformers = _transformers()
    tasks = list(_TASK_MODELS)
    if getattr(config, "is_encoder_decoder", False):
        tasks = ["seq2seq-lm", *(task for task in tasks if task not in ("seq2seq-lm", "causal-lm"))]
    for task in tasks:
        mapping = getattr(transformers, _TASK_MODELS[task])._model_mapping
        if type(config) in mapping:
            return task
    raise InvalidInputError(
        f"memfit builds no causal-LM, masked-LM, seq2seq or image-classification head for {type(config).__name__} "
        "from a config: plan it with --model module:factory (a function returning the model and a sample batch; "
        "see memfit plan --help)"
    )


def _set_depth(config: Any, layers: int) -> None:
    for attribute in ("num_hidden_layers", "n_layer", "num_layers"):
        if hasattr(config, attribute):
            setattr(config, attribute, layers)
    if hasattr(config, "num_decoder_layers"):
        config.num_decoder_layers = layers


def _tokens(vocab: int, seq_len: int) -> Batch:
    def make(batch: int) -> dict[str, torch.Tensor]:
        ids = torch.zeros(batch, seq_len, dtype=torch.long)  # values never matter to a fake-tensor trace
        return {"input_ids": ids, "labels": ids}

    return make


def _sample_for(task: str, config: Any, seq_len: int, image_size: int | None) -> Batch:
    if task == "image-classification":
        side = image_size or getattr(config, "image_size", 224)
        channels = getattr(config, "num_channels", 3)
        return lambda batch: {
            "pixel_values": torch.zeros(batch, channels, side, side),
            "labels": torch.zeros(batch, dtype=torch.long),
        }
    return _tokens(config.vocab_size, seq_len)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise InvalidInputError("--hf-config needs transformers: pip install 'memfit[hf]'") from error
    return transformers
