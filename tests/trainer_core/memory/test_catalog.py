"""Every catalog entry instantiates on the meta device with its pinned size; published sizes agree."""

from __future__ import annotations

import pytest
import transformers
from accelerate import init_empty_weights

from trainer_core.memory import catalog_entry, catalog_ids
from trainer_core.memory.catalog import catalog_config, catalog_published
from trainer_core.memory.parameters import build_structure
from trainer_core.modeling import config_from_dict

REQUIRED = [
    "bert-base-uncased", "bert-base-cased", "bert-large-uncased", "bert-large-cased",
    "distilbert-base-uncased", "distilbert-base-cased", "roberta-base", "roberta-large",
    "microsoft/deberta-v3-base", "albert-base-v2", "google/electra-base-discriminator", "xlm-roberta-base",
    "gpt2", "google/vit-base-patch16-224", "facebook/convnext-tiny-224", "microsoft/resnet-50",
    "microsoft/swin-tiny-patch4-window7-224", "facebook/wav2vec2-base", "facebook/hubert-base-ls960",
    "MIT/ast-finetuned-audioset-10-10-0.4593", "openai/whisper-base", "meta-llama/Meta-Llama-3-8B",
    "mistralai/Mistral-7B-v0.1", "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-7B",
]  # fmt: skip


def test_catalog_has_the_required_architectures() -> None:
    ids = catalog_ids()
    assert len(ids) >= 25
    assert set(REQUIRED) <= set(ids)
    tasks = {catalog_entry(i)["task"] for i in ids}
    assert tasks == {"text-classification", "image-classification", "audio-classification", "causal-lm"}


def test_every_entry_instantiates_on_meta_with_its_stored_size() -> None:
    for model_id in catalog_ids():
        entry = catalog_entry(model_id)
        assert set(entry) == {"id", "task", "model_type", "parameters"}
        structure = build_structure(("catalog", model_id), entry["task"], 2)
        assert structure.parameters == entry["parameters"], model_id
        assert structure.model_type == entry["model_type"]


@pytest.mark.parametrize(
    "model_id",
    ["bert-base-uncased", "roberta-large", "gpt2", "google/vit-base-patch16-224", "microsoft/resnet-50",
     "facebook/wav2vec2-base", "meta-llama/Meta-Llama-3-8B", "Qwen/Qwen2.5-0.5B", "mistralai/Mistral-7B-v0.1"],
)  # fmt: skip
def test_published_sizes_within_three_percent(model_id: str) -> None:
    published = catalog_published(model_id)
    config = config_from_dict(catalog_config(model_id))
    if published["num_labels"]:
        config.num_labels = published["num_labels"]
    with init_empty_weights():
        model = getattr(transformers, published["auto_class"]).from_config(config)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / published["parameters"] - 1) < 0.03, (model_id, count)


def test_unknown_catalog_id_raises_key_error() -> None:
    with pytest.raises(KeyError):
        catalog_entry("not-a-model")


# Current open LLMs as causal LMs, each with the size its authors publish (model card, or the hub's
# count where the card rounds it), to 1%.
PUBLISHED_LLM_SIZES = {
    "meta-llama/Llama-3.1-8B": 8.03e9,
    "meta-llama/Llama-3.1-70B": 70.6e9,
    "meta-llama/Llama-3.2-3B": 3.21e9,
    "Qwen/Qwen2.5-3B": 3.09e9,
    "Qwen/Qwen2.5-14B": 14.7e9,
    "Qwen/Qwen3-0.6B": 0.6e9,
    "Qwen/Qwen3-4B": 4.0e9,
    "Qwen/Qwen3-8B": 8.2e9,
    "Qwen/Qwen3-14B": 14.8e9,
    "mistralai/Mistral-7B-v0.3": 7.25e9,
    "google/gemma-2-2b": 2.61e9,
    "google/gemma-2-9b": 9.24e9,
    "google/gemma-3-1b-pt": 1.0e9,
    "microsoft/Phi-3-mini-4k-instruct": 3.82e9,
    "microsoft/Phi-4-mini-instruct": 3.84e9,
    "HuggingFaceTB/SmolLM2-135M": 135e6,
    "HuggingFaceTB/SmolLM2-360M": 360e6,
    "HuggingFaceTB/SmolLM2-1.7B": 1.7e9,
}


@pytest.mark.parametrize("model_id", sorted(PUBLISHED_LLM_SIZES))
def test_llm_sizes_within_one_percent_of_published(model_id: str) -> None:
    assert catalog_entry(model_id)["task"] == "causal-lm"
    assert catalog_published(model_id)["parameters"] == PUBLISHED_LLM_SIZES[model_id]
    count = build_structure(("catalog", model_id), "causal-lm", 2).parameters
    assert abs(count / PUBLISHED_LLM_SIZES[model_id] - 1) < 0.01, (model_id, count)
