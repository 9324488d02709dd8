"""``efficiency.sharding`` and its ``efficiency.fsdp`` options: sharded data parallelism (FSDP2).

Kept apart from :mod:`trainer_core.spec` like the preference section: the spec imports it. The run side
is :mod:`trainer_core.sharding`, the estimate :mod:`trainer_core.memory.sharding`.

* ``none``: every process holds the whole model, its gradients and optimizer state (DDP).
* ``fsdp``: torch's ``fully_shard`` splits every parameter on its first dimension across the processes;
  each keeps its own shard of the weights, gradients and optimizer state and gathers a block's full
  weights only while it computes with them.

What sharding does not run yet is refused here, each rule naming the field to change
(:func:`sharding_errors`); nothing is silently trained unsharded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainer_core.spec_base import StrictModel

Sharding = Literal["none", "fsdp"]
ShardingStrategy = Literal["full_shard", "shard_grad_op"]
# The optimizers whose state torch builds per tensor from the shard (bitsandbytes' 8-bit kernels and
# transformers' Adafactor read the full parameter shape).
SHARDED_OPTIMIZERS = ("adamw",)


class FsdpSpec(StrictModel):
    """How ``efficiency.sharding: fsdp`` shards."""

    strategy: ShardingStrategy = Field(
        default="full_shard",
        description="`full_shard` frees each block's gathered weights after its forward and gathers them again for "
        "the backward (least memory); `shard_grad_op` keeps them from forward to backward (one gather less per step, "
        "the whole model's weights held during the step).",
    )  # fmt: skip
    cpu_offload: bool = Field(
        default=False,
        description="Keep the parameter shards, their gradients and the optimizer state in host memory; the "
        "optimizer steps on the CPU. Frees their device memory for a slower step.",
    )


def sharding_errors(
    sharding: str,
    fsdp: FsdpSpec | None,
    *,
    world: int,
    backend: str,
    adapter: bool,
    optimizer: str,
    mixed_precision: str,
    local_sgd: bool,
    preference: bool,
) -> list[tuple[str, str]]:
    """``(field, message)`` for each rule a sharding request breaks (JobSpec raises the first)."""
    if sharding == "none":
        return [("efficiency.fsdp", "applies to efficiency.sharding 'fsdp' only")] if fsdp is not None else []
    rules = [
        (world < 2, "resources.num_processes", "sharding needs 2 or more processes (num_nodes x num_processes)"),
        (backend != "accelerate", "training.backend", "sharding runs on the 'accelerate' backend"),
        (adapter, "adapter", "sharding trains full fine-tunes; LoRA/QLoRA under sharding is not supported yet"),
        (optimizer not in SHARDED_OPTIMIZERS, "optimizer.name",
         f"sharding builds the optimizer state per shard: use one of {', '.join(SHARDED_OPTIMIZERS)}"),
        (mixed_precision == "fp16", "efficiency.mixed_precision",
         "sharding computes in bf16 (fp16 would need a sharded gradient scaler): use 'bf16'"),
        (local_sgd, "efficiency.local_sgd_steps", "local SGD averages whole models; it does not apply to shards"),
        (preference, "method", "preference tuning under sharding is not supported yet"),
    ]  # fmt: skip
    return [(field, message) for broken, field, message in rules if broken]
