"""A DPO/ORPO micro-batch's activations (2B rows, the loss's per-token log-probs) against what autograd keeps
on the CPU for the run's own policy forward (trainer_core/preference.py: policy_logps), measured as in
test_activation_calibration_llm.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.trainer_core.memory.llm_models import build_llm
from tests.trainer_core.memory.test_activation_calibration_llm import LLAMA, saved_storages
from trainer_core.backends.objective import disable_dropout
from trainer_core.memory import estimate_memory
from trainer_core.preference import policy_logps
from trainer_core.spec import parse_spec

PAIRS, S = 2, 128


class PolicyForward(torch.nn.Module):
    """The model as a preference run calls it: one forward of the 2B rows and the per-token log-probs."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch: torch.Tensor) -> object:
        return policy_logps(self.model, batch)


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("adapter", [None, {"type": "lora", "r": 16, "dropout": 0.05}])
@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_preference_activations_match_saved_tensors(
    monkeypatch: pytest.MonkeyPatch, method: str, adapter: dict[str, Any] | None, precision: str
) -> None:
    from tests.trainer_core.memory import llm_models

    monkeypatch.setitem(llm_models.LLM_CONFIGS, "calibration", LLAMA)
    spec = parse_spec({
        "name": "calibration", "task": "causal-lm", "method": method, "model": {"config": LLAMA},
        "dataset": {"path": "json"}, "preprocessing": {"max_length": S},
        "training": {"per_device_train_batch_size": PAIRS}, "efficiency": {"mixed_precision": precision},
        "adapter": adapter,
    })  # fmt: skip
    parts = {p.name: p.bytes for p in estimate_memory(spec).parts}
    estimated = parts["activations"] + parts["autocast_copies"] + parts["logits_fp32"]
    model = build_llm(spec).train()
    disable_dropout(model)  # as a preference run does (trainer_core/backends/objective.py)
    ids = torch.randint(1, 1000, (2 * PAIRS, S), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, : S // 2] = -100  # the prompt
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    ratio = estimated / sum(saved_storages(PolicyForward(model), batch, precision).values())
    assert 0.85 <= ratio <= 1.15, f"{method} {adapter} {precision}: estimate / saved = {ratio:.2f}"
