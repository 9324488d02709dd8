"""The reference a DPO run scores its pairs against, and ``reference: precomputed``'s single pass.

* **LoRA / QLoRA**: the run's own PEFT model with its adapter disabled: the base, no second copy.
  When ``init_from`` loaded an adapter (an SFT run's), disabling it would score the raw base rather
  than the SFT model; that adapter is then loaded a second time, frozen, as the adapter
  ``reference`` and made active for the reference pass (what TRL's ``ref_adapter_name`` does). Only
  the trained adapter is saved (checkpoints and final model).
* **Full fine-tune**: a frozen copy of the starting weights (after ``init_from`` loaded them),
  in eval mode, on the run's device; the memory estimator counts it.
* **``precomputed``**: before training, one no-grad pass over the train and eval rows with the
  starting weights adds ``ref_chosen_logps`` / ``ref_rejected_logps`` columns; no reference is kept.
  The values are stored in ``<output_dir>/reference_logps.safetensors`` and copied into every
  checkpoint (a resume on another host gets the checkpoint folder only): a resumed run reads them
  back from its checkpoint rather than scoring its rows again (they would be scored with the starting
  weights, but the same values are not guaranteed across hosts and kernels).

Every reference pass runs without gradients, in eval mode (no dropout) and under the run's autocast.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from copy import deepcopy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from trainer_core.init_from import init_source
from trainer_core.spec import JobSpec

if TYPE_CHECKING:
    from accelerate import Accelerator
    from datasets import Dataset

    from trainer_core.backends.context import RunContext
    from trainer_core.data import PreparedData

logger = logging.getLogger(__name__)

REFERENCE_ADAPTER = "reference"
REFERENCE_FILE = "reference_logps.safetensors"
# The columns (and batch keys) of precomputed reference log-probabilities, TRL's names.
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
Scope = Callable[[], AbstractContextManager[Any]]


def uses_precomputed_reference(spec: JobSpec) -> bool:
    """A DPO run whose reference log-probabilities are computed once, before training."""
    return spec.method == "dpo" and spec.preference_settings.reference == "precomputed"


@contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(training)


@dataclass
class ReferenceScorer:
    """Scores a preference batch with the reference weights: summed log-probs of chosen and rejected, [B] each.

    ``scope`` switches ``module`` to the reference (an adapter off or swapped) for the pass.
    """

    module: nn.Module
    scope: Scope
    autocast: Scope
    loaded_adapter: bool = False  # the frozen `reference` adapter, added to the run's PEFT model

    def __call__(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        from trainer_core.preference import policy_logps

        with torch.no_grad(), self.autocast(), _eval_mode(self.module), self.scope():
            logps = policy_logps(_Fp32Logits(self.module), inputs)
        return logps.chosen.detach(), logps.rejected.detach()

    def release(self) -> None:
        """Drop what only the reference needed (the ``reference`` adapter), once it is no longer used."""
        if self.loaded_adapter:
            self.module.delete_adapter(REFERENCE_ADAPTER)  # type: ignore[operator]
            vars(self.module).pop("save_pretrained", None)  # PEFT's own again (see _save_trained_adapter)


@dataclass
class _Fp32Logits:
    """``module`` with its logits in fp32, as accelerate returns a prepared model's outputs under mixed
    precision (``convert_outputs_to_fp32``): a frozen copy, or a model not prepared yet, is not patched,
    and its 16-bit logits' log-softmax would differ from the policy's at the same weights."""

    module: nn.Module

    def __call__(self, **inputs: Any) -> Any:
        out = self.module(**inputs)
        out.logits = out.logits.float()
        return out


def reference_scorer(
    spec: JobSpec, model: nn.Module, autocast: Scope, device: torch.device, *, frozen_copy: bool
) -> ReferenceScorer:
    """The reference for ``model`` (the run's model, holding its starting weights); ``frozen_copy``:
    a full fine-tune gets a frozen copy to score with while training (else the model itself scores,
    which is right only before the first step: the precomputed pass)."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        source = init_source(spec)
        if source is not None and source.adapter is not None:
            model.load_adapter(str(source.folder), adapter_name=REFERENCE_ADAPTER, is_trainable=False)
            _save_trained_adapter(model)
            return ReferenceScorer(model, lambda: _active_adapter(model, REFERENCE_ADAPTER), autocast, True)
        return ReferenceScorer(model, model.disable_adapter, autocast)
    if not frozen_copy:
        return ReferenceScorer(model, nullcontext, autocast)
    frozen = deepcopy(model).to(device)
    frozen.requires_grad_(False)
    frozen.eval()
    return ReferenceScorer(frozen, nullcontext, autocast)


@contextmanager
def _active_adapter(model: Any, name: str) -> Iterator[None]:
    """``name`` active for the pass, the trained adapter again after (PEFT restores which one trains)."""
    trained = model.active_adapter
    model.set_adapter(name)
    try:
        yield
    finally:
        model.set_adapter(trained)


def _save_trained_adapter(model: Any) -> None:
    """``save_pretrained`` of this model writes the trained adapter only (PEFT's default is every adapter,
    which would add a ``reference/`` folder to each checkpoint and to the final model)."""
    save, trained = model.save_pretrained, model.active_adapter

    def save_trained(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("selected_adapters", [trained])
        return save(*args, **kwargs)

    model.save_pretrained = save_trained


def with_reference_logps(ctx: RunContext, scorer: ReferenceScorer, accelerator: Accelerator) -> PreparedData:
    """``ctx.data`` with the reference columns: read from the checkpoint on a resume, else scored now,
    each process scoring its share of the rows; the main process stores them in the run's folder
    (:func:`keep_reference_logps` copies them into each checkpoint)."""
    data, run_file = ctx.data, ctx.output_dir / REFERENCE_FILE
    splits = {"train": data.train} | ({"eval": data.eval} if data.eval is not None else {})
    source = ctx.resume_from / REFERENCE_FILE if ctx.resume_from is not None else None
    stored = _read(source, data.cache_key, splits) if source is not None else None
    if source is not None and stored is None:
        logger.warning("%s is missing or not this data's: scoring with the starting weights", source)
    if stored is None:
        scorer.module.to(accelerator.device)
        batch_size = ctx.spec.training.per_device_eval_batch_size
        stored = {name: _score(scorer, ds, data.collator, batch_size, accelerator) for name, ds in splits.items()}
    if accelerator.is_main_process and source != run_file:
        _write(run_file, data.cache_key, stored)
    columns = {name: _with_columns(splits[name], *stored[name]) for name in splits}
    return replace(data, train=columns["train"], eval=columns.get("eval"))


def keep_reference_logps(spec: JobSpec, output_dir: Path, checkpoint: Path) -> None:
    """A precomputed-reference run's values into ``checkpoint``, so a resume from it reads them (main process)."""
    if uses_precomputed_reference(spec) and (output_dir / REFERENCE_FILE).is_file():
        shutil.copyfile(output_dir / REFERENCE_FILE, checkpoint / REFERENCE_FILE)


def _score(
    scorer: ReferenceScorer, dataset: Dataset, collator: Any, batch_size: int, accelerator: Accelerator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's reference log-probs, in order: each process scores its share, all gather them all."""
    from accelerate.data_loader import prepare_data_loader

    from trainer_core.backends.common import without_length

    loader = DataLoader(without_length(dataset), batch_size=batch_size, collate_fn=collator, shuffle=False)  # type: ignore[arg-type]
    # Sharded as accelerate shards an eval loader, without registering it with the accelerator
    # (`save_state` would then count one more loader in every checkpoint).
    shards = prepare_data_loader(
        loader, accelerator.device, accelerator.num_processes, accelerator.process_index, put_on_device=True
    )
    chosen, rejected = [], []
    for batch in shards:
        c, r = accelerator.gather_for_metrics(scorer(batch))
        chosen.append(c.float().cpu())
        rejected.append(r.float().cpu())
    return torch.cat(chosen), torch.cat(rejected)


def _with_columns(dataset: Dataset, chosen: torch.Tensor, rejected: torch.Tensor) -> Dataset:
    dataset = dataset.remove_columns([c for c in REF_COLUMNS if c in dataset.column_names])
    dataset = dataset.add_column(REF_COLUMNS[0], chosen.tolist())  # type: ignore[arg-type]
    return dataset.add_column(REF_COLUMNS[1], rejected.tolist())  # type: ignore[arg-type]


def _write(path: Path, data_key: str, stored: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    from safetensors.torch import save_file

    tensors = {f"{split}.{column}": values for split, pair in stored.items() for column, values in zip(
        REF_COLUMNS, pair, strict=True)}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"data": data_key})


def _read(path: Path, data_key: str, splits: dict[str, Dataset]) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """The stored values when they are this data's (same preprocessing key, same row counts)."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as file:  # type: ignore[no-untyped-call]
        if (file.metadata() or {}).get("data") != data_key:
            return None
        tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (not a dict)
    stored = {}
    for split, dataset in splits.items():
        pair = tuple(tensors.get(f"{split}.{column}") for column in REF_COLUMNS)
        if any(t is None or len(t) != len(dataset) for t in pair):
            return None
        stored[split] = (pair[0], pair[1])
    return stored  # type: ignore[return-value]
