"""Activation estimates follow Korthikanti et al. and move the right way with each setting."""

from __future__ import annotations

import dataclasses
from typing import Any

from tests.trainer_core.memory.conftest import SpecFactory, spec_dict
from tests.trainer_core.memory.llm_models import LLM_CONFIGS
from trainer_core.memory import estimate_memory
from trainer_core.memory.activations import LayerShape, estimate_activations, layer_bytes
from trainer_core.memory.parameters import model_structure
from trainer_core.spec import parse_spec


def activation(make_spec: SpecFactory, model: str, **sections: dict[str, object]) -> int:
    return estimate_memory(make_spec(model, **sections)).activation_bytes


def test_layer_formula_reduces_to_korthikanti_for_bert_shapes() -> None:
    s, b, h, a = 512, 8, 1024, 16
    shape = LayerShape(s, h, a, 4 * h, 1.0, False, True, s, True)
    assert layer_bytes(shape, b, 2) == s * b * h * (34 + 5 * a * s // h)
    # fp32 doubles the 2-byte terms; the 1-byte dropout masks stay
    assert layer_bytes(shape, b, 4) == s * b * h * (66 + 9 * a * s // h)
    no_scores = LayerShape(s, h, a, 4 * h, 1.0, False, False, s, True)
    assert layer_bytes(no_scores, b, 2) == s * b * h * 34


def test_activations_grow_with_batch_and_sequence(make_spec: SpecFactory) -> None:
    base = activation(make_spec, "bert-base-uncased", training={"per_device_train_batch_size": 8})
    double_batch = activation(make_spec, "bert-base-uncased", training={"per_device_train_batch_size": 16})
    longer = activation(
        make_spec, "bert-base-uncased",
        training={"per_device_train_batch_size": 8}, preprocessing={"max_length": 256},
    )  # fmt: skip
    assert double_batch > 1.9 * base
    assert longer > 1.9 * base
    # eager attention (DeBERTa) stores scores, so doubling s more than doubles its activations
    deberta = activation(make_spec, "microsoft/deberta-v3-base")
    deberta_long = activation(make_spec, "microsoft/deberta-v3-base", preprocessing={"max_length": 256})
    assert deberta_long > 2.1 * deberta


def test_checkpointing_and_autocast_shrink_activations(make_spec: SpecFactory) -> None:
    full = activation(make_spec, "google/vit-base-patch16-224")
    ckpt = activation(make_spec, "google/vit-base-patch16-224", efficiency={"gradient_checkpointing": True})
    half = activation(make_spec, "google/vit-base-patch16-224", efficiency={"mixed_precision": "bf16"})
    assert ckpt < full / 4
    assert 0.45 * full < half < 0.6 * full
    accumulate = activation(make_spec, "google/vit-base-patch16-224", efficiency={"gradient_accumulation_steps": 8})
    assert accumulate == full  # accumulation adds no activation memory


def test_audio_frames_follow_duration(make_spec: SpecFactory) -> None:
    short = activation(make_spec, "facebook/wav2vec2-base", preprocessing={"max_duration_s": 5.0})
    long = activation(make_spec, "facebook/wav2vec2-base", preprocessing={"max_duration_s": 10.0})
    assert 1.9 * short < long < 2.1 * short
    # Whisper pads to 30 s whatever the clip length, so its estimate does not move
    w5 = activation(make_spec, "openai/whisper-base", preprocessing={"max_duration_s": 5.0})
    w10 = activation(make_spec, "openai/whisper-base", preprocessing={"max_duration_s": 10.0})
    assert w5 == w10


def test_conv_nets_scale_with_batch(make_spec: SpecFactory) -> None:
    one = activation(make_spec, "microsoft/resnet-50", training={"per_device_train_batch_size": 1})
    eight = activation(make_spec, "microsoft/resnet-50", training={"per_device_train_batch_size": 8})
    assert 7.9 * one < eight <= 8 * one



def test_packing_models_each_attention_paths_mask() -> None:
    # Packed rows stay b x s under eager and SDPA, plus their b x s x s block-diagonal mask: one fp32
    # copy for eager; for SDPA the bool mask, each layer's fp32 copy, and K/V repeated from 2 heads to
    # 4 (2 layers, h 64, fp32). Flash attention's flattened batch has no mask.
    b, s = 4, 64
    sections: dict[str, Any] = {"training": {"per_device_train_batch_size": b}}
    padded = parse_spec(spec_dict("causal-lm", {"config": LLM_CONFIGS["llama"]}, **sections,
                                  preprocessing={"max_length": s}))  # fmt: skip
    packed = padded.model_copy(update={"preprocessing": padded.preprocessing.model_copy(update={"packing": True})})
    meta = model_structure(padded.model, "causal-lm", None)
    repeated_kv = 2 * s * b * 64 * 4 * (1 - 2 / 4)  # K and V a layer
    expected = {"eager": 4 * b * s * s, "sdpa": b * s * s * (1 + 2 * 4) + 2 * repeated_kv, "flash_attention_2": 0}
    for attn, extra in expected.items():
        structure = dataclasses.replace(meta, attn_implementation=attn)
        counted = estimate_activations(structure, packed).bytes - estimate_activations(structure, padded).bytes
        assert counted == extra, attn
