"""DPO and ORPO train on both backends through the one loop SFT uses: the reward accuracy rises on pairs
with a clear preference, both backends report the same keys, the reference is the starting model
(a frozen copy, the adapter disabled, the SFT adapter, or precomputed and kept across a resume).

The pairs are hand-made tokens, as tests/trainer_core/llm_runs.py makes SFT data: a counting prompt,
the chosen answer counts on, the rejected one is random tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from safetensors.torch import load_file

from tests.trainer_core.llm_data import lm_spec, write_lm_tokenizer, write_preference_jsonl
from tests.trainer_core.llm_runs import IGNORE, VOCAB, llm_spec, run_llm
from tests.trainer_core.runhelpers import BACKENDS, done_event
from tests.trainer_core.runhelpers import run as run_job
from trainer_core.backends import reference
from trainer_core.backends.reference import REFERENCE_FILE
from trainer_core.data import PreparedData
from trainer_core.data.preference import PreferenceCollator
from trainer_core.events import EventCollector
from trainer_core.spec import JobSpec, parse_spec
from trainer_core.spec_preference import REWARD_METRICS, reward_metrics

ACCURACY = "rewards/accuracies"


def preference_rows(n: int, seed: int) -> dict[str, list[Any]]:
    """``n`` pairs: a 4-token counting prompt; chosen counts on for 4 tokens, rejected is 4 random tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows: dict[str, list[Any]] = {k: [] for k in ("chosen_input_ids", "chosen_labels", "rejected_input_ids",
                                                  "rejected_labels", "length")}  # fmt: skip
    for _ in range(n):
        start = int(torch.randint(1, VOCAB, (1,), generator=gen))
        prompt = [(start + i) % VOCAB or 1 for i in range(4)]
        chosen = [(start + 4 + i) % VOCAB or 1 for i in range(4)]
        rejected = [int(t) for t in torch.randint(1, VOCAB, (4,), generator=gen)]
        for side, answer in (("chosen", chosen), ("rejected", rejected)):
            rows[f"{side}_input_ids"].append(prompt + answer)
            rows[f"{side}_labels"].append([IGNORE] * len(prompt) + answer)
        rows["length"].append(8)
    return rows


def preference_data(n_train: int = 32, n_eval: int = 8, eval_seed: int = 1) -> PreparedData:
    """Train pairs and eval pairs; ``eval_seed`` 0: the eval pairs are the first training pairs (a tiny
    model memorises its pairs in a few steps, it does not learn to count that fast)."""
    return PreparedData(
        train=datasets.Dataset.from_dict(preference_rows(n_train, seed=0)),
        eval=datasets.Dataset.from_dict(preference_rows(n_eval, seed=eval_seed)) if n_eval else None,
        labels=[],
        collator=PreferenceCollator(pad_token_id=0),
        processor=None,
        cache_hit=False,
        cache_key="handmade-pairs",
    )


def preference_spec(
    method: str, kind: str, backend: str, reference: str = "base", **sections: dict[str, Any]
) -> JobSpec:
    """:func:`llm_spec`'s tiny Llama with adapter ``kind``, tuned by ``method``; ``sections`` are merged in."""
    sft = llm_spec("llama", kind, backend, training={"max_steps": 12, "learning_rate": 5e-3, "logging_steps": 3},
                   preprocessing={"max_length": 32})  # fmt: skip
    doc = sft.model_dump(mode="json", exclude_unset=True)
    doc["method"] = method
    doc["preference"] = {"beta": 0.5} | ({"reference": reference} if method == "dpo" else {})
    for name, values in sections.items():
        doc[name] = {**(doc.get(name) or {}), **values}
    return parse_spec(doc)


def run(spec: JobSpec, out: Path, **kwargs: Any) -> EventCollector:
    result, events = run_llm(spec, out, data=kwargs.pop("data", None) or preference_data(), **kwargs)
    assert result.status == "succeeded", result
    return events


def metric_values(events: EventCollector, key: str) -> list[float]:
    return [float(e["values"][key]) for e in events.of_kind("metric")]


RUNS = [("dpo", "lora", "base"), ("dpo", "full", "base"), ("dpo", "full", "precomputed"), ("orpo", "full", "base")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("method", "kind", "ref"), RUNS)
def test_reward_accuracy_rises_above_half(tmp_path: Path, backend: str, method: str, kind: str, ref: str) -> None:
    events = run(preference_spec(method, kind, backend, ref), tmp_path / "out")
    accuracies = metric_values(events, ACCURACY)
    assert len(accuracies) == 4
    assert accuracies[-1] > 0.5 and accuracies[-1] > accuracies[0], accuracies
    margins = metric_values(events, "rewards/margins")
    assert margins[-1] > margins[0], margins
    spec = preference_spec(method, kind, backend, ref)
    for event in events.of_kind("metric"):  # the method's own metrics, each step (ORPO: TRL's two more)
        values = event["values"]
        assert set(values) == {"loss", "learning_rate", "grad_norm", *reward_metrics(method)}
        if method == "orpo":  # the logged loss is made of them: the NLL less beta x the odds-ratio term
            expected = values["nll_loss"] - spec.preference_settings.beta * values["log_odds_ratio"]
            assert values["loss"] == pytest.approx(expected, abs=1e-4), values


def test_both_backends_emit_the_same_keys(tmp_path: Path) -> None:
    keys = {}
    for backend in BACKENDS:
        spec = preference_spec(
            "dpo", "lora", backend, training={"max_steps": 4, "logging_steps": 2, "eval_strategy": "steps",
                                              "eval_steps": 2, "save_steps": 2},
        )  # fmt: skip
        events = run(spec, tmp_path / backend)
        metric, evaluation = events.of_kind("metric"), events.of_kind("eval")
        assert [e["step"] for e in metric] == [e["step"] for e in evaluation] == [2, 4]
        assert set(evaluation[-1]["values"]) == set(spec.evaluation_metrics())
        kinds = [e["event"] for e in events.events if e["event"] != "log"]
        keys[backend] = (kinds, set(metric[-1]["values"]), set(evaluation[-1]["values"]))
        written = {path.name for path in (tmp_path / backend).iterdir()}
        assert {"adapter_model.safetensors", "checkpoint-2", "checkpoint-4"} <= written  # as an SFT run's
    assert keys["trainer"] == keys["accelerate"]
    assert keys["trainer"][1] == {"loss", "learning_rate", "grad_norm", *REWARD_METRICS}


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_precomputed_reference_trains_as_the_frozen_copy(tmp_path: Path, backend: str, mixed_precision: str) -> None:
    losses, rewards = {}, {}
    for ref in ("base", "precomputed"):
        spec = preference_spec(
            "dpo", "full", backend, ref, training={"max_steps": 4, "logging_steps": 1},
            efficiency={"mixed_precision": mixed_precision},
        )  # fmt: skip
        events = run(spec, tmp_path / ref)
        losses[ref], rewards[ref] = metric_values(events, "loss"), metric_values(events, "rewards/chosen")
        # At the first step the policy is its reference, scored the same way: every reward is zero.
        assert rewards[ref][0] == 0.0 and losses[ref][0] == pytest.approx(0.693147, abs=1e-6)
    assert losses["precomputed"] == pytest.approx(losses["base"], abs=1e-5)
    assert (tmp_path / "precomputed" / REFERENCE_FILE).is_file()
    assert not (tmp_path / "base" / REFERENCE_FILE).exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_reads_the_stored_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    spec = preference_spec(
        "dpo", "full", backend, "precomputed", training={"max_steps": 6, "save_steps": 3, "logging_steps": 1}
    )
    whole = run(spec, tmp_path / "whole")
    checkpoint = tmp_path / "whole" / "checkpoint-3"
    assert (checkpoint / REFERENCE_FILE).is_file()

    def no_scoring(*args: Any) -> None:
        raise AssertionError("a resumed run scored its reference again")

    monkeypatch.setattr(reference, "_score", no_scoring)
    resumed = run(spec, tmp_path / "resumed", resume_from=checkpoint)
    assert metric_values(resumed, "loss") == pytest.approx(metric_values(whole, "loss")[3:], abs=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulation_and_an_8bit_optimizer_run(tmp_path: Path, backend: str) -> None:
    extra: dict[str, Any] = {"gradient_accumulation_steps": 2}
    if backend == "accelerate":
        extra["local_sgd_steps"] = 2
    spec = preference_spec(
        "dpo", "full", backend, efficiency=extra, optimizer={"name": "adamw_8bit"},
        training={"max_steps": 6, "per_device_train_batch_size": 4, "logging_steps": 2},
    )  # fmt: skip
    events = run(spec, tmp_path / "out")
    assert [e["step"] for e in events.of_kind("metric")] == [2, 4, 6]
    assert metric_values(events, ACCURACY)[-1] > 0.5


@pytest.mark.parametrize("ref", ["base", "precomputed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_sft_adapter_from_init_from_is_the_reference(tmp_path: Path, backend: str, ref: str) -> None:
    sft_result, _ = run_llm(llm_spec("llama", "lora", backend), tmp_path / "sft")
    assert sft_result.status == "succeeded"
    spec = preference_spec(
        "dpo", "lora", backend, ref, init_from={"path": str(tmp_path / "sft")},
        training={"max_steps": 2, "logging_steps": 1, "save_steps": 1},
    )  # fmt: skip
    events = run(spec, tmp_path / "dpo")
    resumed = run(spec, tmp_path / "resumed", resume_from=tmp_path / "dpo" / "checkpoint-1")
    assert metric_values(resumed, "loss") == pytest.approx(metric_values(events, "loss")[1:], abs=1e-6)
    first = events.of_kind("metric")[0]["values"]
    # At the first step the policy is the SFT adapter; so is its reference, so every reward is zero
    # (the raw base as reference would give the SFT adapter's log-ratio instead).
    assert first["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
    assert first["rewards/rejected"] == pytest.approx(0.0, abs=1e-6)
    assert first["loss"] == pytest.approx(0.6931, abs=1e-3)
    for folder in (tmp_path / "dpo", tmp_path / "dpo" / "checkpoint-1"):
        assert not (folder / "reference").exists()  # only the trained adapter is saved


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_best_checkpoint_and_early_stopping_go_by_reward_accuracy(tmp_path: Path, backend: str) -> None:
    spec = preference_spec(
        "dpo", "lora", backend,
        training={"max_steps": 12, "logging_steps": 2, "eval_strategy": "steps", "eval_steps": 2, "save_steps": 2,
                  "metric_for_best_model": "rewards/accuracies", "load_best_model_at_end": True},
        early_stopping={"metric": "rewards/accuracies", "patience": 2},
    )  # fmt: skip
    result, events = run_llm(spec, tmp_path / "out", data=preference_data(eval_seed=0))
    assert result.status == "succeeded"
    accuracies = [e["values"]["eval_rewards/accuracies"] for e in events.of_kind("eval")]
    # The accuracy reaches 1 and stays: two evaluations without improvement end the run early.
    assert accuracies[-3] == accuracies[-2] == accuracies[-1] == 1.0, accuracies
    assert result.global_step < 12
    assert result.eval_metrics["eval_rewards/accuracies"] == max(accuracies)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qlora_with_bf16_and_gradient_checkpointing_learns(tmp_path: Path, backend: str) -> None:
    spec = preference_spec(
        "dpo", "qlora", backend, adapter={"compute_dtype": "bf16"},
        efficiency={"mixed_precision": "bf16", "gradient_checkpointing": True},
    )  # fmt: skip
    accuracies = metric_values(run(spec, tmp_path / "out"), ACCURACY)
    assert accuracies[-1] > 0.5 and accuracies[-1] > accuracies[0], accuracies


def job_spec(tmp_path: Path, backend: str, **sections: Any) -> JobSpec:
    """A DPO job on prompt/chosen/rejected JSON lines and a trained tokenizer, run by ``train_job``."""
    # 30 and 7 rows: two processes' last batches are uneven, which gathering must undo.
    files = write_preference_jsonl(tmp_path / "data", "text", n_train=30, n_val=7)
    doc = lm_spec(files, write_lm_tokenizer(tmp_path / "tokenizer"), method="dpo",
                  preference={"reference": "precomputed"})  # fmt: skip
    doc["training"] |= {"backend": backend, "max_steps": 4, "eval_strategy": "steps", "eval_steps": 2,
                        "save_steps": 2, "learning_rate": 5e-3}  # fmt: skip
    for name, values in sections.items():
        doc[name] = {**doc.get(name, {}), **values}
    return parse_spec(doc)


@pytest.mark.parametrize("backend", BACKENDS)
def test_train_job_runs_dpo_on_prepared_data(tmp_path: Path, backend: str) -> None:
    spec = job_spec(tmp_path, backend)
    status, events = run_job(spec, tmp_path / "out")
    assert status == "succeeded", done_event(events)
    summary = done_event(events)["summary"]
    assert set(summary["eval"]) == set(spec.evaluation_metrics())
    assert summary["train"]["train_samples"] == 4 * 4  # pairs: 4 steps of 4
    assert (tmp_path / "out" / "checkpoint-2" / REFERENCE_FILE).is_file()


@pytest.mark.slow
@pytest.mark.usefixtures("warm_runs")  # the run of two processes forks from a zygote (runhelpers.run says why)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_processes_run_dpo(tmp_path: Path, backend: str) -> None:
    spec = job_spec(tmp_path, backend, resources={"num_processes": 2})
    status, events = run_job(spec, tmp_path / "out")
    assert status == "succeeded", done_event(events)
    assert set(events.of_kind("metric")[-1]["values"]) >= set(REWARD_METRICS)
    assert set(done_event(events)["summary"]["eval"]) == set(spec.evaluation_metrics())
    # Each process scored half the rows; gathered, they are the rows one process scores, in order.
    status, _ = run_job(job_spec(tmp_path, backend), tmp_path / "one")
    assert status == "succeeded"
    one, two = (load_file(str(tmp_path / name / REFERENCE_FILE)) for name in ("one", "out"))
    assert {k: len(v) for k, v in two.items()} == {f"{split}.ref_{side}_logps": n for split, n in (("train", 30),
                                                   ("eval", 7)) for side in ("chosen", "rejected")}  # fmt: skip
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=1e-5)
