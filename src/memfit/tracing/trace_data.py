"""A finished trace as plain data and back, for the trace cache (``memfit.tracing.trace_cache``).

Only what the replays and the depth builder read is kept: the storage log (events, sizes, categories, phases,
marks, blocks, scratch, ownership) and what the tracer learnt. Sizes that are expressions in the batch (and
sequence length) travel as expression trees; nothing is pickled.
"""

from __future__ import annotations

from typing import Any

import sympy

from memfit.categories import Category, Phase
from memfit.tracing.cuda_reductions import GridLimits
from memfit.tracing.cuda_scratch import CudaTarget
from memfit.tracing.paged import PagedState
from memfit.tracing.recorder import PhaseMark, StorageRecorder
from memfit.tracing.symbolic import SequenceSymbol, SymbolicTrace
from memfit.tracing.trace_cache import decode_expr, encode_expr
from memfit.tracing.tracer import StepTrace

__all__ = ["decode_symbolic", "decode_trace", "encode_symbolic", "encode_trace"]


def _size(value: Any) -> Any:
    return value if isinstance(value, int) else ["x", encode_expr(value)]


def _unsize(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, list) and len(value) == 2 and value[0] == "x":
        return decode_expr(value[1])
    raise ValueError("a storage size is neither bytes nor an expression")


def _pairs(mapping: dict[int, Any], encode: Any = lambda v: v) -> list[list[Any]]:
    return [[k, encode(v)] for k, v in mapping.items()]


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"expected an integer, got {type(value).__name__}")
    return value


def encode_trace(trace: StepTrace) -> dict[str, Any]:
    recorder = trace.recorder
    target = recorder.cuda_target
    paged = trace.paged
    return {
        "batch_size": trace.batch_size,
        "checkpointing": trace.checkpointing,
        "substitutions": _pairs(trace.substitutions),
        "ops": trace.ops,
        "compiled": trace.compiled,
        "paged": None if paged is None else [paged.total_bytes, paged.largest_bytes],
        "blocks": trace.blocks,
        "seq_len": trace.seq_len,
        "recorder": {
            "workspace_bytes": recorder.workspace_bytes,
            "cuda_target": [
                list(target.compute_capability),
                target.grid.multiprocessors,
                target.grid.max_threads_per_multiprocessor,
            ],
            "events": recorder.events,
            "sizes": _pairs(recorder.sizes, _size),
            "categories": _pairs(recorder.categories, lambda c: c.value),
            "alloc_phase": _pairs(recorder.alloc_phase),
            "marks": [[m.event_index, m.step, m.phase.value] for m in recorder.marks],
            "ops": recorder.ops,
            "event_blocks": recorder.event_blocks,
            "scratch": sorted(recorder.scratch),
            "scratch_kinds": _pairs(recorder.scratch_kinds),
            "claimed_by": _pairs(recorder.claimed_by),
            "derived_from": _pairs(recorder.derived_from),
            "sums_in_place": _pairs(recorder.sums_in_place),
        },
    }


def decode_trace(data: dict[str, Any]) -> StepTrace:
    saved = data["recorder"]
    capability, multiprocessors, threads = saved["cuda_target"]
    recorder = StorageRecorder(
        workspace_bytes=_int(saved["workspace_bytes"]),
        cuda_target=CudaTarget(tuple(_int(v) for v in capability), GridLimits(_int(multiprocessors), _int(threads))),
    )
    recorder.events = [_int(e) for e in saved["events"]]
    recorder.sizes = {_int(k): _unsize(v) for k, v in saved["sizes"]}
    recorder.categories = {_int(k): Category(v) for k, v in saved["categories"]}
    recorder.alloc_phase = {_int(k): _int(v) for k, v in saved["alloc_phase"]}
    recorder.marks = [PhaseMark(_int(i), _int(s), Phase(p)) for i, s, p in saved["marks"]]
    recorder.ops = _int(saved["ops"])
    blocks = saved["event_blocks"]
    recorder.event_blocks = None if blocks is None else [None if b is None else _int(b) for b in blocks]
    recorder.scratch = {_int(s) for s in saved["scratch"]}
    recorder.scratch_kinds = {str(k): _int(v) for k, v in saved["scratch_kinds"]}
    recorder.claimed_by = {_int(k): _int(v) for k, v in saved["claimed_by"]}
    recorder.derived_from = {_int(k): _int(v) for k, v in saved["derived_from"]}
    recorder.sums_in_place = {_int(k): _int(v) for k, v in saved["sums_in_place"]}
    recorder._closed = True
    paged = None
    if data["paged"] is not None:
        paged = PagedState(_int(data["paged"][0]), _int(data["paged"][1]))
    return StepTrace(
        batch_size=_int(data["batch_size"]),
        recorder=recorder,
        checkpointing=data["checkpointing"] if isinstance(data["checkpointing"], (str, type(None))) else None,
        substitutions={str(k): _int(v) for k, v in data["substitutions"]},
        ops=_int(data["ops"]),
        compiled=bool(data["compiled"]),
        paged=paged,
        blocks=_int(data["blocks"]),
        seq_len=None if data["seq_len"] is None else _int(data["seq_len"]),
    )


def encode_symbolic(symbolic: SymbolicTrace) -> dict[str, Any]:
    seq = symbolic.seq
    return {
        "trace": encode_trace(symbolic.trace),
        "symbol": encode_expr(symbolic.symbol),
        "hint": symbolic.hint,
        "guards": [encode_expr(g) for g in symbolic.guards],
        "lower": symbolic.lower,
        "upper": symbolic.upper,
        "seq": None if seq is None else [encode_expr(seq.symbol), seq.hint, seq.lower, seq.upper],
        "seq_len": symbolic.seq_len,
    }


def decode_symbolic(data: dict[str, Any]) -> SymbolicTrace:
    symbol = decode_expr(data["symbol"])
    if not isinstance(symbol, sympy.Symbol):
        raise ValueError("the batch symbol is not a symbol")
    seq = None
    if data["seq"] is not None:
        seq_symbol, hint, lower, upper = data["seq"]
        seq = SequenceSymbol(decode_expr(seq_symbol), _int(hint), _int(lower), None if upper is None else _int(upper))
    upper = data["upper"]
    return SymbolicTrace(
        trace=decode_trace(data["trace"]),
        symbol=symbol,
        hint=_int(data["hint"]),
        guards=tuple(decode_expr(g) for g in data["guards"]),
        lower=_int(data["lower"]),
        upper=None if upper is None else _int(upper),
        seq=seq,
        seq_len=None if data["seq_len"] is None else _int(data["seq_len"]),
    )
