"""causal-lm data: which tokens count in the loss (completion-only, assistant-only, train_on_prompt),
truncation, padding, the cache, refusals naming their field, and packing that changes no loss."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.trainer_core.llm_data import lm_spec, write_lm_jsonl, write_lm_tokenizer
from tests.trainer_core.memory.llm_models import LLM_CONFIGS
from trainer_core.backends.common import build_training_model, collator_for
from trainer_core.data import PreparedData, prepare_data
from trainer_core.data.causal_lm import IGNORE_INDEX, LMEncoder
from trainer_core.data.packing import PackedCollator, packing_error
from trainer_core.events import EventCollector
from trainer_core.modeling import config_from_dict
from trainer_core.preflight import PreflightError, preflight
from trainer_core.spec import SpecError, parse_spec


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_lm_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.fixture(scope="module")
def chat_packed_and_plain(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> tuple[PreparedData, ...]:
    tmp = tmp_path_factory.mktemp("chat")
    return _data(tmp, "chat", tokenizer_dir, packing=True), _data(tmp, "chat", tokenizer_dir)


def _data(tmp: Path, shape: str, tokenizer: Path, cache: Path | None = None, **pre: Any) -> PreparedData:
    files = write_lm_jsonl(tmp / shape, shape)
    return prepare_data(parse_spec(lm_spec(files, tokenizer, preprocessing={"max_length": 64, **pre})), cache)


def _rows(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def _field(exc: pytest.ExceptionInfo[SpecError]) -> str:
    return exc.value.errors[0].field


def test_completion_only_mask_is_exactly_the_prompt(tmp_path: Path, tokenizer_dir: Path) -> None:
    data = _data(tmp_path, "prompt-completion", tokenizer_dir)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    raw = _rows(str(tmp_path / "prompt-completion" / "train.jsonl"))
    assert data.labels == [] and len(data.train) == len(raw)
    for row, source in zip(data.train, raw, strict=True):
        prompt = [tok.cls_token_id, *tok(source["prompt"], add_special_tokens=False)["input_ids"]]
        completion = [*tok(source["completion"], add_special_tokens=False)["input_ids"], tok.sep_token_id]
        assert row["input_ids"] == prompt + completion  # [SEP] is the eos a BERT-style tokenizer ends with
        assert row["labels"] == [IGNORE_INDEX] * len(prompt) + completion
        assert row["length"] == len(row["input_ids"])


def test_chat_mask_is_exactly_the_assistant_turns(tmp_path: Path, tokenizer_dir: Path) -> None:
    data = _data(tmp_path, "chat", tokenizer_dir)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    raw = _rows(str(tmp_path / "chat" / "train.jsonl"))
    assert any(len(r["messages"]) == 4 for r in raw), "multi-turn rows must be covered"
    for row, source in zip(data.train, raw, strict=True):
        expected_ids: list[int] = []
        expected_labels: list[int] = []
        for turn in source["messages"]:
            head = tok(f"{turn['role']}:", add_special_tokens=False)["input_ids"]
            body = [*tok(turn["content"], add_special_tokens=False)["input_ids"], tok.sep_token_id]
            expected_ids += [tok.cls_token_id, *head, *body]
            counted = body if turn["role"] == "assistant" else [IGNORE_INDEX] * len(body)
            expected_labels += [IGNORE_INDEX] * (1 + len(head)) + counted
        assert row["input_ids"] == expected_ids
        assert row["labels"] == expected_labels


@pytest.mark.parametrize("shape", ["prompt-completion", "chat"])
def test_train_on_prompt_counts_every_token(tmp_path: Path, tokenizer_dir: Path, shape: str) -> None:
    data = _data(tmp_path, shape, tokenizer_dir, train_on_prompt=True)
    masked = _data(tmp_path, shape, tokenizer_dir)
    assert data.train["input_ids"] == masked.train["input_ids"]
    assert all(row["labels"] == row["input_ids"] for row in data.train)


def test_plain_text_counts_every_token_and_ends_with_eos(tmp_path: Path, tokenizer_dir: Path) -> None:
    data = _data(tmp_path, "text", tokenizer_dir)
    tok = data.processor
    for row in data.train:
        assert row["labels"] == row["input_ids"]
        assert row["input_ids"][0] == tok.cls_token_id and row["input_ids"][-1] == tok.eos_token_id


def test_max_length_truncates_and_rows_left_without_targets_are_dropped(tmp_path: Path, tokenizer_dir: Path) -> None:
    full = _data(tmp_path, "chat", tokenizer_dir)
    short = _data(tmp_path, "chat", tokenizer_dir, max_length=16)
    assert max(short.train["length"]) == 16 < max(full.train["length"])
    # Within 16 tokens every row keeps the start of its first answer: none is dropped, each is a prefix.
    assert len(short.train) == len(full.train)
    for row, whole in zip(short.train, full.train, strict=True):
        assert row["input_ids"] == whole["input_ids"][:16] and row["labels"] == whole["labels"][:16]
    # "[CLS] user : <question of 4+ tokens> [SEP] [CLS] assistant :" is 11+ tokens: 8 leave no target.
    with pytest.raises(SpecError) as exc:
        _data(tmp_path, "chat", tokenizer_dir, max_length=8)
    assert _field(exc) == "preprocessing.max_length"


def test_collator_pads_with_eos_when_the_tokenizer_has_no_pad_token(tmp_path: Path, tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.pad_token = None
    tok.save_pretrained(str(tmp_path / "nopad"))
    data = _data(tmp_path, "prompt-completion", tmp_path / "nopad")
    assert data.processor.pad_token_id == data.processor.eos_token_id == tok.sep_token_id
    rows = [data.train[i] for i in range(6)]
    batch = data.collator(rows)
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    for i, row in enumerate(rows):
        n = row["length"]
        assert batch["input_ids"][i, :n].tolist() == row["input_ids"]
        assert batch["labels"][i, :n].tolist() == row["labels"]
        assert (batch["input_ids"][i, n:] == tok.sep_token_id).all() and (batch["labels"][i, n:] == IGNORE_INDEX).all()
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)


def test_second_prepare_is_a_cache_hit_and_lm_settings_are_in_the_key(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    first = _data(tmp_path, "prompt-completion", tokenizer_dir, cache)
    assert not first.cache_hit

    def refuse(self: LMEncoder, batch: Any) -> Any:
        raise AssertionError("re-tokenised on what should be a cache hit")

    monkeypatch.setattr(LMEncoder, "__call__", refuse)
    second = _data(tmp_path, "prompt-completion", tokenizer_dir, cache)
    assert second.cache_hit and second.cache_key == first.cache_key
    assert second.train["labels"] == first.train["labels"] and second.labels == []
    assert second.processor.pad_token_id == first.processor.pad_token_id
    assert second.processor.chat_template == first.processor.chat_template
    # A hit still checks the tokenizer against the model (its config is not part of the key).
    small = lm_spec(write_lm_jsonl(tmp_path / "prompt-completion", "prompt-completion"), tokenizer_dir,
                    preprocessing={"max_length": 64})  # fmt: skip
    small["model"]["config"]["vocab_size"] = 50
    with pytest.raises(SpecError) as exc:
        prepare_data(parse_spec(small), cache)
    assert _field(exc) == "model.config.vocab_size"
    monkeypatch.undo()
    for setting in ({"train_on_prompt": True}, {"packing": True}, {"max_length": 32}):
        other = _data(tmp_path, "prompt-completion", tokenizer_dir, cache, **setting)
        assert not other.cache_hit and other.cache_key != first.cache_key


def test_chat_data_with_a_tokenizer_without_chat_template_names_the_tokenizer(tmp_path: Path) -> None:
    plain = write_lm_tokenizer(tmp_path / "plain", chat_template=False)
    with pytest.raises(SpecError) as exc:
        _data(tmp_path, "chat", plain)
    assert _field(exc) == "model.tokenizer" and "chat template" in exc.value.errors[0].message


def test_missing_columns_name_their_field(tmp_path: Path, tokenizer_dir: Path) -> None:
    files = write_lm_jsonl(tmp_path / "pc", "prompt-completion")
    renamed = lm_spec(
        files, tokenizer_dir, dataset={"path": "json", "data_files": files, "completion_column": "answer"}
    )
    with pytest.raises(SpecError) as exc:
        prepare_data(parse_spec(renamed), None)
    assert _field(exc) == "dataset.completion_column" and "'answer'" in exc.value.errors[0].message
    with pytest.raises(PreflightError) as pre:
        preflight(parse_spec(renamed))
    assert pre.value.errors[0].field == "dataset.completion_column"
    nothing = lm_spec(files, tokenizer_dir, dataset={"path": "json", "data_files": files, "prompt_column": "q",
                                                     "completion_column": "a"})  # fmt: skip
    with pytest.raises(SpecError) as exc:
        prepare_data(parse_spec(nothing), None)
    assert _field(exc) == "dataset.text_column"


def test_preflight_passes_lm_data_and_a_config_built_lm_needs_a_tokenizer(tmp_path: Path, tokenizer_dir: Path) -> None:
    files = write_lm_jsonl(tmp_path / "chat", "chat")
    report = preflight(parse_spec(lm_spec(files, tokenizer_dir)))
    assert "columns" in report.checks and report.labels is None and report.model["tokenizer"] == "local"
    spec = lm_spec(files, tokenizer_dir)
    del spec["model"]["tokenizer"]
    with pytest.raises(SpecError) as exc:
        prepare_data(parse_spec(spec), None)
    assert _field(exc) == "model.tokenizer"


def test_rows_longer_than_the_models_positions_are_refused(tmp_path: Path, tokenizer_dir: Path) -> None:
    with pytest.raises(SpecError) as exc:
        _data(tmp_path, "text", tokenizer_dir, max_length=256)  # the spec's Llama has 128 positions
    assert _field(exc) == "preprocessing.max_length" and "model.config.max_position_embeddings" in str(exc.value)


def test_packing_error_accepts_attention_models_and_refuses_recurrent_ones(tmp_path: Path, tokenizer_dir: Path) -> None:
    for arch in ("llama", "qwen2", "gpt2"):
        assert packing_error(config_from_dict(dict(LLM_CONFIGS[arch]))) is None
    mamba = {"model_type": "mamba", "hidden_size": 16, "num_hidden_layers": 1, "vocab_size": 300, "state_size": 4}
    assert "position_ids" in str(packing_error(config_from_dict(mamba)))
    files = write_lm_jsonl(tmp_path / "text", "text")
    spec = lm_spec(files, tokenizer_dir, preprocessing={"packing": True})
    spec["model"]["config"] = mamba
    with pytest.raises(SpecError) as exc:
        prepare_data(parse_spec(spec), None)
    assert _field(exc) == "preprocessing.packing"


def test_packed_rows_keep_each_examples_positions(tmp_path: Path, tokenizer_dir: Path) -> None:
    packed = _data(tmp_path, "prompt-completion", tokenizer_dir, packing=True)
    plain = _data(tmp_path, "prompt-completion", tokenizer_dir)
    assert len(packed.train) < len(plain.train) and max(packed.train["length"]) <= 64
    # Best-fit decreasing reorders the examples: compare them as a multiset.
    segments: list[tuple[list[int], list[int]]] = []
    for row in packed.train:
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [row["length"]]
        for a, b in itertools.pairwise(starts):
            assert row["position_ids"][a:b] == list(range(b - a))
            segments.append((row["input_ids"][a:b], row["labels"][a:b]))
    expected = [(e["input_ids"], [IGNORE_INDEX, *e["labels"][1:]]) for e in plain.train]
    assert sorted(segments) == sorted(expected), "every example is packed, once"


def _loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    with torch.no_grad():
        return float(model(**batch).loss)


def _fullest_rows(packed: PreparedData, n: int = 3) -> list[dict[str, Any]]:
    """The ``n`` rows holding the most examples (best-fit decreasing opens rows with the longest)."""
    return sorted(packed.train, key=lambda row: -row["position_ids"].count(0))[:n]


def _examples_of(packed: PreparedData, plain: PreparedData, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The unpacked rows of the examples ``rows`` hold (the plain data's rows, matched by tokens)."""
    by_ids = {tuple(r["input_ids"]): r for r in plain.train}
    out = []
    for row in rows:
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [row["length"]]
        out += [by_ids[tuple(row["input_ids"][a:b])] for a, b in itertools.pairwise(starts)]
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_batch_has_the_same_loss_as_the_examples_unpadded(
    chat_packed_and_plain: tuple[PreparedData, PreparedData], arch: str, attn: str
) -> None:
    packed, plain = chat_packed_and_plain
    rows = _fullest_rows(packed)
    assert len({r["length"] for r in rows}) > 1, "rows of different lengths: the row path pads"
    examples = _examples_of(packed, plain, rows)
    assert len(examples) > len(rows), "rows must hold several examples each"
    torch.manual_seed(0)
    # Larger initial weights than the default 0.02 make attention matter, so a leak would show.
    config = config_from_dict({**LLM_CONFIGS[arch], "initializer_range": 0.2})
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    # As in training: with a cache, transformers does not look for packed sequences (see packing.py).
    model.config.use_cache = False
    assert isinstance(packed.collator, PackedCollator)
    unpacked = _loss(model, plain.collator(examples))

    collator = packed.collator.for_model(model.config)
    batch = collator(rows)
    assert collator.layout == "rows" and batch["input_ids"].shape == (3, max(r["length"] for r in rows))
    width = batch["input_ids"].shape[1]
    assert batch["attention_mask"].shape == (3, 1, width, width)
    assert _loss(model, batch) == pytest.approx(unpacked, rel=1e-5, abs=1e-6)
    # Flash attention's path, one flattened sequence, gives the same loss too (transformers finds the
    # boundaries from position_ids under eager and SDPA as well).
    flat = PackedCollator(packed.collator.pad_token_id, "flash_attention_2")(rows)
    assert set(flat) == {"input_ids", "labels", "position_ids"} and flat["input_ids"].shape[0] == 1
    assert _loss(model, flat) == pytest.approx(unpacked, rel=1e-5, abs=1e-6)
    # The check has teeth: with leaking attention the losses differ. A plain causal mask over each
    # packed row (its padding masked) lets the row's examples attend to each other.
    leaky = {**batch, "attention_mask": plain.collator(rows)["attention_mask"]}
    assert abs(_loss(model, leaky) - unpacked) > 1e-2


@pytest.mark.parametrize("adapter", [None, {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0}])
def test_the_engines_training_model_keeps_packed_examples_apart(
    chat_packed_and_plain: tuple[PreparedData, PreparedData], tokenizer_dir: Path, adapter: dict[str, Any] | None
) -> None:
    """The model both backends train (build_training_model, in training mode) must see a packed row as
    separate examples: the Accelerate loop has no Trainer to turn the KV cache off for it."""
    packed, plain = chat_packed_and_plain
    rows = _fullest_rows(packed)
    spec = lm_spec({"train": "unused.jsonl"}, tokenizer_dir, preprocessing={"max_length": 64, "packing": True})
    spec["model"]["config"] = {**LLM_CONFIGS["llama"], "initializer_range": 0.2}
    if adapter is not None:
        spec["adapter"] = adapter
    model = build_training_model(parse_spec(spec), [])
    model.train()  # as the backends run it (the tiny Llama has no dropout, so the loss is deterministic)
    events = EventCollector()
    collator = collator_for(packed.collator, model, events)
    assert [e["packing"] for e in events.of_kind("log")] == ["rows"]  # transformers' default: SDPA
    unpacked = plain.collator(_examples_of(packed, plain, rows))
    assert _loss(model, collator(rows)) == pytest.approx(_loss(model, unpacked), rel=1e-5)
