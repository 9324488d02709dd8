"""The model's real structure, built on the meta device from its config alone, and cached.

:func:`model_structure` resolves the config the way a run does (catalog id, local directory, inline
config, or a hub id fetched as a config), sets the label count, and instantiates the very class
training builds (``trainer_core.modeling.MODEL_CLASSES``) under ``accelerate.init_empty_weights``:
no weights are allocated or downloaded, yet every tensor's shape is exact. The result is cached per
(config, task, label count), so a warm estimate costs a dictionary lookup.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, TypeVar

from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.modeling_utils import PreTrainedModel  # eager: warms up what the first estimate needs
from transformers.pytorch_utils import Conv1D

from trainer_core.memory.catalog import catalog_config, catalog_ids, in_catalog
from trainer_core.memory.linears import LinearInfo, linear_modules
from trainer_core.modeling import MASTER_DTYPE, MODEL_CLASSES, config_from_dict, label_config
from trainer_core.optimizers import TensorInfo
from trainer_core.sharding import sharding_units
from trainer_core.spec import FieldError, ModelSpec, SpecError
from trainer_core.torch_optim import decay_parameter_names, embedding_modules

logger = logging.getLogger(__name__)

# Modules whose weights autocast casts to 16-bit for their matmul/conv (norms and embeddings stay fp32).
_AUTOCAST_MODULES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, Conv1D)


# A source key says where a config comes from: ("config", json), ("dir", path, mtime), ("catalog", id)
# or ("hub", id, revision). It is what the cache is keyed by, together with task and label count.
SourceKey = tuple[str, ...]
_T = TypeVar("_T")
# init_empty_weights patches nn.Module globally while it is open; two threads (the API's threadpool)
# opening it at once could leave the patch in place, so meta builds take turns.
_META_BUILD_LOCK = threading.Lock()


class UnknownModelError(SpecError):
    """A model name that is neither in the catalog, nor a local directory, nor reachable on the hub."""

    def __init__(self, name: str, reason: str):
        message = (
            f"unknown model {name!r}: {reason}. Use a catalog id (see `catalog_ids()`, e.g. "
            f"{catalog_ids()[0]!r}), a local directory holding config.json, or `model.config`"
        )
        super().__init__([FieldError("model.name_or_path", message, "unknown_model")])


@dataclass(frozen=True)
class ModelStructure:
    """What the estimator needs to know about a model, independent of batch and optimizer."""

    source: str
    task: str
    num_labels: int
    model_type: str
    config: PretrainedConfig
    tensors: tuple[TensorInfo, ...]  # trainable parameters, tied weights once, in named_parameters order
    parameters: int  # all parameters, trainable or not
    attn_implementation: str  # "sdpa", "eager", ...: whether the score matrix is stored
    supports_gradient_checkpointing: bool
    linears: tuple[LinearInfo, ...] = ()  # what LoRA targets and QLoRA quantises
    units: tuple[str, ...] = ()  # the modules FSDP shards as units of their own (trainer_core/sharding.py)
    # Figures derived from `tensors` for one setting (e.g. an optimizer's state), computed once per
    # structure: the structure is cached, and re-adding ~200 tensors was most of a warm estimate.
    memo: dict[Hashable, Any] = field(default_factory=dict, compare=False, repr=False)

    # cached_property writes the instance __dict__ directly, which a frozen dataclass allows.
    @cached_property
    def trainable_parameters(self) -> int:
        return sum(t.numel for t in self.tensors)

    @cached_property
    def trainable_bytes(self) -> int:
        """Bytes of the trainable parameters at the dtype training builds them in."""
        return sum(t.numel * t.itemsize for t in self.tensors)

    @cached_property
    def autocast_numel(self) -> int:
        """Elements of the parameters autocast copies to 16 bits (Linear / Conv weights and biases)."""
        return sum(t.numel for t in self.tensors if t.autocast)

    def memoized(self, key: Hashable, compute: Callable[[], _T]) -> _T:
        """``compute()``, once per ``key``; the key must name everything ``compute`` reads but the structure.

        Two threads may both compute a missing key; they get equal values.
        """
        try:
            value: _T = self.memo[key]
        except KeyError:
            value = self.memo[key] = compute()
        return value


def source_key(model: ModelSpec) -> SourceKey:
    """Where the config comes from, as a hashable cache key (cheap: no config is loaded)."""
    if model.config is not None:
        return ("config", json.dumps(model.config, sort_keys=True, default=str))
    name = model.name_or_path
    assert name is not None  # ModelSpec guarantees one of the two
    config_file = Path(name) / "config.json"
    if config_file.is_file():
        return ("dir", str(config_file.parent.resolve()), str(config_file.stat().st_mtime_ns))
    if in_catalog(name):
        return ("catalog", name)
    return ("hub", name, model.revision or "")


def describe_source(key: SourceKey) -> str:
    """A short name of the model for reports."""
    if key[0] == "config":
        return f"config:{json.loads(key[1]).get('model_type', '?')}"
    return key[1]


@lru_cache(maxsize=256)
def load_config(key: SourceKey) -> PretrainedConfig:
    """The config behind ``key``; hub ids go through transformers' own cache and offline rules."""
    kind = key[0]
    if kind == "config":
        try:
            return config_from_dict(json.loads(key[1]))
        except (ValueError, KeyError, TypeError) as exc:  # unknown model_type, bad values
            raise SpecError([FieldError("model.config", f"not a valid transformers config: {exc}")]) from exc
    if kind == "dir":
        return AutoConfig.from_pretrained(key[1])
    if kind == "catalog":
        return config_from_dict(catalog_config(key[1]))
    name, revision = key[1], key[2] or None
    try:
        return AutoConfig.from_pretrained(name, revision=revision)
    except (OSError, ValueError) as exc:
        from huggingface_hub.constants import is_offline_mode

        reason = "not in the catalog and the hub is offline (HF_HUB_OFFLINE=1)" if is_offline_mode() else str(exc)
        raise UnknownModelError(name, reason) from exc


def default_num_labels(key: SourceKey) -> int:
    """Labels the estimate assumes: the config's own ``num_labels`` / ``id2label`` if it sets them, else 2.

    The estimator never reads the dataset (the API may not see it), so the label count comes from here
    or from the caller.
    """
    if key[0] == "config":
        values = json.loads(key[1])
        if "num_labels" in values:
            return int(values["num_labels"])
        if "id2label" in values:
            return len(values["id2label"])
        return 2
    return int(load_config(key).num_labels or 2)


def build_structure(key: SourceKey, task: str, num_labels: int) -> ModelStructure:
    """Instantiate the training class on the meta device and record its tensors (not cached: see
    :func:`model_structure`)."""
    config = load_config(key).__class__.from_dict(load_config(key).to_dict())  # private copy
    if task != "causal-lm":  # a language model's "labels" are its vocabulary
        for name, value in label_config([str(i) for i in range(num_labels)]).items():
            setattr(config, name, value)
    try:
        with _META_BUILD_LOCK, init_empty_weights():
            model: PreTrainedModel = MODEL_CLASSES[task].from_config(config, dtype=MASTER_DTYPE)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):  # no class of this type for the task
            message = f"{config.model_type} models cannot be trained for {task}"
            raise SpecError([FieldError("task", message, "invalid_combination")]) from exc
        field = "model.config" if key[0] == "config" else "model.name_or_path"
        raise SpecError([FieldError(field, f"the model cannot be built from its config: {exc}")]) from exc
    model.tie_weights()  # inside init_empty_weights, re-registered meta parameters undo from_config's tying
    decay = decay_parameter_names(model)
    embeddings = {id(m.weight) for m in embedding_modules(model)}
    autocast = {id(p) for m in model.modules() if isinstance(m, _AUTOCAST_MODULES) for p in m.parameters(recurse=False)}
    tensors = tuple(
        TensorInfo(
            name=name,
            shape=tuple(param.shape),
            numel=param.numel(),
            itemsize=param.element_size(),
            decay=name in decay,
            embedding=id(param) in embeddings,
            autocast=id(param) in autocast,
        )
        for name, param in model.named_parameters()
        if param.requires_grad
    )
    attn = str(getattr(model.config, "_attn_implementation", None) or "eager")
    logger.debug("built %s for %s with %d labels on meta", config.model_type, task, num_labels)
    return ModelStructure(
        source=describe_source(key),
        task=task,
        num_labels=int(config_value(model.config, "vocab_size")) if task == "causal-lm" else num_labels,
        model_type=str(config.model_type),
        config=model.config,
        tensors=tensors,
        parameters=sum(p.numel() for p in model.parameters()),
        attn_implementation=attn,
        supports_gradient_checkpointing=bool(model.supports_gradient_checkpointing),
        linears=linear_modules(model, task),
        units=tuple(name for name, _ in sharding_units(model)),
    )


StructureArgs = tuple[SourceKey, str, int | None]


@dataclass
class CacheInfo:
    hits: int
    misses: int
    size: int


class StructureCache:
    """Built structures by (source key, task, label count as asked), least recently used dropped first.

    Unlike ``lru_cache`` it can be asked without building (:meth:`peek`: the API answers a warm
    estimate on its event loop and hands only cold ones to a thread), and simultaneous misses on
    one key build once: the first caller builds under that key's lock, the others wait and hit.
    """

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: OrderedDict[StructureArgs, ModelStructure] = OrderedDict()
        self._lock = threading.Lock()  # guards _items, _building and the counters
        self._building: dict[StructureArgs, threading.Lock] = {}
        self.hits = self.misses = 0

    def peek(self, args: StructureArgs) -> ModelStructure | None:
        with self._lock:
            structure = self._items.get(args)
            if structure is not None:
                self._items.move_to_end(args)
                self.hits += 1
            return structure

    def get(self, args: StructureArgs, build: Callable[[], ModelStructure]) -> ModelStructure:
        structure = self.peek(args)
        if structure is not None:
            return structure
        with self._lock:
            key_lock = self._building.setdefault(args, threading.Lock())
        try:
            with key_lock:
                structure = self.peek(args)  # built while this caller waited
                if structure is not None:
                    return structure
                structure = build()
                with self._lock:
                    self.misses += 1
                    self._items[args] = structure
                    while len(self._items) > self.maxsize:
                        self._items.popitem(last=False)
                return structure
        finally:
            with self._lock:
                self._building.pop(args, None)

    def info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self.hits, self.misses, len(self._items))


_STRUCTURES = StructureCache(maxsize=64)


def model_structure(model: ModelSpec, task: str, num_labels: int | None = None) -> ModelStructure:
    """The cached structure of ``model`` built for ``task`` with ``num_labels`` (default: see above)."""
    key = source_key(model)

    def build() -> ModelStructure:
        return build_structure(key, task, num_labels if num_labels is not None else default_num_labels(key))

    return _STRUCTURES.get((key, task, num_labels), build)


def cached_structure(model: ModelSpec, task: str, num_labels: int | None = None) -> ModelStructure | None:
    """The structure :func:`model_structure` would return if it is built already, else None (never builds)."""
    return _STRUCTURES.peek((source_key(model), task, num_labels))


def structure_cache_info() -> CacheInfo:
    return _STRUCTURES.info()


def config_value(config: PretrainedConfig, *names: str, default: Any = None) -> Any:
    """The first of ``names`` the config defines (architectures spell the same number differently)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default
