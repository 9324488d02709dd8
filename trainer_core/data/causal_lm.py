"""causal-lm rows: plain text, prompt/completion pairs or chat turns, tokenised into ``input_ids`` and
``labels`` (-100 where a token does not count in the loss), and the collator that pads them.

Which tokens count:

- ``text``: every token;
- ``prompt-completion``: the completion and the eos appended after it (the prompt too with
  ``preprocessing.train_on_prompt``). Prompt and completion are tokenised apart and concatenated
  (LLaMA-Factory's way), so the boundary is exact whatever the tokenizer merges;
- ``chat``: the assistant turns as the chat template renders them, end-of-turn tokens included. Each
  assistant turn's character span is found by rendering the conversation up to it (with the generation
  prompt) and through it; the tokens the full rendering's offsets put inside a span count. This works
  for any template whose earlier turns render the same once later turns follow; one that does not is
  an error rather than a silently wrong mask.

Rows are truncated to ``max_length``; a row left with nothing to learn from is dropped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from trainer_core.data.loading import spec_error
from trainer_core.data.text import as_text
from trainer_core.spec import JobSpec

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # the label PyTorch's cross-entropy (and transformers' loss) skips
# Bumped when the way rows are tokenised or masked changes, so cached data is rebuilt.
LM_ENCODING_RECIPE = "causal-lm-v1"


def leading_special_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The special tokens the tokenizer puts before a sequence (``<s>``, ``[CLS]``; none for GPT-2)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


@dataclass(frozen=True)
class LMEncoder:
    """Tokenises a batch of ``text`` or ``prompt-completion`` rows into input_ids, labels and length."""

    tokenizer: PreTrainedTokenizerBase
    shape: str
    text_column: str
    prompt_column: str
    completion_column: str
    train_on_prompt: bool
    max_length: int

    def __call__(self, batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        tok, head, eos = self.tokenizer, leading_special_ids(self.tokenizer), self.tokenizer.eos_token_id
        rows: list[tuple[list[int], list[int]]] = []
        if self.shape == "text":
            for ids in tok(as_text(batch[self.text_column], "text_column"), add_special_tokens=False)["input_ids"]:
                full = [*head, *ids, eos]
                rows.append((full, list(full)))
        else:
            prompts = tok(as_text(batch[self.prompt_column], "prompt_column"), add_special_tokens=False)["input_ids"]
            completions = tok(as_text(batch[self.completion_column], "completion_column"), add_special_tokens=False)[
                "input_ids"
            ]
            for prompt, completion in zip(prompts, completions, strict=True):
                context = [*head, *prompt]
                target = [*completion, eos]
                hidden = list(context) if self.train_on_prompt else [IGNORE_INDEX] * len(context)
                rows.append(([*context, *target], [*hidden, *target]))
        return _columns(rows, self.max_length)


def _columns(rows: list[tuple[list[int], list[int]]], max_length: int) -> dict[str, list[Any]]:
    ids = [r[0][:max_length] for r in rows]
    labels = [r[1][:max_length] for r in rows]
    return {"input_ids": ids, "labels": labels, "length": [len(i) for i in ids]}


def parse_messages(value: Any, column: str, field: str = "dataset.messages_column") -> list[dict[str, str]]:
    """A chat cell as a list of ``{role, content}`` (a JSON string is parsed: CSV); errors name ``field``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise spec_error(field, f"a {column!r} cell is not JSON: {exc}") from exc
    ok = (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    )
    if not ok:
        raise spec_error(field, f"each {column!r} cell must be a non-empty list of {{role, content}} turns")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert isinstance(text, str)
    return text


def assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> tuple[str, list[range]]:
    """The rendered conversation and the character span of each assistant turn in it."""
    full = render_chat(tokenizer, messages, generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], generation_prompt=True) if i else ""
        through = render_chat(tokenizer, messages[: i + 1], generation_prompt=False)
        if not (full.startswith(before) and full.startswith(through) and len(before) <= len(through)):
            raise spec_error(
                "model.tokenizer",
                "the chat template renders earlier turns differently once later turns follow, so the assistant "
                "tokens cannot be found; use another template, or preprocessing.train_on_prompt: true",
            )
        spans.append(range(len(before), len(through)))
    return full, spans


@dataclass(frozen=True)
class ChatEncoder:
    """Renders a batch of conversations with the chat template; labels only assistant tokens."""

    tokenizer: PreTrainedTokenizerBase
    messages_column: str
    train_on_prompt: bool
    max_length: int

    def __call__(self, batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        rows = []
        for cell in batch[self.messages_column]:
            text, spans = assistant_spans(self.tokenizer, parse_messages(cell, self.messages_column))
            # The template writes the special tokens itself (bos included), as apply_chat_template does.
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=not self.train_on_prompt)
            ids = list(enc["input_ids"])
            if self.train_on_prompt:
                rows.append((ids, list(ids)))
                continue
            # A token counts when its characters overlap an assistant span.
            labels = [
                tid if any(start < span.stop and end > span.start for span in spans) else IGNORE_INDEX
                for tid, (start, end) in zip(ids, enc["offset_mapping"], strict=True)
            ]
            rows.append((ids, labels))
        return _columns(rows, self.max_length)


def check_chat_tokenizer(tokenizer: PreTrainedTokenizerBase, spec: JobSpec) -> None:
    """Chat data needs a chat template, and offsets (a fast tokenizer) to place assistant tokens."""
    column = spec.dataset.messages_column
    if not getattr(tokenizer, "chat_template", None):
        raise spec_error(
            "model.tokenizer",
            f"the tokenizer has no chat template, which the chat data in dataset.messages_column ({column!r}) needs; "
            "name a tokenizer that has one, or give prompt/completion columns",
        )
    if not spec.preprocessing.train_on_prompt and not tokenizer.is_fast:
        raise spec_error("model.tokenizer", "finding assistant tokens needs a fast tokenizer (character offsets)")


def make_lm_encoder(spec: JobSpec, tokenizer: PreTrainedTokenizerBase, shape: str, max_length: int) -> Any:
    """The batched ``map`` function for ``shape`` (see :func:`~trainer_core.data.loading.lm_shape`)."""
    ds, pre = spec.dataset, spec.preprocessing
    if shape == "chat":
        check_chat_tokenizer(tokenizer, spec)
        return ChatEncoder(tokenizer, ds.messages_column, pre.train_on_prompt, max_length)
    return LMEncoder(
        tokenizer, shape, ds.text_column, ds.prompt_column, ds.completion_column, pre.train_on_prompt, max_length
    )


def has_targets(row: Mapping[str, Any]) -> bool:
    """Whether a row has a token to predict (the first label never is: labels shift by one)."""
    return any(label != IGNORE_INDEX for label in row["labels"][1:])


def drop_untrainable(
    dataset: datasets.Dataset, split_name: str, max_length: int, keep: Callable[[Mapping[str, Any]], bool] = has_targets
) -> datasets.Dataset:
    """Rows whose counted tokens were all truncated away teach nothing (and make a batch's loss NaN);
    ``keep`` tells a row to keep (preference rows need a target in both answers)."""
    kept = dataset.filter(keep, load_from_cache_file=False, desc="Dropping rows without targets")
    dropped = len(dataset) - len(kept)
    if dropped:
        logger.warning("%d %s rows have no counted token within %d tokens; dropped", dropped, split_name, max_length)
    if len(kept) == 0:
        raise spec_error(
            "preprocessing.max_length",
            f"no {split_name} row keeps a token that counts in the loss within {max_length} tokens; raise it",
        )
    return kept


@dataclass(frozen=True)
class LMCollator:
    """Pads a batch to its longest row: input_ids with the pad id, labels with -100, plus attention_mask."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(features), longest), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), longest), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(features), longest), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.as_tensor(f["input_ids"], dtype=torch.long)
            labels[i, :n] = torch.as_tensor(f["labels"], dtype=torch.long)
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
