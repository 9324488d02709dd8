"""``init_from``: a run that starts from another run's checkpoint folder (trainer_core/spec_init_from.py).

Both backends write checkpoints ``from_pretrained`` loads (trainer_core/backends): full weights with
their ``config.json``, or an adapter (``adapter_model.safetensors`` and ``adapter_config.json``).

* **Full weights** replace the source the model loads from: ``from_pretrained(folder)`` with this run's
  own config, so another task head works as transformers allows (a classifier from an SFT'd causal
  LM: the backbone loads, the new head starts fresh; a head with another label count is re-initialised).
  A run with an adapter puts it on that base. This happens on every start, a resume too: an adapter
  run's own checkpoints do not hold its base.
* **A sharded checkpoint** (``efficiency.sharding: fsdp``: ``sharded/``, no ``model.safetensors``) is read
  whole into the model this run builds, the same architecture and head (a full fine-tune only); its
  optimizer state, split by rank, is not taken over.
* **An adapter** goes onto the adapter this run builds, which must have its rank and targets. Only on a
  fresh start: a resume's own checkpoint holds newer adapter weights.
* **The optimizer state** (``resume_optimizer``), on a fresh start, when every moment has its
  parameter's shape. Its hyperparameters stay this run's, so the learning rate and schedule are its own.

Every problem is a :class:`SpecError` naming an ``init_from`` field, raised before any training step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer_core.spec import FieldError, JobSpec, SpecError
from trainer_core.spec_init_from import adapter_mismatch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
FULL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
SHARDED_METADATA = "sharded/.metadata"  # a sharded run's checkpoint (trainer_core/sharding.py)
# Trainer writes optimizer.pt, Accelerate's save_state optimizer.bin: both torch.save(optimizer.state_dict()).
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")
# The per-parameter optimizer states that have the parameter's own shape (AdamW's moments, SGD's momentum,
# bitsandbytes' 8-bit states): what "the shapes match" compares.
SHAPED_STATES = frozenset({"exp_avg", "exp_avg_sq", "momentum_buffer", "state1", "state2"})


def _error(field: str, message: str) -> SpecError:
    return SpecError([FieldError(f"init_from.{field}", message)])


@dataclass(frozen=True)
class InitSource:
    """A checkpoint folder a run starts from, and what it holds."""

    folder: Path
    adapter: dict[str, Any] | None  # the adapter's config (rank, targets) when it holds an adapter
    sharded: bool = False  # a sharded run's checkpoint: weights read into the built model (load_sharded_weights)

    @property
    def full_weights(self) -> str | None:
        """The folder to load the model from (full weights), or None (an adapter on the spec's own base, or
        sharded weights read into the model once built)."""
        return None if self.adapter is not None or self.sharded else str(self.folder)


def init_source(spec: JobSpec) -> InitSource | None:
    """The checkpoint ``spec.init_from`` names, checked against the spec; None without ``init_from``."""
    init = spec.init_from
    if init is None:
        return None
    if init.path is None:
        raise _error("job", "a job is fetched by the service; to train here, give init_from.path (a checkpoint folder)")
    folder = Path(init.path)
    if not folder.is_dir():
        raise _error("path", f"{folder} is not a folder")
    adapter: dict[str, Any] | None = None
    if (folder / ADAPTER_CONFIG).is_file() and (folder / ADAPTER_WEIGHTS).is_file():
        adapter = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        if (problem := adapter_mismatch(spec.adapter, adapter or {})) is not None:
            raise _error("path", problem)
    elif (folder / SHARDED_METADATA).is_file():
        if spec.adapter is not None:
            raise _error("path", f"{folder} is a sharded run's checkpoint: it starts a full fine-tune, not an adapter")
        if init.resume_optimizer:
            raise _error("resume_optimizer", f"{folder} is a sharded run's checkpoint: its optimizer state is split "
                         "by rank and goes on only by resuming that job")  # fmt: skip
        return InitSource(folder, None, sharded=True)
    elif not any((folder / name).is_file() for name in FULL_WEIGHTS):
        raise _error("path", f"{folder} holds no model weights ({FULL_WEIGHTS[0]}) and no adapter ({ADAPTER_WEIGHTS})")
    elif (folder / "config.json").is_file():
        theirs = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
        mine = _model_type(spec)
        if theirs and mine and theirs != mine:
            raise _error("path", f"the checkpoint is a {theirs!r} model; this spec's model is {mine!r}")
    if init.resume_optimizer and not any((folder / name).is_file() for name in OPTIMIZER_FILES):
        raise _error("resume_optimizer", f"{folder} holds no optimizer state ({' or '.join(OPTIMIZER_FILES)})")
    return InitSource(folder, adapter)


def _model_type(spec: JobSpec) -> str | None:
    if spec.model.config is not None:
        return str(spec.model.config["model_type"])
    from transformers import AutoConfig

    assert spec.model.name_or_path is not None  # ModelSpec: a config or a name

    try:
        return str(AutoConfig.from_pretrained(spec.model.name_or_path, revision=spec.model.revision).model_type)
    except (OSError, ValueError):  # the model's own loading reports this, naming model.name_or_path
        return None


def load_adapter(model: nn.Module, source: InitSource) -> None:
    """The checkpoint's adapter weights into ``model``'s (a PEFT model with the same rank and targets);
    a head the checkpoint has in another shape (another task or label count) keeps its fresh init."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(source.folder / ADAPTER_WEIGHTS))
    own = get_peft_model_state_dict(model)  # type: ignore[arg-type]
    fitting = {key: value for key, value in saved.items() if key in own and own[key].shape == value.shape}
    missing = [key for key in own if "lora_" in key and key not in fitting]
    if missing:
        raise _error("path", f"the checkpoint's adapter lacks {len(missing)} of this run's LoRA tensors ({missing[0]})")
    set_peft_model_state_dict(model, fitting)  # type: ignore[arg-type]


def load_init_weights(model: nn.Module, source: InitSource) -> None:
    """A sharded checkpoint's weights into the model this run built (see the module docstring)."""
    from trainer_core.sharding import load_sharded_weights

    try:
        load_sharded_weights(source.folder, model)
    except ValueError as exc:
        raise _error("path", f"{source.folder} is a sharded run's checkpoint; {exc}") from exc


def load_optimizer_state(optimizer: torch.optim.Optimizer, source: InitSource) -> None:
    """The checkpoint's optimizer state into ``optimizer`` (built by this run for the same trainable
    parameters), keeping this run's hyperparameters: its learning rate, betas and schedule."""
    file = next(source.folder / name for name in OPTIMIZER_FILES if (source.folder / name).is_file())
    saved = torch.load(file, map_location="cpu", weights_only=True)
    if (problem := _state_mismatch(optimizer, saved)) is not None:
        raise _error("resume_optimizer", f"the checkpoint's optimizer state does not fit this run: {problem}")
    own = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, settings in zip(optimizer.param_groups, own, strict=True):
        # Exactly this run's settings: a saved `initial_lr` (the other run's scheduler's) would make this
        # run's scheduler, which keeps a group's initial_lr when there is one, follow the old rate.
        params = group["params"]
        group.clear()
        group.update(settings, params=params)


def _state_mismatch(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> str | None:
    groups = saved.get("param_groups") or []
    if len(groups) != len(optimizer.param_groups):
        return f"{len(groups)} parameter groups, this run has {len(optimizer.param_groups)}"
    params = [p for group in optimizer.param_groups for p in group["params"]]
    counts = [len(group["params"]) for group in groups]
    if counts != [len(group["params"]) for group in optimizer.param_groups]:
        return f"{sum(counts)} parameters, this run trains {len(params)}"
    for index, state in (saved.get("state") or {}).items():
        shape = tuple(params[int(index)].shape)
        for name, value in state.items():
            if name in SHAPED_STATES and isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
                return f"parameter {index}'s {name} is {tuple(value.shape)}, the parameter {shape}"
    return None
