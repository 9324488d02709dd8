"""The preference losses equal TRL's on the same batch and weights: ``DPOTrainer`` (TRL 1.16) for each
``loss_type`` and ``trl.experimental.orpo.ORPOTrainer``, the loss and every reward metric (rel 1e-5).
TRL's values come from TRL's own trainers (``compute_loss`` / ``get_batch_loss_metrics`` on the batch),
with a reference model of the same weights as ours. A variant whose labels count the prompt differs."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from trl import DPOConfig, DPOTrainer

from tests.trainer_core.llm_data import preference_rows, write_lm_tokenizer
from tests.trainer_core.memory.llm_models import LLM_CONFIGS
from trainer_core.data.causal_lm import IGNORE_INDEX
from trainer_core.data.preference import PreferenceCollator, PreferenceEncoder
from trainer_core.data.text import ready_for_lm
from trainer_core.modeling import config_from_dict
from trainer_core.preference import PreferenceOutput, policy_logps, preference_loss
from trainer_core.spec_preference import REWARD_METRICS, PreferenceSpec

BETA = 0.2


def _model(seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_from_dict(LLM_CONFIGS["llama"]))
    return model.float().eval()


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = write_lm_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")
    return ready_for_lm(AutoTokenizer.from_pretrained(str(directory)), str(directory))


@pytest.fixture(scope="module", params=["text", "chat"])
def batch(request: pytest.FixtureRequest, tok: Any) -> dict[str, torch.Tensor]:
    rows = preference_rows(request.param, 3, seed=7)
    encoded = PreferenceEncoder(tok, "prompt", "chosen", "rejected", 64)({k: [r[k] for r in rows] for k in rows[0]})
    features = [dict(zip(encoded, values, strict=True)) for values in zip(*encoded.values(), strict=True)]
    return PreferenceCollator(int(tok.pad_token_id))(features)


@pytest.fixture(scope="module")
def models() -> tuple[PreTrainedModel, PreTrainedModel]:
    """The policy and a reference with other weights, so that the rewards are far from zero."""
    return _model(0), _model(1)


def _leaking(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with every real token counted, prompt included (the bug the masks prevent)."""
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
    return {**batch, "labels": labels}


def _swapped(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    half = batch["input_ids"].shape[0] // 2
    return {k: torch.cat([v[half:], v[:half]]) for k, v in batch.items()}


def _ours(method: str, settings: PreferenceSpec, models: Any, batch: dict[str, torch.Tensor]) -> PreferenceOutput:
    policy, reference = models
    with torch.no_grad():
        ref = policy_logps(reference, batch)
    return preference_loss(method, settings, policy_logps(policy, batch), ref.chosen, ref.rejected)


def _trl_dpo(models: Any, tok: Any, batch: dict[str, torch.Tensor], loss_type: str, tmp: Path) -> tuple[float, dict]:
    """TRL's DPOTrainer on this batch: its completion mask is where our labels count."""
    policy, reference = (copy.deepcopy(m) for m in models)
    args = DPOConfig(
        output_dir=str(tmp), report_to=[], use_cpu=True, bf16=False, loss_type=[loss_type], beta=BETA,
        max_length=None, per_device_train_batch_size=2,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(
            model=policy, ref_model=reference, args=args, processing_class=tok,
            train_dataset=Dataset.from_list(preference_rows("text", 2)),
        )  # fmt: skip
        inputs = {
            "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "completion_mask": (batch["labels"] != IGNORE_INDEX).long(),
        }  # fmt: skip
        loss = trainer.compute_loss(trainer.model, inputs)
    logged = trainer._metrics["train" if policy.training else "eval"]
    return float(loss), {name: values[-1] for name, values in logged.items()}


def _trl_orpo(models: Any, tok: Any, batch: dict[str, torch.Tensor], tmp: Path) -> tuple[float, dict]:
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    half = batch["input_ids"].shape[0] // 2
    args = ORPOConfig(output_dir=str(tmp), report_to=[], use_cpu=True, bf16=False, beta=BETA, max_length=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = ORPOTrainer(
            model=copy.deepcopy(models[0]), args=args, processing_class=tok,
            train_dataset=Dataset.from_list(preference_rows("text", 2)),
        )  # fmt: skip
        inputs: dict[str, Any] = {
            f"{side}_{key}": batch[name][rows]
            for side, rows in (("chosen", slice(None, half)), ("rejected", slice(half, None)))
            for key, name in (("input_ids", "input_ids"), ("attention_mask", "attention_mask"), ("labels", "labels"))
        }
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, inputs)
    return float(loss), metrics


def _assert_matches(ours: PreferenceOutput, loss: float, metrics: dict[str, float]) -> None:
    assert float(ours.loss) == pytest.approx(loss, rel=1e-5)
    assert set(ours.metrics) >= set(REWARD_METRICS)
    for name in REWARD_METRICS:
        assert float(ours.metrics[name]) == pytest.approx(metrics[name], rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_equals_trl(models: Any, tok: Any, batch: dict[str, torch.Tensor], loss_type: Any, tmp_path: Path) -> None:
    ours = _ours("dpo", PreferenceSpec(beta=BETA, loss_type=loss_type), models, batch)
    loss, metrics = _trl_dpo(models, tok, batch, loss_type, tmp_path)
    _assert_matches(ours, loss, metrics)
    assert ours.loss.requires_grad and all(not m.requires_grad for m in ours.metrics.values())
    # Counting the prompt shows in the rewards and log-probs; sigmoid and hinge losses are blind to it (the
    # shared prompt's log-ratio cancels between the answers), IPO's per-token one is not.
    leaked = _ours("dpo", PreferenceSpec(beta=BETA, loss_type=loss_type), models, _leaking(batch))
    for name in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert float(leaked.metrics[name]) != pytest.approx(metrics[name], rel=1e-5), name
    if loss_type == "ipo":
        assert float(leaked.loss) != pytest.approx(loss, rel=1e-5)


def test_dpo_label_smoothing_is_conservative_dpo(models: Any, tok: Any, batch: Any, tmp_path: Path) -> None:
    """TRL 1.16's sigmoid ignores label_smoothing; cDPO is (1 - e) of its loss plus e of it with the answers
    swapped (older TRL's sigmoid form)."""
    ours = _ours("dpo", PreferenceSpec(beta=BETA, label_smoothing=0.2), models, batch)
    straight, metrics = _trl_dpo(models, tok, batch, "sigmoid", tmp_path / "a")
    swapped, _ = _trl_dpo(models, tok, _swapped(batch), "sigmoid", tmp_path / "b")
    _assert_matches(ours, 0.8 * straight + 0.2 * swapped, metrics)


def test_orpo_equals_trl_but_for_the_prompt_in_its_nll(models: Any, tok: Any, batch: Any, tmp_path: Path) -> None:
    settings = PreferenceSpec(beta=BETA)
    ours = _ours("orpo", settings, models, batch)
    loss, metrics = _trl_orpo(models, tok, batch, tmp_path / "orpo")
    for name in (*REWARD_METRICS, "log_odds_ratio"):
        assert float(ours.metrics[name]) == pytest.approx(metrics[name], rel=1e-5, abs=1e-7), name
    # TRL's NLL counts the prompt too: with that mask, our pieces give TRL's loss exactly.
    trl_nll = policy_logps(models[0], _leaking(batch)).chosen_nll
    assert float(trl_nll) == pytest.approx(metrics["nll_loss"], rel=1e-5)
    assert float(ours.loss - ours.metrics["nll_loss"] + trl_nll) == pytest.approx(loss, rel=1e-5)
    # Ours counts the answer only: TRL's answer-only NLL (DPOTrainer's `sft` loss) plus its odds-ratio term.
    sft, _ = _trl_dpo(models, tok, batch, "sft", tmp_path / "sft")
    assert float(ours.metrics["nll_loss"]) == pytest.approx(sft, rel=1e-5)
    assert float(ours.loss) == pytest.approx(sft + loss - metrics["nll_loss"], rel=1e-5)
    leaked = _ours("orpo", settings, models, _leaking(batch))
    assert float(leaked.loss) != pytest.approx(float(ours.loss), rel=1e-5)
    assert float(leaked.metrics["logps/chosen"]) != pytest.approx(metrics["logps/chosen"], rel=1e-5)


def test_dpo_without_reference_logps_is_refused(models: Any, batch: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        policy = policy_logps(models[0], batch)
    with pytest.raises(ValueError, match="reference"):
        preference_loss("dpo", PreferenceSpec(), policy, None, None)
