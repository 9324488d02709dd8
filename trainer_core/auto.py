"""``auto`` hyperparameters: the micro-batch, the epochs and the learning rate chosen for the user.

A spec may write ``auto`` for ``training.per_device_train_batch_size``, ``training.num_train_epochs``
and ``training.learning_rate`` (the spec keeps the names in ``training.auto``: the values stay
numbers everywhere else). :func:`resolve_auto` replaces each with a number and says why; the service
does it at submit (the dry run and the job show every choice), a run of an unresolved spec
(``trainjobs train``) does it itself. The run trains exactly the resolved spec, and its ``spec.json``
records it.

The rules, each documented in the README ("auto"):

- **Micro-batch:** the largest the memory estimator finds fitting the budget, by powers of two up to
  :data:`MAX_MICRO_BATCH` (:data:`MAX_CPU_MICRO_BATCH` on a CPU budget: a larger batch only makes a CPU
  step slower, not the run faster). With ``training.effective_batch_size`` the micro-batch is the
  largest fitting divisor of it per device, and ``efficiency.gradient_accumulation_steps`` makes up the rest.
  The budget is the queue's, else ``resources.gpu_memory_gb``, else the worker's device: a GPU's memory
  or, without one, :data:`CPU_MEMORY_FRACTION` of the host's memory.
- **Epochs:** OpenAI's fine-tuning rule on the number of training rows ``n``: 3 epochs, raised so that
  ``n x epochs`` reaches :data:`MIN_TARGET_EXAMPLES` on a small set, lowered so that it stays within
  :data:`MAX_TARGET_EXAMPLES` on a large one, within 1-10.
- **Learning rate:** a base rate per method at a reference effective batch (:data:`BASE_LEARNING_RATES`),
  scaled by the square root of the effective batch over the reference (the square-root rule for Adam,
  Malladi et al. 2022), within a factor of 4 either way.

Standard library only at import: the worker and the API import it without torch.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from trainer_core.spec import FieldError, JobSpec, SpecError

CPU_MEMORY_FRACTION = 0.5
MAX_MICRO_BATCH = 1024
MAX_CPU_MICRO_BATCH = 64

# OpenAI's defaults for `n_epochs: auto` (the fine-tuning data-preparation cookbook), capped at 10.
TARGET_EPOCHS = 3
MIN_TARGET_EXAMPLES = 100
MAX_TARGET_EXAMPLES = 25_000
MIN_EPOCHS, MAX_EPOCHS = 1, 10

# method -> (learning rate, the effective batch it was published at). Sources: BERT fine-tuning
# (Devlin et al. 2019: 2e-5..5e-5 at batch 16-32); LoRA and QLoRA (Hu et al. 2021; Dettmers et al. 2023:
# 2e-4 at batch 16 for 7B-13B models); training a model from its config (no pretrained weights): AdamW's
# usual 1e-3 (Kingma and Ba 2015; small transformers from scratch).
BASE_LEARNING_RATES: dict[str, tuple[float, int]] = {
    "full": (2e-5, 32),
    "lora": (2e-4, 16),
    "qlora": (2e-4, 16),
    "scratch": (1e-3, 32),
}
LR_SCALE_LIMIT = 4.0


@dataclass(frozen=True)
class Budget:
    """Memory per device for the micro-batch rule, in GiB, and where it came from."""

    gb: float
    source: str
    cpu: bool = False


@dataclass(frozen=True)
class AutoChoice:
    field: str  # the spec path, e.g. "training.learning_rate"
    value: float | int
    why: str

    def as_dict(self) -> dict[str, Any]:
        return {"field": self.field, "value": self.value, "why": self.why}


def host_memory_gb() -> float:
    """This machine's physical memory in GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def gpu_memory_gb() -> float | None:
    """The smallest visible NVIDIA GPU's memory in GiB (``nvidia-smi``: no torch needed), or None."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    try:
        out = subprocess.run([tool, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout  # fmt: skip
        sizes = [float(line) / 1024 for line in out.split() if line.strip()]  # MiB
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(sizes) if sizes else None


def device_budget() -> Budget:
    """This machine's budget for the micro-batch rule: its GPU's memory, else a share of host memory."""
    gpu = gpu_memory_gb()
    if gpu is not None:
        return Budget(gpu, "this machine's GPU memory")
    share = host_memory_gb() * CPU_MEMORY_FRACTION
    return Budget(share, f"{CPU_MEMORY_FRACTION:.0%} of this machine's memory (no GPU)", cpu=True)


def method_of(spec: JobSpec) -> str:
    """The learning-rate rule's method: ``scratch``, ``lora``, ``qlora`` or ``full``."""
    if spec.model.config is not None:
        return "scratch"
    return spec.adapter.type if spec.adapter is not None else "full"


def auto_epochs(train_rows: int) -> tuple[int, str]:
    """Epochs for ``train_rows`` rows by the rule above, and the reason in words."""
    epochs = TARGET_EPOCHS
    if train_rows * epochs < MIN_TARGET_EXAMPLES:
        epochs = min(MAX_EPOCHS, math.ceil(MIN_TARGET_EXAMPLES / max(train_rows, 1)))
        why = f"{train_rows} rows: enough epochs to see {MIN_TARGET_EXAMPLES} examples"
    elif train_rows * epochs > MAX_TARGET_EXAMPLES:
        epochs = max(MIN_EPOCHS, MAX_TARGET_EXAMPLES // train_rows)
        why = f"{train_rows} rows: at most {MAX_TARGET_EXAMPLES} examples seen"
    else:
        why = f"{train_rows} rows: the default {TARGET_EPOCHS} epochs"
    return epochs, f"{why} (1-{MAX_EPOCHS})"


def auto_learning_rate(spec: JobSpec) -> tuple[float, str]:
    """The method's base rate scaled by sqrt(effective batch / reference), within LR_SCALE_LIMIT."""
    method = method_of(spec)
    base, reference = BASE_LEARNING_RATES[method]
    effective = spec.global_batch()
    scale = min(LR_SCALE_LIMIT, max(1 / LR_SCALE_LIMIT, math.sqrt(effective / reference)))
    rate = float(f"{base * scale:.3g}")
    return rate, f"{method}: {base:g} at batch {reference}, x sqrt({effective}/{reference})"


def _micro_batches(spec: JobSpec, cap: int) -> list[int]:
    """Micro-batch sizes to try, largest first."""
    target = spec.training.effective_batch_size
    if target is None:
        return [2**k for k in range(int(math.log2(cap)), -1, -1)]
    per_device = target // spec.world_size
    return [b for b in range(min(per_device, cap), 0, -1) if per_device % b == 0]


def auto_micro_batch(spec: JobSpec, budget: Budget, overhead_bytes: int | None = None) -> tuple[dict[str, int], str]:
    """The largest fitting micro-batch (and the accumulation that keeps an effective batch), and why."""
    from trainer_core.memory import estimate_memory

    cap = MAX_CPU_MICRO_BATCH if budget.cpu else MAX_MICRO_BATCH
    limit = int(budget.gb * 2**30)
    target = spec.training.effective_batch_size
    for size in _micro_batches(spec, cap):
        changes = {"per_device_train_batch_size": size}
        if target is not None:
            changes["gradient_accumulation_steps"] = target // (size * spec.world_size)
        trial = with_values(spec, changes)
        total = estimate_memory(trial, gpu_memory_gb=budget.gb, overhead_bytes=overhead_bytes).total_bytes
        if total <= limit:
            why = f"the largest that fits {budget.gb:.1f} GiB ({budget.source}): {total / 2**30:.2f} GiB estimated"
            return changes, why + (f", at most {cap} on a CPU" if budget.cpu else "")
    smallest = "a micro-batch of 1" if target is None else f"any split of effective_batch_size {target}"
    message = f"auto: not even {smallest} fits {budget.gb:.1f} GiB ({budget.source}); see the memory plan"
    raise SpecError([FieldError("training.per_device_train_batch_size", message)])


def with_values(spec: JobSpec, changes: dict[str, Any]) -> JobSpec:
    """``spec`` with training / efficiency values replaced (validated again)."""
    data = spec.model_dump(mode="json", exclude_unset=True)
    training, efficiency = dict(data.get("training") or {}), dict(data.get("efficiency") or {})
    for key, value in changes.items():
        (efficiency if key == "gradient_accumulation_steps" else training)[key] = value
    if not training.get("auto"):
        training.pop("auto", None)  # resolved: nothing left to choose
    return JobSpec.model_validate({**data, "training": training, "efficiency": efficiency})


def apply_choices(spec: JobSpec, choices: list[AutoChoice]) -> JobSpec:
    """``spec`` with the values :func:`resolve_auto` chose (for another copy of the same spec)."""
    return with_values(spec, {**{c.field.split(".", 1)[1]: c.value for c in choices}, "auto": []})


def resolve_auto(
    spec: JobSpec, *, budget: Budget | None, train_rows: int | None, overhead_bytes: int | None = None,
    partial: bool = False,
) -> tuple[JobSpec, list[AutoChoice]]:
    """``spec`` with every ``auto`` field chosen (batch, then epochs, then the rate, which depends on
    the batch), and the choices; ``spec`` itself when it asks for none. ``partial`` (a memory estimate,
    which may not know the rows): epochs without ``train_rows`` stay ``auto`` instead of an error."""
    asked = set(spec.training.auto)
    if not asked:
        return spec, []
    left: list[str] = []
    choices: list[AutoChoice] = []
    changes: dict[str, Any] = {}
    if "per_device_train_batch_size" in asked:
        budget = budget or device_budget()
        batch, why = auto_micro_batch(spec, budget, overhead_bytes)
        changes.update(batch)
        choices.append(AutoChoice("training.per_device_train_batch_size", batch["per_device_train_batch_size"], why))
        if "gradient_accumulation_steps" in batch:
            choices.append(AutoChoice("efficiency.gradient_accumulation_steps", batch["gradient_accumulation_steps"],
                                      f"keeps training.effective_batch_size {spec.training.effective_batch_size}"))
    if "num_train_epochs" in asked and train_rows is None and partial:
        left.append("num_train_epochs")
    elif "num_train_epochs" in asked:
        if train_rows is None:
            raise SpecError([FieldError("training.num_train_epochs", "auto needs the number of training rows")])
        epochs, why = auto_epochs(train_rows)
        changes["num_train_epochs"] = epochs
        choices.append(AutoChoice("training.num_train_epochs", epochs, why))
    resolved = with_values(spec, {**changes, "auto": left})
    if "learning_rate" in asked:
        rate, why = auto_learning_rate(resolved)
        resolved = with_values(resolved, {"learning_rate": rate})
        choices.append(AutoChoice("training.learning_rate", rate, why))
    return resolved, choices
