"""Text inputs: the tokenizer (loaded, or trained on the training text), tokenisation, dynamic padding."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import (
    AutoTokenizer,
    DataCollatorWithPadding,
    PreTrainedConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from trainer_core.data.loading import spec_error
from trainer_core.spec import JobSpec

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# Bumped when train_wordpiece changes, so cached data tokenised by an older recipe is rebuilt.
TRAINED_TOKENIZER_RECIPE = "wordpiece-words-lowercase-v1"


def tokenizer_source(spec: JobSpec) -> str | None:
    """Where the tokenizer comes from: ``model.tokenizer``, else ``model.name_or_path``, else None
    (a config-built model with no tokenizer: one is trained on the training text)."""
    return spec.model.tokenizer or spec.model.name_or_path


def lm_tokenizer_source(spec: JobSpec) -> str:
    """causal-lm's tokenizer: one must be named (its special tokens and chat template matter)."""
    source = tokenizer_source(spec)
    if source is None:
        raise spec_error("model.tokenizer", "causal-lm with a config-built model needs a tokenizer named here")
    return source


def load_tokenizer(spec: JobSpec) -> PreTrainedTokenizerBase:
    """The named tokenizer; the model's revision applies only when it comes from the model itself."""
    source = tokenizer_source(spec)
    assert source is not None, "config-built models without a tokenizer use train_wordpiece"
    revision = spec.model.revision if spec.model.tokenizer is None else None
    tokenizer = AutoTokenizer.from_pretrained(source, revision=revision)
    if spec.task == "causal-lm":
        return ready_for_lm(tokenizer, source)
    if tokenizer.pad_token is None:
        raise spec_error("model.tokenizer", f"tokenizer {source!r} has no padding token; dynamic padding needs one")
    return tokenizer


def ready_for_lm(tokenizer: PreTrainedTokenizerBase, source: str) -> PreTrainedTokenizerBase:
    """A tokenizer set up for causal-lm: an end-of-sequence token, a padding token, right padding.

    A BERT-style tokenizer (no eos) ends sequences with its ``[SEP]``; with no padding token, padding
    reuses eos (as GPT-2 and Llama fine-tunes do): padded positions are masked and their labels -100.
    """
    if tokenizer.eos_token is None:
        if tokenizer.sep_token is None:
            raise spec_error("model.tokenizer", f"tokenizer {source!r} has no end-of-sequence (or separator) token")
        tokenizer.eos_token = tokenizer.sep_token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def train_wordpiece(
    texts: Iterable[str], vocab_size: int, model_max_length: int, with_token_types: bool = True
) -> PreTrainedTokenizerFast:
    """A lowercasing BERT-style WordPiece tokenizer built from ``texts``, at most ``vocab_size`` tokens.

    Used for config-built models so that a run needs no hub. The vocabulary is the special tokens
    (``[PAD]`` = 0, the pad id BERT-like configs default to), every character seen (alone and as a
    ``##`` continuation, so nothing is unknown), then whole words by frequency. Built by hand rather
    than with ``WordPieceTrainer``: that trainer breaks frequency ties in hash order, so two runs on the
    same text learn different vocabularies, and a resumed run must tokenise exactly like the first.
    ``with_token_types`` adds ``token_type_ids`` (segment ids) for models that take them.
    """
    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    chars = sorted({c for word in counts for c in word})
    base = [*SPECIAL_TOKENS, *chars, *(f"##{c}" for c in chars)]
    if len(base) > vocab_size:
        raise spec_error(
            "model.config.vocab_size",
            f"the training text has {len(chars)} distinct characters; vocab_size must be at least {len(base)}",
        )
    words = sorted((w for w in counts if len(w) > 1), key=lambda w: (-counts[w], w))
    vocab = base + words[: vocab_size - len(base)]
    core = Tokenizer(models.WordPiece(vocab={t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    core.normalizer = normalizer
    core.pre_tokenizer = pre_tokenizer
    core.decoder = decoders.WordPiece()
    cls_id, sep_id = core.token_to_id("[CLS]"), core.token_to_id("[SEP]")
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=model_max_length,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"]
        if with_token_types
        else ["input_ids", "attention_mask"],
    )


def trained_tokenizer_settings(model_config: PreTrainedConfig) -> dict[str, Any]:
    """What a trained tokenizer depends on besides the training text (part of the cache key)."""
    return {
        "recipe": TRAINED_TOKENIZER_RECIPE,
        "vocab_size": int(model_config.vocab_size),
        "model_max_length": int(getattr(model_config, "max_position_embeddings", 512)),
        # Models with a segment embedding (BERT-like) take token_type_ids; others would reject them.
        "with_token_types": int(getattr(model_config, "type_vocab_size", 0) or 0) > 0,
    }


def train_tokenizer_for(model_config: PreTrainedConfig, texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """Train the tokenizer a config-built model uses, sized by its config."""
    settings = trained_tokenizer_settings(model_config)
    return train_wordpiece(
        texts, settings["vocab_size"], settings["model_max_length"], settings["with_token_types"]
    )


def as_text(values: list[Any], field: str) -> list[str]:
    """A batch column as strings; a missing value is a data error naming ``dataset.<field>``."""
    if any(v is None for v in values):
        raise spec_error(f"dataset.{field}", "some rows have no text")
    return [v if isinstance(v, str) else str(v) for v in values]


@dataclass(frozen=True)
class TextEncoder:
    """Tokenises a batch of rows: truncated to ``max_length``, not padded (the collator pads)."""

    tokenizer: PreTrainedTokenizerBase
    text_column: str
    text_pair_column: str | None
    label_column: str
    label_to_id: Mapping[Any, int]
    max_length: int

    def __call__(self, batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        texts = as_text(batch[self.text_column], "text_column")
        pairs = None
        if self.text_pair_column is not None:
            pairs = as_text(batch[self.text_pair_column], "text_pair_column")
        encoded = self.tokenizer(texts, pairs, truncation=True, max_length=self.max_length)
        out = {k: encoded[k] for k in self.tokenizer.model_input_names if k in encoded}
        out["labels"] = [self.label_to_id[v] for v in batch[self.label_column]]
        out["length"] = [len(ids) for ids in encoded["input_ids"]]
        return out


@dataclass(frozen=True)
class TextCollator:
    """Pads each batch to its own longest sequence (dynamic padding); drops the ``length`` column."""

    tokenizer: PreTrainedTokenizerBase
    pad_to_multiple_of: int | None = None

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [{k: v for k, v in f.items() if k != "length"} for f in features]
        pad = DataCollatorWithPadding(self.tokenizer, pad_to_multiple_of=self.pad_to_multiple_of)
        return dict(pad(rows))
