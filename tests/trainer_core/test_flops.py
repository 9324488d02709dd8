"""The FLOP count of trainer_core/flops.py against values worked out by hand from each shape (issue 29).

Each expected figure is written out from the module's rule (docstring): Linear ``2*in*out`` a token
forward, backward ``2*in*out`` plus ``2*in*out`` where the weight trains, LoRA ``6*r*(in+out)``,
attention ``4*s*s*h`` a layer forward and twice that backward, checkpointing one more forward of the
layers; an encoder's pooler and classifier once a sample.
"""

from __future__ import annotations

from typing import Any

import pytest

from trainer_core.flops import NotModelled, run_samples, sample_flops, training_flops
from trainer_core.memory.parameters import model_structure
from trainer_core.spec import JobSpec

S = 16  # tokens a sample (max_length)


def spec_of(task: str, config: dict[str, Any], **sections: Any) -> JobSpec:
    return JobSpec.model_validate({
        "name": "flops", "task": task, "model": {"config": config},
        "dataset": {"path": "csv", "data_files": {"train": "train.csv"}},
        "preprocessing": {"max_length": S}, **sections,
    })  # fmt: skip


BERT = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 64}  # fmt: skip
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 64,
         "tie_word_embeddings": False}  # fmt: skip


def flops_of(spec: JobSpec, num_labels: int | None = 2) -> tuple[int, int]:
    structure = model_structure(spec.model, spec.task, num_labels if spec.task != "causal-lm" else None)
    counted = sample_flops(structure, spec)
    assert counted.tokens == S
    return counted.forward, counted.train


def test_bert_classification_full_fine_tune() -> None:
    # A layer a token: Q, K, V, O 4 x 64*64 + MLP 64*128 + 128*64 = 32,768 multiply-adds; 2 layers.
    layers = 2 * (4 * 64 * 64 + 2 * 64 * 128) * S
    heads = 64 * 64 + 64 * 2  # pooler and classifier: once a sample
    attention = 4 * S * S * 64 * 2
    forward = 2 * layers + 2 * heads + attention
    assert forward == 2_236_672
    assert flops_of(spec_of("text-classification", BERT)) == (forward, 3 * forward)


def test_bert_with_gradient_checkpointing_runs_the_layers_forward_twice() -> None:
    layers, heads, attention = 2 * (4 * 64 * 64 + 2 * 64 * 128) * S, 64 * 64 + 64 * 2, 4 * S * S * 64 * 2
    forward = 2 * layers + 2 * heads + attention
    spec = spec_of("text-classification", BERT, efficiency={"gradient_checkpointing": True})
    assert flops_of(spec) == (forward, 3 * forward + 2 * layers + attention)


def llama_base() -> tuple[int, int, int]:
    """Llama a token: q 64x64, k and v 64x32 (2 of 4 heads for K/V), o 64x64, gate/up 64x128,
    down 128x64 per layer, 2 layers; the LM head 64x100; attention over 16 positions."""
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
    return 2 * per_layer * S, 64 * 100 * S, 4 * S * S * 64 * 2


def test_llama_causal_lm_full_fine_tune() -> None:
    layers, head, attention = llama_base()
    forward = 2 * layers + 2 * head + attention
    assert forward == 2_695_168
    assert flops_of(spec_of("causal-lm", LLAMA)) == (forward, 3 * forward)


def test_packing_attends_within_each_row_as_padding_does() -> None:
    # Packed rows stay B=4 rows of 16 with a block-diagonal mask: each position's scores span 16 keys.
    layers, head, attention = llama_base()
    forward = 2 * layers + 2 * head + attention
    packed = spec_of("causal-lm", LLAMA, preprocessing={"max_length": S, "packing": True},
                     training={"per_device_train_batch_size": 4})  # fmt: skip
    assert flops_of(packed) == (forward, 3 * forward)


def test_llama_lora_counts_input_gradients_through_the_frozen_base_and_the_branches() -> None:
    layers, head, attention = llama_base()
    # r 8 on every all-linear module (not the LM head): 6 * r * (in + out) a token.
    in_out = 2 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64))
    lora_forward = 2 * 8 * in_out * S
    forward = 2 * layers + 2 * head + lora_forward + attention
    backward = 2 * layers + 2 * head + 2 * lora_forward + 2 * attention  # no weight gradient of the base
    adapter = {"type": "lora", "r": 8, "target_modules": "all-linear"}
    assert flops_of(spec_of("causal-lm", LLAMA, adapter=adapter)) == (forward, forward + backward)
    checkpointed = spec_of("causal-lm", LLAMA, adapter=adapter, efficiency={"gradient_checkpointing": True})
    recompute = 2 * layers + lora_forward + attention
    assert flops_of(checkpointed) == (forward, forward + backward + recompute)


def test_llama_classification_runs_its_score_head_on_every_position_and_trains_it_under_lora() -> None:
    layers, _, attention = llama_base()
    score = 64 * 2 * S
    adapter = {"type": "lora", "r": 8, "target_modules": ["q_proj", "v_proj"]}
    lora_forward = 2 * 8 * 2 * ((64 + 64) + (64 + 32)) * S
    forward = 2 * layers + 2 * score + lora_forward + attention
    backward = 2 * layers + 4 * score + 2 * lora_forward + 2 * attention  # the head trains (modules_to_save)
    assert flops_of(spec_of("text-classification", LLAMA, adapter=adapter)) == (forward, forward + backward)


def test_convolutional_models_are_not_modelled() -> None:
    spec = JobSpec.model_validate({
        "name": "resnet", "task": "image-classification",
        "model": {"config": {"model_type": "resnet", "embedding_size": 8, "hidden_sizes": [8, 16],
                             "depths": [1, 1], "num_channels": 3}},
        "dataset": {"path": "imagefolder", "data_dir": "images"},
    })  # fmt: skip
    structure = model_structure(spec.model, spec.task, 2)
    with pytest.raises(NotModelled, match="resnet"):
        sample_flops(structure, spec)


@pytest.mark.parametrize(
    ("training", "accumulation", "rows", "expected"),
    [
        # 100 rows, batch 8: 13 batches an epoch (the last of 4), accumulation 2: 7 steps an epoch.
        ({"num_train_epochs": 3, "per_device_train_batch_size": 8}, 2, 100, (21, 300, 3 * 20)),
        # max_steps 10 = one epoch (7 steps, 100 rows) + 3 steps of 16 rows; evaluations every 4 steps: 2.
        ({"max_steps": 10, "per_device_train_batch_size": 8, "eval_strategy": "steps", "eval_steps": 4}, 2, 100,
         (10, 148, 2 * 20)),
        # 1.5 epochs of 4 steps (32 rows, batch 8): 6 steps, 48 rows, 2 epochs begun: 2 evaluations.
        ({"num_train_epochs": 1.5, "per_device_train_batch_size": 8}, 1, 32, (6, 48, 2 * 20)),
        ({"num_train_epochs": 1, "per_device_train_batch_size": 8, "eval_strategy": "no"}, 1, 32, (4, 32, 0)),
    ],
)  # fmt: skip
def test_steps_samples_and_evaluations_follow_the_trainer(
    training: dict[str, Any], accumulation: int, rows: int, expected: tuple[int, int, int]
) -> None:
    spec = spec_of("text-classification", BERT, training=training,
                   efficiency={"gradient_accumulation_steps": accumulation})  # fmt: skip
    assert run_samples(spec, rows, 20) == expected


def test_a_runs_work_is_its_samples_times_a_sample_plus_its_evaluations() -> None:
    spec = spec_of("text-classification", BERT, training={"num_train_epochs": 2, "per_device_train_batch_size": 8})
    structure = model_structure(spec.model, spec.task, 2)
    work = training_flops(structure, spec, train_rows=40, eval_rows=10)
    forward, train = flops_of(spec)
    assert (work.train, work.eval) == (80 * train, 2 * 10 * forward)
    assert work.total == work.train + work.eval


def pair_flops(spec: JobSpec) -> tuple[int, int, int, int]:
    """(tokens, forward, train, precompute) of one DPO/ORPO pair."""
    pair = sample_flops(model_structure(spec.model, spec.task), spec)
    return pair.tokens, pair.forward, pair.train, pair.precompute


def test_an_orpo_pair_is_its_two_sequences_forward_and_backward() -> None:
    layers, head, attention = llama_base()
    forward = 2 * layers + 2 * head + attention  # one sequence of 16 positions
    assert pair_flops(spec_of("causal-lm", LLAMA, method="orpo")) == (2 * S, 2 * forward, 6 * forward, 0)


def test_dpo_scores_its_reference_every_step_or_once_before_training() -> None:
    layers, head, attention = llama_base()
    forward = 2 * layers + 2 * head + attention
    # The frozen copy's forward of both sequences: a third of their training work, on every sample.
    assert pair_flops(spec_of("causal-lm", LLAMA, method="dpo")) == (2 * S, 4 * forward, 8 * forward, 0)
    precomputed = spec_of("causal-lm", LLAMA, method="dpo", preference={"reference": "precomputed"},
                          training={"num_train_epochs": 2, "per_device_train_batch_size": 8})  # fmt: skip
    assert pair_flops(precomputed) == (2 * S, 2 * forward, 6 * forward, 2 * forward)
    # Two epochs of 40 pairs, two evaluations of 10; each row scored once, before training.
    work = training_flops(model_structure(precomputed.model, "causal-lm"), precomputed, train_rows=40, eval_rows=10)
    assert (work.train, work.eval) == (80 * 6 * forward + 40 * 2 * forward, 20 * 2 * forward + 10 * 2 * forward)


def test_a_dpo_adapters_reference_is_the_base_without_its_branches() -> None:
    layers, head, attention = llama_base()
    in_out = 2 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64))
    lora_forward = 2 * 8 * in_out * S
    forward = 2 * layers + 2 * head + lora_forward + attention
    backward = 2 * layers + 2 * head + 2 * lora_forward + 2 * attention
    reference = 2 * layers + 2 * head + attention  # adapter disabled
    adapter = {"type": "lora", "r": 8, "target_modules": "all-linear"}
    spec = spec_of("causal-lm", LLAMA, method="dpo", adapter=adapter)
    assert pair_flops(spec) == (2 * S, 2 * (forward + reference), 2 * (forward + backward + reference), 0)


def test_measured_tokens_of_a_pair_are_both_sequences() -> None:
    """token_lengths.py measures a pair as both its (padded) sequences: each is half of them."""
    spec = spec_of("causal-lm", LLAMA, method="orpo")
    structure = model_structure(spec.model, spec.task)
    assert sample_flops(structure, spec, 2 * S) == sample_flops(structure, spec)
