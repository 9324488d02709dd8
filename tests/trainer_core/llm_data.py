"""causal-lm test data: the three dataset shapes written as JSON lines, a small tokenizer with a chat
template trained on them, and specs that use both (shared by the data, backend and run tests)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.trainer_core.datagen import NEGATIVE, POSITIVE, SUBJECTS
from trainer_core.data.text import train_wordpiece

# BERT-style special tokens (the tokenizer has no eos: [SEP] ends sequences), one turn per [CLS]..[SEP].
CHAT_TEMPLATE = (
    "{% for m in messages %}[CLS]{{ m['role'] }}: {{ m['content'] }}[SEP]{% endfor %}"
    "{% if add_generation_prompt %}[CLS]assistant:{% endif %}"
)
QUESTIONS = ["how was {s}?", "what did you think of {s}?", "tell me about {s}.", "was {s} any good?"]


def _answer(rng: random.Random, subject: str) -> str:
    words = rng.choice([POSITIVE, NEGATIVE])
    extra = "".join(f", really {rng.choice(words)}" for _ in range(rng.randint(0, 3)))
    return f"{subject} was {rng.choice(words)}{extra}"


def lm_rows(shape: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows of ``shape``: ``text``, ``prompt-completion`` or ``chat`` (one or two exchanges)."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for _ in range(n):
        subject = rng.choice(SUBJECTS)
        question, answer = rng.choice(QUESTIONS).format(s=subject), _answer(rng, subject)
        if shape == "text":
            rows.append({"text": f"{question} {answer}."})
        elif shape == "prompt-completion":
            rows.append({"prompt": question, "completion": f" {answer}."})
        else:
            turns = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            if rng.random() < 0.5:
                other = rng.choice(SUBJECTS)
                turns += [
                    {"role": "user", "content": f"and {other}?"},
                    {"role": "assistant", "content": _answer(rng, other)},
                ]
            rows.append({"messages": turns})
    return rows


def write_lm_jsonl(directory: Path, shape: str, n_train: int = 24, n_val: int = 6) -> dict[str, str]:
    """``train.jsonl`` and ``validation.jsonl`` of ``shape``; returns the spec's ``data_files``."""
    return _write_splits(directory, lambda n, seed: lm_rows(shape, n, seed), n_train, n_val)


def _write_splits(
    directory: Path, rows: Callable[[int, int], list[dict[str, Any]]], n_train: int, n_val: int
) -> dict[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, n, seed in (("train", n_train, 0), ("validation", n_val, 1)):
        path = directory / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(n, seed)), encoding="utf-8")
        files[split] = str(path)
    return files


def preference_rows(shape: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` prompt/chosen/rejected rows with a clear preference (a kind answer over an unkind one), as
    plain ``text`` or ``chat`` messages (the prompt a user turn, each answer an assistant turn)."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for _ in range(n):
        subject = rng.choice(SUBJECTS)
        question = rng.choice(QUESTIONS).format(s=subject)
        chosen = f"{subject} was {rng.choice(POSITIVE)}, really {rng.choice(POSITIVE)}"
        rejected = f"{subject} was {rng.choice(NEGATIVE)}, really {rng.choice(NEGATIVE)}"
        if shape == "text":
            rows.append({"prompt": question, "chosen": f" {chosen}.", "rejected": f" {rejected}."})
        else:
            rows.append({"prompt": [{"role": "user", "content": question}],
                         "chosen": [{"role": "assistant", "content": chosen}],
                         "rejected": [{"role": "assistant", "content": rejected}]})  # fmt: skip
    return rows


def write_preference_jsonl(directory: Path, shape: str, n_train: int = 32, n_val: int = 8) -> dict[str, str]:
    """``train.jsonl`` and ``validation.jsonl`` of :func:`preference_rows`; returns the spec's ``data_files``."""
    return _write_splits(directory, lambda n, seed: preference_rows(shape, n, seed), n_train, n_val)


def write_lm_tokenizer(directory: Path, vocab_size: int = 300, chat_template: bool = True) -> Path:
    """A WordPiece tokenizer trained on every word the LM rows and the chat template use, saved to
    ``directory`` (with :data:`CHAT_TEMPLATE` unless ``chat_template`` is False)."""
    texts = [json.dumps(r) for shape in ("text", "prompt-completion", "chat") for r in lm_rows(shape, 200)]
    texts += ["user: assistant: system:"]
    tokenizer = train_wordpiece(texts, vocab_size, model_max_length=512, with_token_types=False)
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return directory


def lm_spec(files: dict[str, str], tokenizer: Path, **sections: Any) -> dict[str, Any]:
    """A causal-lm spec on ``files`` with a tiny Llama from config; ``sections`` replace spec sections."""
    spec: dict[str, Any] = {
        "name": "tiny-lm",
        "task": "causal-lm",
        "model": {
            "config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
                       "max_position_embeddings": 128},
            "tokenizer": str(tokenizer),
        },
        "dataset": {"path": "json", "data_files": files},
        "preprocessing": {"max_length": 64},
        "training": {"max_steps": 4, "per_device_train_batch_size": 4, "logging_steps": 1, "eval_strategy": "no"},
    }  # fmt: skip
    spec.update(sections)
    return spec
