"""What one rank of a sharded (FSDP2) run holds: its parameter, gradient and optimizer-state shards, and
the full weights it gathers while it computes. Read from torch 2.13's ``torch/distributed/fsdp/_fully_shard``.

* **Parameters.** ``fully_shard`` splits every parameter on dim 0 into ``world`` chunks of
  ``ceil(dim0 / world)`` rows (``torch.chunk``) and gives every rank storage for a whole chunk, padded
  with zeros where its rows run out (``FSDPParam._init_sharded_param``): each rank holds
  ``ceil(dim0 / world) x (numel / dim0)`` elements per parameter, rank 0 and the last rank alike.
* **Gradients.** The backward reduce-scatters each unit's gradients into one buffer of those padded
  chunks and keeps views of it as the shards' gradients (``foreach_reduce``): the same padded size,
  at the parameters' dtype (fp32; reduced in fp32 under bf16).
* **Optimizer state.** Built by the optimizer from each shard as the rank sees it, without the padding:
  rank ``r`` has ``min(c, dim0 - r c)`` rows (``c = ceil(dim0 / world)``; none past the end), so the
  later ranks may hold less, and rank 0 the most. The estimate is rank 0's unless a rank is asked for.
* **Gathered weights** (the forward/backward phase, an estimate, not byte-exact): the root unit's full
  weights (embeddings, head, final norm) stay gathered from its forward to its backward; under
  ``full_shard`` each block is gathered for its forward and again for its backward, with the next
  block's gather in flight beside it (2 blocks), under ``shard_grad_op`` every block stays gathered from
  forward to backward. One block's unsharded gradients (fp32) wait for their reduce-scatter. Gathered
  weights are bf16 under ``mixed_precision: bf16`` (FSDP's MixedPrecisionPolicy), else fp32.
* **CPU offload** keeps the shards, their gradients and the optimizer state in host memory, so the
  device holds none of them (``host_bytes`` says how much the host does) and the optimizer steps there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from trainer_core.memory.parameters import ModelStructure
from trainer_core.optimizers import TensorInfo
from trainer_core.spec import JobSpec

FP32 = 4
PARAMETERS_FORMULA = "sum over parameters of ceil(dim0 / world) x numel / dim0 x 4 B (each rank's padded shard)"
GRADIENTS_FORMULA = "the parameters' padded shards again (reduce-scatter output), x 4 B"
GATHER_FULL = "root unit + 2 x largest block, gathered whole (x 2 B under bf16, else 4 B) + one block's fp32 gradients"
GATHER_SGO = "root unit + every block, gathered whole (x 2 B under bf16, else 4 B) + one block's fp32 gradients"


@dataclass(frozen=True)
class ShardedLayout:
    """One rank's share of a sharded model."""

    parameter_bytes: int  # padded shards of every parameter
    gradient_bytes: int  # padded shards of every trainable parameter
    local: tuple[TensorInfo, ...]  # the shards as the optimizer sees them (real rows only)
    gather_bytes: int  # forward/backward: weights gathered whole at once, and a block's unsharded gradients
    gather_formula: str
    offloaded: bool  # shards, gradients and optimizer state in host memory


def chunk_rows(dim0: int, world: int) -> int:
    """Rows of each rank's chunk (torch.chunk): the padded shard's first dimension."""
    return math.ceil(dim0 / world)


def rank_rows(dim0: int, world: int, rank: int) -> int:
    """Rows rank ``rank`` really holds of a ``dim0``-row parameter (the last ranks may hold fewer, or none)."""
    chunk = chunk_rows(dim0, world)
    return max(0, min(chunk, dim0 - rank * chunk))


def _dim0(t: TensorInfo) -> tuple[int, int]:
    """(dim 0, elements per row); a 0-dim parameter is one row of one element."""
    dim0 = t.shape[0] if t.shape else 1
    return dim0, (t.numel // dim0 if dim0 else 0)


def padded_shard_numel(t: TensorInfo, world: int) -> int:
    dim0, row = _dim0(t)
    return chunk_rows(dim0, world) * row


def local_shard(t: TensorInfo, world: int, rank: int) -> TensorInfo:
    """``t`` as rank ``rank``'s optimizer sees it: its real rows."""
    dim0, row = _dim0(t)
    rows = rank_rows(dim0, world, rank)
    return dataclasses.replace(t, shape=(rows, *t.shape[1:]), numel=rows * row)


def unit_of(name: str, units: tuple[str, ...]) -> str:
    """The FSDP unit a parameter belongs to: the innermost unit whose name prefixes it, else the root ("")."""
    owners = [u for u in units if name.startswith(u + ".")]
    return max(owners, key=len) if owners else ""


def sharded_layout(structure: ModelStructure, spec: JobSpec, world: int, rank: int) -> ShardedLayout:
    """Rank ``rank``'s shards of ``structure`` trained as ``spec`` (``efficiency.sharding: fsdp``) on ``world``."""
    settings = spec.fsdp_settings
    assert settings is not None, "sharded_layout needs efficiency.sharding: fsdp"
    tensors = structure.tensors
    shard_bytes = 0
    unit_numel: dict[str, int] = {}  # each unit's elements gathered whole (padded shards x world)
    for t in tensors:
        shard = padded_shard_numel(t, world)
        shard_bytes += shard * t.itemsize
        unit = unit_of(t.name, structure.units)
        unit_numel[unit] = unit_numel.get(unit, 0) + shard * world
    gathered = 2 if spec.efficiency.mixed_precision == "bf16" else FP32
    largest_grads = max(unit_numel.values(), default=0) * FP32  # the root's too: a unit's fp32 gradients
    root = unit_numel.pop("", 0)
    blocks = sorted(unit_numel.values(), reverse=True)
    held = sum(blocks[:2]) if settings.strategy == "full_shard" else sum(blocks)
    formula = GATHER_FULL if settings.strategy == "full_shard" else GATHER_SGO
    return ShardedLayout(
        parameter_bytes=shard_bytes,
        gradient_bytes=shard_bytes,
        local=tuple(local_shard(t, world, rank) for t in tensors),
        gather_bytes=(root + held) * gathered + largest_grads,
        gather_formula=formula,
        offloaded=settings.cpu_offload,
    )
