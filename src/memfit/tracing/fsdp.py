"""FSDP (``fully_shard``, FSDP1's ``ShardingStrategy``) as one rank sees it, applied to the traced step.

The documented model used when the step is not traced under real ``fully_shard`` (FSDP1 always; FSDP2 where
the fake-process-group trace is unavailable). Checked against ``torch/distributed/fsdp/_fully_shard`` of
torch 2.13 (``_fsdp_param_group.py``, ``_fsdp_collectives.py``). Units are the model's repeated blocks (found
as activation checkpointing finds them, ``memfit.tracing.checkpointing.find_blocks``), each wrapped, then the
root, as ``fully_shard`` / an auto-wrap policy on the block class is applied in practice. ``G`` is the shard
group: the world size, the ranks of a node for ``fsdp-hybrid`` (HYBRID_SHARD, a 2-D mesh), 1 for NO_SHARD.
``g`` is the bytes of a gathered element: the traced parameter's, which is ``mixed_precision_param_dtype``
(``MixedPrecisionPolicy`` / ``MixedPrecision`` ``param_dtype``) when one is set, since the step is then traced
with its parameters in that dtype (``memfit.prediction.sharded.sharded_settings``: FSDP computes on the 16-bit
copies it gathers, so no copy of an fp32 weight is made or cached for the step; the autocast Lightning and
accelerate add under ``*-mixed`` finds the weights 16-bit already). ``s`` is the bytes of a stored element: what
the parameter is outside FSDP (fp32 under ``32-true`` or ``*-mixed``). Per rank:

* **parameters** (traced storages): ``1/G`` of each, in ``s`` bytes (a trainable one in ``t``: fp32 LoRA adapters
  on a 16-bit base), padded to ``G`` (FSDP2 pads dim 0 of each parameter, FSDP1 each flat parameter); frozen
  parameters are sharded too. ``offload_params``
  (``CPUOffloadPolicy`` / ``CPUOffload(offload_params=True)``) moves them to the host.
* **optimizer state and the optimizer step's temporaries** (traced storages): ``1/G``, scaled from the traced
  ``tg`` (a trainable element in the trace: ``g`` where FSDP casts the parameters, else their own) to ``t``
  bytes, the trainable parameters' stored element (the optimizer steps the stored shards; LoRA keeps fp32
  adapters on a 16-bit base, so ``t`` may differ from ``s``); on the host with either offload.
* **gradients** (sharded in ``t`` bytes), unit by unit (``memfit.tracing.shard_log.UnitSchedule``; the trace
  records which block runs at each event, so a gradient born while block ``b`` runs is its unit's, one born
  outside every block the root's): each
  traced gradient stays whole, in ``g`` bytes, from its birth to its unit's post-backward, which runs right after
  the unit's last gradient is born (the root's at the end of backward: its inputs, token ids, need no gradient, so a
  tied or untied output projection's gradient stays whole through the whole backward). There the previous unit's
  reduce-scatter input is released, the unit's is allocated (its trainable elements padded to ``G``, in the reduce
  dtype: ``g``, FSDP2's default and what Lightning and accelerate configure), the whole gradients are freed, and the
  unit's sharded gradients (``1/G`` in ``s`` bytes, one flat tensor; the reduce-scatter output when ``g == s``, a
  cast of it otherwise, which is on the device only meanwhile) stay until the step frees its gradients. The last
  reduce-scatter input is released at the end of backward. A backward in which no gradient is born (gradients kept
  across steps: accumulation, ``zero_grad`` in place; FSDP2 reduce-scatters every micro batch) is placed by the one
  before it, which it repeats allocation for allocation: autograd's fresh gradient, born where the kept one was,
  stays whole to its unit's post-backward, and the reduce-scatter output is added into the kept shards and goes;
  where the two do not align it holds, from its start to its end, the largest trainable unit's whole gradients and
  reduce-scatter input instead. With ``offload_params`` the sharded gradients go to the host; the whole ones and the
  buffers stay.
* **gathered parameters** (added, placed by the same births, ``UnitSchedule``), in ``g`` bytes: with
  ``reshard_after_forward`` (FULL_SHARD, HYBRID_SHARD), the root's parameters from the start of forward to the end
  of backward (FSDP does not reshard the root after forward); two blocks' while blocks run forward (the one running
  and the previous one's all-gather output, kept until the next copy-out), one block's from the end of the last
  block's forward (its all-gather output, released when the root's forward returns: after the loss of a model that
  computes it) to the end of forward; in backward one block's from its start (the root's pre-backward prefetches the
  last block), two from the last block's backward (the first event of backward a block runs) until the
  second-to-last block in backward order is reduced, then one until the first block is. The last block's forward is
  found to end where the first tensor the root's tail saves for its backward is born. Without it (SHARD_GRAD_OP):
  every parameter stays gathered from the start of forward to the optimizer step. A backward that can be placed by
  neither its own births nor the one before it holds the root's and two blocks' throughout, and its forward two
  blocks' to its end.
* NO_SHARD all-reduces each unit's flat gradient in place: nothing changes but the collective (and the step
  is traced as the precision says, its autocast copies standing for the 16-bit parameters).

``use_orig_params`` and FSDP1's flat parameters hold the same bytes (FSDP1 reduces a flat gradient the size of
the unit). Not modelled: a unit whose inputs need no gradient other than the root (the first block of a model
whose embeddings are frozen, reduced at the end of backward), FSDP2's ``reduce_dtype`` other than the
parameter dtype, the optimizer states of 8-bit optimizers under a 16-bit ``param_dtype`` (scaled as the
others).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from memfit.categories import Category, Phase
from memfit.tracing.shard_log import Buffer, ModelFacts, RankPlan, UnitSchedule, shard_bytes
from memfit.tracing.sharding import ShardingConfig

__all__ = ["fsdp_rank_plan"]


def fsdp_rank_plan(sharding: ShardingConfig, facts: ModelFacts, traced: Mapping[Category, int]) -> RankPlan:
    """One rank's ``RankPlan`` under an ``fsdp*`` strategy; ``traced``: the traced step's bytes per category."""
    group = sharding.shard_group_size
    g, s, t = facts.element_bytes, facts.stored_bytes, facts.trainable_stored_bytes
    tg = facts.trainable_traced_bytes  # a trainable element in the trace: its gradients and state are made like it
    if sharding.strategy == "fsdp-no-shard" or group == 1:
        whole = {"parameters": traced.get(Category.PARAMETERS, 0), "gradients": traced.get(Category.GRADIENTS, 0),
                 "optimizer_state": traced.get(Category.OPTIMIZER_STATE, 0)}  # fmt: skip
        return RankPlan(sharding.strategy, sharding.world_size, terms=whole,
                        notes=("FSDP NO_SHARD: every rank holds everything",))  # fmt: skip
    on_host = sharding.offload_params

    def stored(size: int) -> int:
        """A traced storage of ``g``-byte elements as the run stores it (``s``-byte elements), sharded."""
        return shard_bytes(size * s // g, group, s)

    def stored_trainable(size: int) -> int:
        """The same for a trainable parameter, its gradient (``tg``-byte elements traced, ``t``-byte stored)."""
        return shard_bytes(size * t // tg, group, t)

    def shard(size: int) -> int:
        return 0 if on_host else stored(size)

    def shard_gradient(size: int) -> int:
        return 0 if on_host else stored_trainable(size)

    def state(size: int) -> int:
        return 0 if on_host or sharding.offload_optimizer else shard_bytes(size * t // tg, group, 4)

    units = facts.units
    largest = max((u.numel for u in units), default=0)
    reshard = sharding.reshard_after_forward and sharding.strategy != "fsdp-grad-op" and bool(units)
    gathered = min((facts.root.numel + 2 * largest) * g, facts.numel * g) if reshard else facts.numel * g
    schedule = _schedule(facts, group, g, tg, t, on_host, largest * g if reshard else 0)
    separate = (tg, t) != (g, s)  # trainable parameters traced or stored in other dtypes than the frozen ones
    traced_params = traced.get(Category.PARAMETERS, 0)
    if separate:
        trainable_traced = min(facts.trainable_numel * tg, traced_params)
        params = stored(traced_params - trainable_traced) + stored_trainable(trainable_traced)
    else:
        params = stored(traced_params)
    grads = stored_trainable(traced.get(Category.GRADIENTS, 0))
    states = shard_bytes(traced.get(Category.OPTIMIZER_STATE, 0) * t // tg, group, 4)
    terms = {
        "parameters": 0 if on_host else params,
        "gradients": 0 if on_host else grads,
        "optimizer_state": 0 if on_host or sharding.offload_optimizer else states,
        "gathered_parameters": gathered,
    }
    host = (params + grads + states) if on_host else (states if sharding.offload_optimizer else 0)
    kind = "gathered per unit, resharded after forward" if reshard else "kept gathered from forward to backward"
    dtype = sharding.mixed_precision_param_dtype if g != s else None
    note = (
        f"FSDP over a shard group of {group}: {len(units)} block unit(s) + root, parameters {kind}"
        + (f", gathered and computed in {dtype} (the trace's parameters), stored as {s}-byte shards" if dtype else "")
        + ", gradients reduce-scattered unit by unit"
        + (", parameters, gradients and optimizer state on the host" if on_host else "")
    )
    return RankPlan(
        strategy=sharding.strategy,
        world_size=sharding.world_size,
        resize={Category.PARAMETERS: shard, Category.GRADIENTS: shard_gradient, Category.OPTIMIZER_STATE: state},
        # without resharding after forward every parameter stays gathered to the end of backward
        buffers=() if reshard else (Buffer("gathered parameters", gathered, Phase.FORWARD, end=Phase.OPTIMIZER),),
        step_temporaries=state,
        units=schedule,
        terms=terms,
        host_bytes=host,
        notes=(note,),
        trainable_parameter_sizes=facts.trainable_storage_sizes() if separate else {},
        resize_trainable_parameters=(lambda size: 0 if on_host else stored_trainable(size)) if separate else None,
    )


def _schedule(facts: ModelFacts, group: int, g: int, tg: int, s: int, on_host: bool, unit_bytes: int) -> UnitSchedule:
    """The units' gathered parameters (none with ``unit_bytes`` 0: all stay gathered) and reduce-scatters: input,
    output and sharded gradients, in bytes (module docstring). Gradients are computed in ``tg``-byte elements
    (the trainable parameters' in the trace) and sharded in ``s``-byte ones."""
    padded: dict[int, int] = {}  # unit -> trainable elements, each parameter's dim 0 padded to the group
    for unit, shape in facts.trainable:
        rows = shape[0] if shape else 1
        padded[unit] = padded.get(unit, 0) + math.ceil(rows / group) * group * math.prod(shape[1:])
    largest = max(padded.values(), default=0)
    return UnitSchedule(
        root=len(facts.units),
        input_bytes={unit: n * tg for unit, n in padded.items()},
        output_bytes={unit: n // group * tg for unit, n in padded.items()},
        sharded_bytes={unit: 0 if on_host else n // group * s for unit, n in padded.items()},
        cast=tg != s or on_host,
        root_bytes=facts.root.numel * g if unit_bytes else 0,
        unit_bytes=unit_bytes,
        fallback_bytes=2 * largest * g,
    )
