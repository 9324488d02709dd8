"""Preference rows for ``method: dpo`` / ``orpo``: a prompt with a chosen and a rejected answer, tokenised
into two sequences whose labels count only the answer, and the collator that stacks them.

A row is plain text (``prompt``, ``chosen``, ``rejected`` strings) or chat: the prompt a list of
``{role, content}`` turns (a JSON string in CSV), each answer a list of turns (typically one assistant
turn) or a string (one assistant turn). Chat rows are rendered as TRL's ``DPOTrainer`` renders them: the
prompt with the generation prompt, the answer as the rest of the rendering of prompt + answer.

Tokenised as the SFT prompt/completion path is (:mod:`trainer_core.data.causal_lm`): prompt and answer
apart, then concatenated, so the boundary is exact whatever the tokenizer merges; the tokenizer's
leading specials (``<s>``) before a text prompt, eos after a text answer (a chat template writes its own).
TRL 1.16 tokenises prompt + answer together and starts the answer where the two tokenisations diverge;
for a tokenizer that merges nothing across the boundary the ids are the same.

Truncation (TRL 1.16 has only ``max_length`` and cuts the end; this is its older DPO rule, with the
prompt kept whole up to the limit): ``max_prompt_length`` keeps the prompt's last tokens; if prompt and
the longer answer still exceed ``max_length``, the prompt loses tokens from its start (both answers keep
one shared prompt), then each answer loses its end. The leading specials are never cut. A row whose
chosen or rejected sequence is left with no token to predict is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from trainer_core.data.causal_lm import (
    IGNORE_INDEX,
    LMCollator,
    has_targets,
    leading_special_ids,
    parse_messages,
    render_chat,
)
from trainer_core.data.loading import spec_error
from trainer_core.spec import JobSpec

# Bumped when the way preference rows are tokenised, truncated or masked changes (the cache key holds it).
PREFERENCE_ENCODING_RECIPE = "preference-v1"
PREFERENCE_COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", "length")


def pair_is_trainable(row: Mapping[str, Any]) -> bool:
    """For ``drop_untrainable``: both the chosen and the rejected sequence keep a token to predict."""
    return has_targets({"labels": row["chosen_labels"]}) and has_targets({"labels": row["rejected_labels"]})


@dataclass(frozen=True)
class EncodedPair:
    """One row's two sequences (ids and labels) and what truncation did to it."""

    chosen_ids: list[int]
    chosen_labels: list[int]
    rejected_ids: list[int]
    rejected_labels: list[int]
    prompt_cut: bool
    answer_cut: bool

    @property
    def trainable(self) -> bool:
        """Both sequences keep a token to predict (else the row teaches nothing and is dropped)."""
        return pair_is_trainable({"chosen_labels": self.chosen_labels, "rejected_labels": self.rejected_labels})


def truncate_pair(
    head: list[int], prompt: list[int], answers: tuple[list[int], list[int]], max_length: int,
    max_prompt_length: int | None,
) -> tuple[list[int], tuple[list[int], list[int]], bool, bool]:  # fmt: skip
    """``(prompt, (chosen, rejected), prompt_cut, answer_cut)`` within the limits (see the module doc);
    ``head`` (the leading specials) is never cut and counts towards both limits."""
    kept = prompt
    if max_prompt_length is not None:
        kept = _last(kept, max_prompt_length - len(head))
    kept = _last(kept, max_length - len(head) - max(len(a) for a in answers))
    room = max_length - len(head) - len(kept)
    cut = (answers[0][: max(room, 0)], answers[1][: max(room, 0)])
    return kept, cut, len(kept) < len(prompt), cut != answers


def _last(ids: list[int], n: int) -> list[int]:
    return ids[len(ids) - max(n, 0) :] if len(ids) > n else ids


def _sequence(context: list[int], answer: list[int]) -> tuple[list[int], list[int]]:
    return [*context, *answer], [*([IGNORE_INDEX] * len(context)), *answer]


def _is_chat(cell: Any) -> bool:
    if isinstance(cell, list):
        return True
    if isinstance(cell, str) and cell.lstrip().startswith("["):
        try:
            return isinstance(json.loads(cell), list)
        except json.JSONDecodeError:
            return False
    return False


def _answer_turns(cell: Any, column: str, field: str) -> list[dict[str, str]]:
    """A chat answer: its turns, or a plain string as one assistant turn."""
    if _is_chat(cell):
        return parse_messages(cell, column, field)
    if not isinstance(cell, str):
        raise spec_error(field, f"each {column!r} cell must be a string or a list of {{role, content}} turns")
    return [{"role": "assistant", "content": cell}]


@dataclass(frozen=True)
class PreferenceEncoder:
    """Tokenises a batch of prompt/chosen/rejected rows into :data:`PREFERENCE_COLUMNS` (see the module doc)."""

    tokenizer: PreTrainedTokenizerBase
    prompt_column: str
    chosen_column: str
    rejected_column: str
    max_length: int
    max_prompt_length: int | None = None

    def pairs(self, batch: Mapping[str, list[Any]]) -> list[EncodedPair]:
        """Each row encoded and truncated, untrainable rows included (the caller drops or counts them)."""
        columns = (self.prompt_column, self.chosen_column, self.rejected_column)
        rows = list(zip(*(batch[c] for c in columns), strict=True))
        for cells in rows:
            if any(cell is None for cell in cells):
                raise spec_error(f"dataset.{self._field(cells.index(None))}", "some rows have no value")
        text = self._text([cells for cells in rows if not _is_chat(cells[0])])
        out = []
        for cells in rows:
            prompt, answers, row_head = self._chat(cells) if _is_chat(cells[0]) else next(text)
            kept, cut, prompt_cut, answer_cut = truncate_pair(
                row_head, prompt, answers, self.max_length, self.max_prompt_length
            )
            (c_ids, c_labels), (r_ids, r_labels) = (_sequence([*row_head, *kept], a) for a in cut)
            out.append(EncodedPair(c_ids, c_labels, r_ids, r_labels, prompt_cut, answer_cut))
        return out

    def __call__(self, batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        rows = self.pairs(batch)
        return {
            "chosen_input_ids": [r.chosen_ids for r in rows],
            "chosen_labels": [r.chosen_labels for r in rows],
            "rejected_input_ids": [r.rejected_ids for r in rows],
            "rejected_labels": [r.rejected_labels for r in rows],
            "length": [max(len(r.chosen_ids), len(r.rejected_ids)) for r in rows],
        }

    def _field(self, index: int) -> str:
        return ("prompt_column", "chosen_column", "rejected_column")[index]

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _text(self, rows: list[tuple[Any, ...]]) -> Iterator[tuple[list[int], tuple[list[int], list[int]], list[int]]]:
        """Plain-text rows, tokenised a column at a time (one tokenizer call per column, not per cell)."""
        for cells in rows:
            if not all(isinstance(cell, str) for cell in cells[1:]):
                raise spec_error(
                    "dataset.prompt_column", "a plain-text prompt needs plain-text chosen/rejected answers"
                )
        tok, head, eos = self.tokenizer, leading_special_ids(self.tokenizer), self.tokenizer.eos_token_id
        prompts, chosen, rejected = (
            tok([str(cells[i]) for cells in rows], add_special_tokens=False)["input_ids"] if rows else []
            for i in range(3)
        )
        for prompt, c, r in zip(prompts, chosen, rejected, strict=True):
            yield list(prompt), ([*c, eos], [*r, eos]), head

    def _chat(self, cells: tuple[Any, ...]) -> tuple[list[int], tuple[list[int], list[int]], list[int]]:
        tok = self.tokenizer
        turns = parse_messages(cells[0], self.prompt_column, "dataset.prompt_column")
        prompt_text = render_chat(tok, turns, generation_prompt=True)
        answers = []
        for index in (1, 2):
            column, field = (self.chosen_column, self.rejected_column)[index - 1], f"dataset.{self._field(index)}"
            full = render_chat(tok, [*turns, *_answer_turns(cells[index], column, field)], generation_prompt=False)
            if not full.startswith(prompt_text):
                raise spec_error(
                    "model.tokenizer",
                    "the chat template renders the prompt differently once an answer follows, so the answer's "
                    "tokens cannot be told apart; use another template",
                )
            answers.append(self._ids(full[len(prompt_text) :]))
        # The template writes the specials itself; its leading ones (<s>) are kept whole like a text row's.
        prompt = self._ids(prompt_text)
        specials = leading_special_ids(tok)
        head = specials if prompt[: len(specials)] == specials else []
        return prompt[len(head) :], (answers[0], answers[1]), head


def check_preference_tokenizer(tokenizer: PreTrainedTokenizerBase, spec: JobSpec, prompts: list[Any]) -> None:
    """Chat rows (a prompt of turns) need the tokenizer's chat template; say so naming the tokenizer."""
    if any(_is_chat(p) for p in prompts) and not getattr(tokenizer, "chat_template", None):
        raise spec_error(
            "model.tokenizer",
            f"the tokenizer has no chat template, which the chat data in dataset.prompt_column "
            f"({spec.dataset.prompt_column!r}) needs; name a tokenizer that has one, or give plain-text columns",
        )


def make_preference_encoder(spec: JobSpec, tokenizer: PreTrainedTokenizerBase, max_length: int) -> PreferenceEncoder:
    """The batched ``map`` function for a preference job's rows."""
    ds = spec.dataset
    return PreferenceEncoder(
        tokenizer, ds.prompt_column, ds.chosen_column, ds.rejected_column, max_length,
        spec.preprocessing.max_prompt_length,
    )  # fmt: skip


@dataclass(frozen=True)
class TruncationCounts:
    """What truncation does to a sample of rows: how many lose prompt tokens, answer tokens, either, or
    everything they could learn from (dropped)."""

    rows: int
    prompt_cut: int
    answer_cut: int
    truncated: int
    dropped: int

    def as_dict(self) -> dict[str, int]:
        return {
            "rows": self.rows, "prompt_cut": self.prompt_cut, "answer_cut": self.answer_cut,
            "truncated": self.truncated, "dropped": self.dropped,
        }  # fmt: skip


def count_truncation(
    spec: JobSpec, tokenizer: PreTrainedTokenizerBase, rows: Mapping[str, list[Any]], max_length: int
) -> TruncationCounts:
    """How ``rows`` (columns of raw rows, e.g. ``Dataset[:]``) fare under ``max_length`` (the run's:
    ``effective_max_length``) and ``max_prompt_length``, encoded exactly as the run encodes them (for
    preflight)."""
    check_preference_tokenizer(tokenizer, spec, list(rows[spec.dataset.prompt_column]))
    pairs = make_preference_encoder(spec, tokenizer, max_length).pairs(rows)
    return TruncationCounts(
        rows=len(pairs),
        prompt_cut=sum(p.prompt_cut for p in pairs),
        answer_cut=sum(p.answer_cut for p in pairs),
        truncated=sum(p.prompt_cut or p.answer_cut for p in pairs),
        dropped=sum(not p.trainable for p in pairs),
    )


@dataclass(frozen=True)
class PreferenceCollator:
    """Stacks a batch of B pairs into 2B rows, the chosen sequences (0..B-1) then the rejected ones
    (B..2B-1), padded on the right to the longest (pad id, labels -100, attention 0); rows holding
    precomputed reference log-probs also give ``ref_chosen_logps`` / ``ref_rejected_logps`` (float, [B])."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [
            {"input_ids": f[f"{side}_input_ids"], "labels": f[f"{side}_labels"]}
            for side in ("chosen", "rejected")
            for f in features
        ]
        batch = LMCollator(self.pad_token_id, self.pad_to_multiple_of)(rows)
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if key in features[0]:
                batch[key] = torch.tensor([float(f[key]) for f in features], dtype=torch.float32)
        return batch
