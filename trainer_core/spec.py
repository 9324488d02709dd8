"""The job spec: the one schema the API, the worker, the CLI and the training core share.

Field names follow 🤗 ``TrainingArguments`` wherever one exists, so users carry their habits over.
Unknown fields are rejected (``extra="forbid"``), never silently ignored.

Cross-field rules raise ``PydanticCustomError`` with a ``field`` entry in the error context; pydantic
puts such errors at the location of the model that checked them, so :func:`spec_errors` reads
``ctx["field"]`` to name the real field (``efficiency.local_sgd_steps``, not ``body``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import Field, ValidationError, model_validator

# The optimizer section and its rules come from the optimizer table; re-exported as part of the spec.
from trainer_core.optimizers import OptimizerSpec
from trainer_core.spec_adapter import AdapterSpec
from trainer_core.spec_base import StrictModel, combination_error
from trainer_core.spec_init_from import InitFromSpec
from trainer_core.spec_integrations import IntegrationsSpec
from trainer_core.spec_preference import PREFERENCE_METHODS, Method, PreferenceSpec, method_errors, reward_metrics
from trainer_core.spec_sharding import FsdpSpec, Sharding, sharding_errors

Task = Literal["text-classification", "image-classification", "audio-classification", "causal-lm"]
TEXT_TASKS = frozenset({"text-classification", "causal-lm"})
Backend = Literal["trainer", "accelerate"]
MixedPrecision = Literal["no", "fp16", "bf16"]
MetricName = Literal["accuracy", "f1", "precision", "recall"]
# An evaluation value by name (`eval_loss`, `eval_accuracy`, or without the prefix): what early stopping
# and the best checkpoint decide by; JobSpec checks it is one the run's evaluations report.
EvalMetric = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z_]+(/[a-z_]+)?$")]
SchedulerName = Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"]
EvalStrategy = Literal["no", "steps", "epoch"]
Tracker = Literal["tensorboard", "wandb", "mlflow"]
# Training values a spec may leave to the service by writing `auto` (trainer_core/auto.py chooses them).
AutoField = Literal["per_device_train_batch_size", "num_train_epochs", "learning_rate"]
AUTO_FIELDS: tuple[str, ...] = get_args(AutoField)

BUILTIN_DATASET_BUILDERS = ("csv", "json", "parquet", "imagefolder", "audiofolder")


class ModelSpec(StrictModel):
    """Which model to train: a hub id or local directory, or a config for a randomly initialised model."""

    name_or_path: str | None = Field(
        default=None, min_length=1, description="Hub id or local directory of a pretrained model."
    )
    config: dict[str, Any] | None = Field(
        default=None,
        description="A transformers config as a dict (must name `model_type`); the model starts random.",
    )
    tokenizer: str | None = Field(default=None, min_length=1, description="Tokenizer name or path.")
    processor: str | None = Field(
        default=None, min_length=1, description="Image processor / feature extractor name or path."
    )
    revision: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.name_or_path is None) == (self.config is None):
            raise combination_error("model.name_or_path", "give exactly one of `name_or_path` or `config`")
        if self.config is not None and not isinstance(self.config.get("model_type"), str):
            raise combination_error("model.config.model_type", "a config must name its `model_type`")
        return self


class DatasetSpec(StrictModel):
    """Where the data is and which columns hold inputs and labels."""

    path: str | None = Field(
        default=None,
        min_length=1,
        description="`csv`, `json`, `parquet`, `imagefolder`, `audiofolder`, or a hub dataset id.",
    )
    id: str | None = Field(default=None, min_length=1, description="An uploaded dataset's id (service only).")
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    data_dir: str | None = None
    name: str | None = Field(default=None, description="Hub dataset configuration name.")
    train_split: str = "train"
    eval_split: str | None = Field(
        default=None, description="Split to evaluate on; default `validation` (or `test`) when present."
    )
    eval_fraction: float | None = Field(
        default=None, gt=0.0, lt=1.0, description="Hold out this fraction of train when there is no eval split."
    )
    text_column: str = Field(default="text", description="Text to classify, or plain text for causal-lm.")
    prompt_column: str = Field(default="prompt", description="causal-lm: prompt of a prompt/completion pair.")
    completion_column: str = Field(default="completion", description="causal-lm: completion of the pair.")
    messages_column: str = Field(default="messages", description="causal-lm: chat turns (`role`, `content`).")
    chosen_column: str = Field(default="chosen", description="dpo/orpo: the preferred answer (text or chat turns).")
    rejected_column: str = Field(default="rejected", description="dpo/orpo: the answer not preferred.")
    text_pair_column: str | None = None
    image_column: str = "image"
    audio_column: str = "audio"
    label_column: str = "label"

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if (self.path is None) == (self.id is None):
            raise combination_error("dataset.path", "give exactly one of `path` or `id`")
        if self.eval_split is not None and self.eval_fraction is not None:
            raise combination_error("dataset.eval_fraction", "give `eval_split` or `eval_fraction`, not both")
        return self


class PreprocessingSpec(StrictModel):
    max_length: int = Field(default=128, ge=2, le=32768, description="Token limit for text inputs.")
    max_duration_s: float = Field(default=10.0, gt=0, le=600, description="Audio clips are cut to this.")
    sampling_rate: int | None = Field(
        default=None, gt=0, description="Audio rate; default is the feature extractor's own."
    )
    group_by_length: bool = Field(
        default=True,
        description=(
            "Batch inputs of similar length together (less padding, faster): sorted by length in pools "
            "of many optimizer steps, the steps of each pool shuffled, the longest input first."
        ),
    )
    train_on_prompt: bool = Field(
        default=False, description="causal-lm: count prompt / user tokens in the loss too (default: completions only)."
    )
    packing: bool = Field(default=False, description="causal-lm: concatenate examples up to `max_length`.")
    max_prompt_length: int | None = Field(
        default=None, ge=1, le=32768, description="dpo/orpo: a prompt keeps at most this many tokens (its last). "
        "A prompt and answer longer than `max_length` lose prompt tokens first, then the answer's end.",
    )  # fmt: skip


class TrainingSpec(StrictModel):
    backend: Backend = "trainer"
    auto: list[AutoField] = Field(
        default_factory=list, description="The fields written as `auto`, for trainer_core/auto.py to choose. "
        "Write `\"learning_rate\": \"auto\"` rather than this list; a resolved spec has none left.",
    )  # fmt: skip
    effective_batch_size: int | None = Field(
        default=None, ge=1, le=1_048_576, description="Examples per optimizer step: micro-batch x gradient "
        "accumulation x processes. With `per_device_train_batch_size: auto` the split is chosen to make it up.",
    )  # fmt: skip
    num_train_epochs: float = Field(default=3.0, gt=0, le=100_000)
    max_steps: int = Field(default=-1, ge=-1, description="If > 0, overrides num_train_epochs.")
    per_device_train_batch_size: int = Field(default=8, ge=1, le=65536)
    per_device_eval_batch_size: int = Field(default=8, ge=1, le=65536)
    learning_rate: float = Field(default=5e-5, gt=0, le=10)
    weight_decay: float = Field(default=0.0, ge=0, le=10)
    lr_scheduler_type: SchedulerName = "linear"
    warmup_ratio: float = Field(default=0.0, ge=0, le=1)
    warmup_steps: int = Field(default=0, ge=0)
    max_grad_norm: float = Field(default=1.0, ge=0, le=1e6, description="0 disables clipping.")
    seed: int = 42
    logging_steps: int = Field(default=10, ge=1)
    eval_strategy: EvalStrategy = "epoch"
    eval_steps: int | None = Field(default=None, ge=1)
    save_steps: int = Field(default=500, ge=1)
    save_total_limit: int | None = Field(default=None, ge=1)
    dataloader_num_workers: int = Field(default=0, ge=0, le=64)
    report_to: list[Tracker] = Field(
        default_factory=list, description="Trackers that receive every metric point the job streams: TensorBoard "
        "(`<output_dir>/runs`), W&B and MLflow (configured under `integrations`).",
    )  # fmt: skip
    nan_patience: int = Field(
        default=3, ge=0, description="Stop with reason nan_loss after this many logging steps in a row with a "
        "loss that is not finite (0: never)."
    )
    metric_for_best_model: EvalMetric = Field(
        default="eval_loss",
        description="What makes a checkpoint the best: an evaluation metric of the run (as `early_stopping.metric`).",
    )
    greater_is_better: bool | None = Field(
        default=None, description="For `metric_for_best_model`. Default: false for a loss or perplexity, else true."
    )
    keep_best_checkpoint: bool = Field(
        default=False, description="`save_total_limit` never deletes the best checkpoint (it keeps it and the newest)."
    )
    load_best_model_at_end: bool = Field(
        default=False, description="Export the best checkpoint's weights as the final model (keeps it too). Needs "
        "`eval_strategy: steps` and `save_steps` a multiple of the evaluation interval.",
    )  # fmt: skip

    @model_validator(mode="before")
    @classmethod
    def _auto_values(cls, data: Any) -> Any:
        """``"field": "auto"`` becomes the field's default, with its name in ``auto`` (the values stay
        numbers for every reader of the spec; trainer_core/auto.py replaces them)."""
        if not isinstance(data, dict):
            return data
        asked = [name for name in AUTO_FIELDS if data.get(name) == "auto"]
        if not asked:
            return data
        kept = {k: v for k, v in data.items() if k not in asked}
        given = kept.get("auto")
        listed: list[Any] = given if isinstance(given, list) else []
        return {**kept, "auto": [*listed, *(name for name in asked if name not in listed)]}

    @model_validator(mode="after")
    def _eval_steps(self) -> TrainingSpec:
        if self.eval_steps is not None and self.eval_strategy != "steps":
            raise combination_error("training.eval_steps", "only used with eval_strategy 'steps'")
        if self.load_best_model_at_end:
            interval = self.eval_steps or self.logging_steps
            if self.eval_strategy != "steps" or self.save_steps % interval:
                raise combination_error(
                    "training.load_best_model_at_end",
                    "needs an evaluation at every checkpoint: eval_strategy 'steps' and save_steps "
                    f"({self.save_steps}) a multiple of eval_steps ({interval})",
                )
        return self

    @property
    def best_metric(self) -> str:
        return metric_key(self.metric_for_best_model)

    @property
    def best_higher_is_better(self) -> bool:
        return higher_is_better(self.best_metric, self.greater_is_better)

    @property
    def keeps_best(self) -> bool:
        return self.keep_best_checkpoint or self.load_best_model_at_end


def metric_key(name: str) -> str:
    """An evaluation metric as evaluation events name it (``eval_`` prefixed)."""
    return name if name.startswith("eval_") else f"eval_{name}"


def higher_is_better(key: str, explicit: bool | None) -> bool:
    """``explicit`` when given; else a loss or perplexity is better lower, every other metric higher."""
    return explicit if explicit is not None else not key.endswith(("loss", "perplexity"))


class CheckpointingSpec(StrictModel):
    """The checkpoint settings in one section, as hosted fine-tuning APIs group them. Each is a
    ``training`` field (named as 🤗 ``TrainingArguments`` names it), which is where the run reads it:
    JobSpec copies them there. Giving one in both places with different values is refused."""

    save_steps: int | None = Field(default=None, ge=1, description="`training.save_steps`.")
    save_total_limit: int | None = Field(default=None, ge=1, description="`training.save_total_limit`.")
    keep_best: bool | None = Field(default=None, description="`training.keep_best_checkpoint`.")
    metric: EvalMetric | None = Field(default=None, description="`training.metric_for_best_model`.")
    greater_is_better: bool | None = Field(default=None, description="`training.greater_is_better`.")


# checkpointing.<field> -> training.<field>
CHECKPOINTING_FIELDS = {
    "save_steps": "save_steps", "save_total_limit": "save_total_limit", "keep_best": "keep_best_checkpoint",
    "metric": "metric_for_best_model", "greater_is_better": "greater_is_better",
}  # fmt: skip


class EfficiencySpec(StrictModel):
    gradient_accumulation_steps: int = Field(default=1, ge=1, le=4096)
    gradient_checkpointing: bool = False
    mixed_precision: MixedPrecision = Field(default="no", description="`fp16` needs a CUDA device; on CPU use `bf16`.")
    local_sgd_steps: int | None = Field(
        default=None,
        ge=1,
        description="Average weights every N steps. Needs `training.backend: accelerate`; with any other backend "
        "the request is a 422 naming this field.",
    )
    chunked_loss: bool = Field(
        default=False, description="causal-lm: compute the loss from the last hidden states in chunks of tokens, "
        "never holding a batch's full logits (their fp32 copy and gradient); loss and gradients are the plain ones.",
    )  # fmt: skip
    liger: bool = Field(
        default=False, description="causal-lm on CUDA: Liger's Triton kernels (RMSNorm, RoPE, SwiGLU and the fused "
        "linear cross-entropy) through `liger-kernel` (the `liger` extra). Refused where no CUDA device trains.",
    )  # fmt: skip
    sharding: Sharding = Field(
        default="none", description="`fsdp`: shard the weights, gradients and optimizer state across the processes "
        "(torch's FSDP2 `fully_shard`); `none`: every process holds all of them (DDP).",
    )  # fmt: skip
    fsdp: FsdpSpec | None = Field(default=None, description="FSDP options; with `sharding: fsdp` only.")


class ResourcesSpec(StrictModel):
    num_processes: int = Field(default=1, ge=1, le=64, description="Processes (devices) on each node.")
    num_nodes: int = Field(
        default=1, ge=1, le=64,
        description="Machines the job spans, each running `num_processes` processes (torchrun's `--nnodes`): the "
        "world size is num_nodes x num_processes. Outside the service each machine starts the run with the same "
        "`--rdzv-endpoint`; the service runs the job on one slot of each of num_nodes workers of its queue.",
    )  # fmt: skip
    gpu_memory_gb: float | None = Field(
        default=None, gt=0, le=4096, description="Per-device memory budget checked against the estimate."
    )
    max_restarts: int = Field(
        default=2, ge=0, le=20,
        description="Restarts after an infrastructure failure (the run process killed by a signal, its slot or "
        "host lost), each resuming from the newest complete checkpoint, or from step 0 when there is none yet. A user "
        "error (bad data, bad spec, NaN) never restarts.",
    )  # fmt: skip
    max_oom_retries: int = Field(
        default=2, ge=0, le=10, description="After a device out-of-memory, retry this often with a smaller "
        "configuration of the same effective batch (0: fail at once)."
    )
    max_runtime_minutes: float | None = Field(
        default=None, gt=0, le=1_000_000, description="Stop the run with reason timeout once it has trained this long."
    )


class EarlyStoppingSpec(StrictModel):
    """Stop a run whose evaluation metric has not improved for ``patience`` evaluations in a row; the
    job succeeds with ``stopped_early`` in its final metrics (trainer_core/early_stopping.py)."""

    metric: EvalMetric = Field(
        default="eval_loss",
        description="An evaluation metric of the run: `eval_loss`, or `eval_<name>` for a name in `metrics` "
        "(`eval_perplexity` for causal-lm); the `eval_` prefix may be left out.",
    )  # fmt: skip
    patience: int = Field(default=3, ge=1, le=10_000, description="Evaluations without improvement before stopping.")
    min_delta: float = Field(default=0.0, ge=0, le=1e9, description="How much better counts as an improvement.")
    greater_is_better: bool | None = Field(
        default=None, description="Default: false for a loss or perplexity, true for the others."
    )

    @property
    def key(self) -> str:
        return metric_key(self.metric)

    @property
    def higher_is_better(self) -> bool:
        return higher_is_better(self.key, self.greater_is_better)


class JobSpec(StrictModel):
    """A training job, complete enough to run with no service at all."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    task: Task
    method: Method = Field(
        default="sft", description="causal-lm: `sft` (supervised), or preference tuning with `dpo` or `orpo` on "
        "prompt/chosen/rejected rows (settings in `preference`).",
    )  # fmt: skip
    model: ModelSpec
    dataset: DatasetSpec
    preprocessing: PreprocessingSpec = Field(default_factory=PreprocessingSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    efficiency: EfficiencySpec = Field(default_factory=EfficiencySpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    adapter: AdapterSpec | None = Field(default=None, description="LoRA / QLoRA; without it, a full fine-tune.")
    metrics: list[MetricName] = Field(default_factory=lambda: list[MetricName](["accuracy"]), min_length=1)
    early_stopping: EarlyStoppingSpec | None = Field(
        default=None, description="Stop when the evaluation metric stops improving; needs evaluations."
    )
    integrations: IntegrationsSpec | None = Field(
        default=None, description="W&B and MLflow settings for the trackers `training.report_to` names."
    )
    init_from: InitFromSpec | None = Field(
        default=None, description="Start from another run's checkpoint (its weights; the optimizer state if asked)."
    )
    checkpointing: CheckpointingSpec | None = Field(
        default=None, description="Checkpoint settings in one section (each is also a `training` field)."
    )
    preference: PreferenceSpec | None = Field(
        default=None, description="DPO/ORPO settings (method `dpo` or `orpo`); the defaults when left out."
    )

    @model_validator(mode="after")
    def _checkpointing_into_training(self) -> JobSpec:
        """Before every other rule: the run, the estimator and the checks read these from ``training``."""
        if self.checkpointing is None:
            return self
        given = {name: getattr(self.checkpointing, name) for name in self.checkpointing.model_fields_set}
        moved = {}
        for name, value in given.items():
            target = CHECKPOINTING_FIELDS[name]
            if target in self.training.model_fields_set and getattr(self.training, target) != value:
                raise combination_error(
                    f"checkpointing.{name}", f"training.{target} is {getattr(self.training, target)!r}: give it once"
                )
            moved[target] = value
        self.training = TrainingSpec.model_validate({**self.training.model_dump(exclude_unset=True), **moved})
        return self

    @model_validator(mode="after")
    def _cross_field_rules(self) -> JobSpec:
        if self.early_stopping is not None and self.training.eval_strategy == "no":
            raise combination_error(
                "early_stopping", "needs evaluations: set training.eval_strategy to 'steps' or 'epoch'"
            )
        # The metrics that decide something must be ones the run's evaluations report.
        deciding = [(self.written_as("metric_for_best_model"), self.training.best_metric, self.training.keeps_best)]
        if self.early_stopping is not None:
            deciding.append(("early_stopping.metric", self.early_stopping.key, True))
        known = self.evaluation_metrics()
        for field, key, used in deciding:
            if used and key not in known:
                raise combination_error(field, f"the run evaluates {', '.join(known)}; not {key!r}")
        if self.efficiency.local_sgd_steps is not None and self.training.backend != "accelerate":
            raise combination_error(
                "efficiency.local_sgd_steps",
                "local SGD belongs to the 'accelerate' backend; set training.backend to 'accelerate'",
            )
        eff = self.efficiency
        for field, message in sharding_errors(
            eff.sharding, eff.fsdp, world=self.world_size, backend=self.training.backend,
            adapter=self.adapter is not None, optimizer=self.optimizer.name, mixed_precision=eff.mixed_precision,
            local_sgd=eff.local_sgd_steps is not None, preference=self.is_preference,
        ):  # fmt: skip
            raise combination_error(field, message)
        for name in ("chunked_loss", "liger"):
            if getattr(self.efficiency, name) and self.task != "causal-lm":
                raise combination_error(f"efficiency.{name}", "applies to task 'causal-lm' only")
        if self.efficiency.chunked_loss and self.efficiency.liger:
            raise combination_error("efficiency.chunked_loss", "liger's fused linear cross-entropy already chunks it")
        if self.task in TEXT_TASKS and self.model.processor is not None:
            raise combination_error("model.processor", "text models take `tokenizer`, not `processor`")
        if self.task not in TEXT_TASKS and self.model.tokenizer is not None:
            raise combination_error("model.tokenizer", "image and audio models take `processor`")
        for name in ("packing", "train_on_prompt"):
            if getattr(self.preprocessing, name) and self.task != "causal-lm":
                raise combination_error(f"preprocessing.{name}", "applies to task 'causal-lm' only")
        for field, message in method_errors(self.method, self.preference, self.task):
            raise combination_error(field, message)
        if self.is_preference:
            # Each row is a chosen/rejected pair sharing one prompt, and the prompt never counts in the loss.
            for name in ("packing", "train_on_prompt"):
                if getattr(self.preprocessing, name):
                    raise combination_error(f"preprocessing.{name}", f"not used with method {self.method!r}")
        elif self.preprocessing.max_prompt_length is not None:
            raise combination_error("preprocessing.max_prompt_length", "applies to method 'dpo' or 'orpo' only")
        adapter, mixed = self.adapter, self.efficiency.mixed_precision
        if adapter is not None and adapter.type == "qlora" and mixed != "no" and adapter.compute_dtype != mixed:
            raise combination_error(
                "adapter.compute_dtype", f"must match efficiency.mixed_precision ({mixed!r}): autocast sets the dtype"
            )
        target, processes = self.training.effective_batch_size, self.world_size
        if target is not None and target % processes:
            raise combination_error(
                "training.effective_batch_size",
                f"must be a multiple of the world size, resources.num_nodes x num_processes ({processes})",
            )
        chosen = "per_device_train_batch_size" in self.training.auto
        if target is not None and not chosen and self.global_batch() != target:
            raise combination_error(  # a resolved spec keeps it: the split `auto` chose must make it up
                "training.effective_batch_size", f"is {target} but micro-batch x accumulation x processes is "
                f"{self.global_batch()}; write per_device_train_batch_size 'auto' to have the split chosen",
            )  # fmt: skip
        for tracker in ("wandb", "mlflow"):
            # report_to alone says which trackers are on; a section for one it leaves out would be ignored
            if getattr(self.integrations, tracker, None) is not None and tracker not in self.training.report_to:
                raise combination_error(f"integrations.{tracker}", f"add '{tracker}' to training.report_to to use it")
        return self

    @property
    def is_preference(self) -> bool:
        """Whether the job tunes on preference pairs (``dpo`` or ``orpo``)."""
        return self.method in PREFERENCE_METHODS

    @property
    def preference_settings(self) -> PreferenceSpec:
        """The ``preference`` section, or its defaults when the spec leaves it out."""
        return self.preference if self.preference is not None else PreferenceSpec()

    @property
    def fsdp_settings(self) -> FsdpSpec | None:
        """The FSDP options of a sharded job (their defaults when ``efficiency.fsdp`` is left out); None unsharded."""
        if self.efficiency.sharding != "fsdp":
            return None
        return self.efficiency.fsdp if self.efficiency.fsdp is not None else FsdpSpec()

    @property
    def reward_metrics(self) -> tuple[str, ...]:
        """A preference run's metrics (logged with its loss, reported by its evaluations); none for SFT."""
        return reward_metrics(self.method) if self.is_preference else ()

    def written_as(self, training_field: str) -> str:
        """Where the spec gives a ``training`` field: its ``checkpointing`` name when it came from there."""
        given = self.checkpointing.model_fields_set if self.checkpointing is not None else set()
        alias = next((name for name, target in CHECKPOINTING_FIELDS.items() if target == training_field), None)
        return f"checkpointing.{alias}" if alias in given else f"training.{training_field}"

    def global_batch(self) -> int:
        """Examples per optimizer step: micro-batch x gradient accumulation x processes."""
        t, e = self.training, self.efficiency
        return t.per_device_train_batch_size * e.gradient_accumulation_steps * self.world_size

    @property
    def world_size(self) -> int:
        """Processes the job trains on: nodes x processes per node (one device each)."""
        return self.resources.num_nodes * self.resources.num_processes

    def evaluation_metrics(self) -> list[str]:
        """The values an evaluation of this run reports (trainer_core.backends.common.eval_values)."""
        if self.is_preference:
            names = list(self.reward_metrics)
        else:
            names = ["perplexity"] if self.task == "causal-lm" else list(self.metrics)
        return ["eval_loss", *map(metric_key, names)]


def data_file_entries(value: Any, field: str = "dataset.data_files") -> Iterator[tuple[str, str]]:
    """``(field, location)`` for each string of a ``data_files`` value (a string, a list, or splits of
    either), the field its dotted path (``dataset.data_files.train.0``)."""
    if isinstance(value, str):
        yield field, value
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from data_file_entries(item, f"{field}.{i}")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from data_file_entries(item, f"{field}.{key}")


@dataclass(frozen=True)
class FieldError:
    """One problem with a spec: the dotted field path and what is wrong with it."""

    field: str
    message: str
    type: str = "value_error"


def spec_errors(exc: ValidationError, prefix: tuple[str | int, ...] = ()) -> list[FieldError]:
    """Map a pydantic error to field paths users can act on (see module docstring for ``ctx.field``)."""
    return field_errors(exc.errors(include_url=False), prefix)


_TYPE_MARKERS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_type_marker(part: str | int) -> bool:
    """Pydantic's union-member and validator tags in an error location (``str``, ``list[str]``, ...)."""
    text = str(part)
    return text in _TYPE_MARKERS or "[" in text or text.startswith("function-")


def field_errors(errors: Sequence[Mapping[str, Any]], prefix: tuple[str | int, ...] = ()) -> list[FieldError]:
    """:func:`spec_errors` for pydantic's error dicts (e.g. FastAPI's ``RequestValidationError.errors()``)."""
    out: list[FieldError] = []
    for err in errors:
        ctx = err.get("ctx") or {}
        if "field" in ctx:
            field = str(ctx["field"])
            message = err["msg"].split(": ", 1)[-1]
        else:
            # Drop pydantic's union/tag markers so the path is what a user would type.
            parts = [str(p) for p in (*prefix, *err["loc"]) if not _is_type_marker(p)]
            field = ".".join(parts) or "spec"
            message = err["msg"]
        out.append(FieldError(field=field, message=message, type=err["type"]))
    return out


class SpecError(ValueError):
    """A spec that cannot be run; carries the field errors for CLI and API alike."""

    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        super().__init__("; ".join(f"{e.field}: {e.message}" for e in errors))


def liger_refusal(where: str = "") -> FieldError:
    """``efficiency.liger`` where no CUDA device trains; ``where`` says why none does (the API's queue check)."""
    because = f", and {where}" if where else ""
    return FieldError("efficiency.liger", f"Liger's kernels are Triton kernels and need a CUDA device{because}; "
                      "efficiency.chunked_loss saves the same logits memory on any device")  # fmt: skip


def untrainable_errors(spec: JobSpec, *, cuda: bool) -> list[FieldError]:
    """What this machine cannot train although the spec is valid (estimates accept it): QLoRA's fp16
    without CUDA (bitsandbytes' 4-bit kernels on the CPU compute in bf16 or fp32), and Liger's kernels.

    The run and the API's submit refuse a spec with these errors; ``POST /v1/estimates/memory`` does not.
    """
    errors = []
    if (
        spec.adapter is not None
        and spec.adapter.type == "qlora"
        and not cuda
        and "fp16" in (spec.adapter.compute_dtype, spec.efficiency.mixed_precision)
    ):
        errors.append(FieldError("adapter.compute_dtype", "qlora in fp16 needs a CUDA device; use 'bf16' here"))
    if spec.efficiency.liger and not cuda:
        errors.append(liger_refusal())
    return errors


def parse_spec(data: Mapping[str, Any]) -> JobSpec:
    """Validate a spec document, raising :class:`SpecError` with field paths on failure."""
    try:
        return JobSpec.model_validate(dict(data))
    except ValidationError as exc:
        raise SpecError(spec_errors(exc)) from exc


def load_spec_file(path: str | Path) -> JobSpec:
    """Read a YAML or JSON spec file (YAML is a superset of JSON, but JSON errors read better)."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise SpecError([FieldError("spec", f"cannot parse {path}: {exc}", "parse_error")]) from exc
    if not isinstance(data, Mapping):
        raise SpecError([FieldError("spec", "a spec file must hold one object", "type_error")])
    return parse_spec(data)
