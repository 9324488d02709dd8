"""FSDP2 on a training model: torch's own ``fully_shard``, one way on the CPU (gloo) and on GPUs (nccl).

Accelerate's FSDP plugin is not used: accelerate 1.16 engages it only on accelerator devices and on the
CPU silently trains with DDP instead, so a sharded run could not be tested here. Calling ``fully_shard``
directly is the same engine the plugin calls (``accelerate.utils.fsdp_utils.fsdp2_prepare_model``).

* **Units.** Each module whose class the model names in ``_no_split_modules`` (a decoder layer, BERT's
  layers and embeddings) is its own FSDP unit, then the root takes the rest (embeddings, head, final
  norm). Inner units are sharded first, as ``fully_shard`` requires. The estimator groups parameters by
  the same rule (:func:`sharding_units`), from a model built on the meta device.
* **Precision.** ``bf16`` is FSDP's ``MixedPrecisionPolicy``: weights are gathered in bf16, gradients
  reduced in fp32; the fp32 shards are the master weights. No autocast on top.
* **Checkpoints.** Model and optimizer go to a distributed checkpoint (``torch.distributed.checkpoint``)
  in the checkpoint's ``sharded/`` folder, each rank writing its own shards; loading re-shards, so a
  checkpoint resumes on another world size. The final model is gathered whole and saved by rank 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer_core.spec import JobSpec

SHARDED_DIR = "sharded"  # a checkpoint's distributed-checkpoint folder


def sharding_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module wrapped as its own FSDP unit, in ``named_modules`` order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [(name, module) for name, module in model.named_modules() if name and type(module).__name__ in names]


def shard_model(model: nn.Module, spec: JobSpec, device: torch.device) -> nn.Module:
    """Shard ``model`` in place across every process of the (initialised) default group; returns it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    settings = spec.fsdp_settings
    assert settings is not None, "shard_model needs efficiency.sharding: fsdp"
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    precision = MixedPrecisionPolicy()
    if spec.efficiency.mixed_precision == "bf16":
        precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # Pinned host memory needs an accelerator; on the CPU the shards are plain host tensors already.
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if settings.cpu_offload else OffloadPolicy()
    options: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": settings.strategy == "full_shard",
        "mp_policy": precision,
        "offload_policy": offload,
    }
    for _, unit in reversed(sharding_units(model)):  # innermost first
        fully_shard(unit, **options)
    fully_shard(model, **options)
    return model


def save_sharded(checkpoint: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, gathered: bool = False
                 ) -> None:  # fmt: skip
    """Every rank writes its shards of the model and optimizer under ``checkpoint/sharded`` (collective).

    ``gathered`` (a run of several nodes): the shards are gathered whole into rank 0's host memory and
    rank 0 alone writes them, in the same format. Each node saves to its own disk, so shards written
    per rank would leave every node with part of the checkpoint, and no node could resume from it, nor
    the object store hold it whole. It costs the whole model and optimizer state in rank 0's host memory
    at each save. Loading re-shards either form (:func:`load_sharded`).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True) if gathered else None
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optimizer": optimizer_state}
    if not gathered:
        dcp.save(state, checkpoint_id=str(checkpoint / SHARDED_DIR))
    elif dist.get_rank() == 0:
        dcp.save(state, checkpoint_id=str(checkpoint / SHARDED_DIR), no_dist=True)


def load_sharded(checkpoint: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load ``checkpoint/sharded`` into the sharded ``model`` and ``optimizer``, re-sharding to this world
    size (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    # dcp.load fills the dicts in place (re-sharded to this world size), then they go back in
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(checkpoint / SHARDED_DIR))
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def load_sharded_weights(checkpoint: Path, model: nn.Module) -> None:
    """A sharded checkpoint's model weights, read whole into the unsharded ``model`` by this process alone
    (``init_from``; every rank of a distributed run reads them itself). Raises ValueError when they do not
    fit its tensors (another architecture or head)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    state = model.state_dict()
    try:
        dcp.load({"model": state}, checkpoint_id=str(checkpoint / SHARDED_DIR), no_dist=True)
    except (CheckpointException, RuntimeError) as exc:
        raise ValueError(f"its weights do not fit this run's model: {str(exc)[:300]}") from exc
    model.load_state_dict(state)


def full_model_state(model: nn.Module) -> dict[str, Any]:
    """The whole model's weights on the CPU, gathered from every rank (collective; rank 0 gets them, the
    others an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
