"""The estimate follows ``efficiency.chunked_loss``: no logits, the gradients the chunked loss saves for
backward (against autograd's saved tensors, as test_activation_calibration_llm.py measures the plain
loss) and one chunk's transient (against every allocation of the loss's forward); ``efficiency.liger``
is counted the same way; the planner turns the chunked loss on where the logits are what does not fit."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.trainer_core.memory.llm_models import LLM_CONFIGS, build_llm
from tests.trainer_core.memory.test_activation_calibration_llm import saved_storages
from trainer_core.chunked_loss import causal_lm_loss, chunked_cross_entropy
from trainer_core.memory import MemoryEstimate, estimate_memory, plan_memory
from trainer_core.memory import loss as loss_memory
from trainer_core.memory.planner import apply_changes
from trainer_core.spec import JobSpec, parse_spec

VOCAB = 4096  # large enough that an estimate still counting the logits falls outside the bounds
# As test_activation_calibration_llm.py: no dropout (SDPA on the CPU would fall back to the math kernel
# and store the scores, which CUDA's kernels do not); GPT-2's gelu_new is a chain of Python ops that
# saves more than one GELU, which the layer formula does not count (the exact GELU is one op).
CPU_COMPARABLE = {"gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "activation_function": "gelu"}}
LORA = {"type": "lora", "r": 16, "dropout": 0.05}


def llm_doc(arch: str, b: int, s: int, precision: str, adapter: dict[str, Any] | None, **efficiency: Any) -> Any:
    config = {**LLM_CONFIGS[arch], **CPU_COMPARABLE.get(arch, {}), "vocab_size": VOCAB}
    return {
        "name": "chunked", "task": "causal-lm", "model": {"config": config}, "dataset": {"path": "json"},
        "preprocessing": {"max_length": s}, "training": {"per_device_train_batch_size": b},
        "efficiency": {"mixed_precision": precision, **efficiency}, "adapter": adapter,
    }  # fmt: skip


def lines_of(estimate: MemoryEstimate) -> dict[str, int]:
    return {p.name: p.bytes for p in estimate.parts}


def parts(spec: JobSpec) -> dict[str, int]:
    return lines_of(estimate_memory(spec))


class Chunked(torch.nn.Module):
    """``model`` whose forward is the run's chunked loss (trainer_core/backends/objective.py)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(self.model, batch)


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("adapter", [None, LORA])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_chunked_loss_estimate_matches_saved_tensors(arch: str, adapter: dict[str, Any] | None, precision: str) -> None:
    b, s = 8, 64
    spec = parse_spec(llm_doc(arch, b, s, precision, adapter, chunked_loss=True))
    lines = parts(spec)
    assert "logits_fp32" not in lines
    estimated = lines["activations"] + lines["autocast_copies"] + lines["chunked_loss_gradients"]
    model = build_llm(spec).train()
    ids = torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(0))
    saved = sum(saved_storages(Chunked(model), {"input_ids": ids, "labels": ids}, precision).values())
    ratio = estimated / saved
    assert 0.8 <= ratio <= 1.15, f"{arch} {adapter} {precision}: estimate / saved = {ratio:.2f}"
    plain = parts(parse_spec(llm_doc(arch, b, s, precision, adapter)))  # the setting ignored
    assert (plain["activations"] + plain["autocast_copies"] + plain["logits_fp32"]) / saved > 1.5


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages ops allocate while it is on, and their peak (a storage counts from the
    op that made it until it is freed)."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen = {t.untyped_storage().data_ptr() for t in existing}

    def _freed(self, ptr: int, nbytes: int) -> None:
        self.live -= nbytes
        self.seen.discard(ptr)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes and ptr not in self.seen:
                self.seen.add(ptr)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, ptr, nbytes)
        return out


# 64: one softmax block (the whole chunk); 160: a shorter last chunk of 4 x 64 tokens
@pytest.mark.parametrize("chunk", [loss_memory.CHUNK_TOKENS, 64, 160])
@pytest.mark.parametrize("b", [4, 32])  # one chunk, two chunks (64 tokens a row)
@pytest.mark.parametrize(("precision", "adapter"), [("no", None), ("bf16", None), ("bf16", LORA), ("no", LORA)])
def test_chunk_transient_matches_what_the_loss_allocates(
    monkeypatch: pytest.MonkeyPatch, precision: str, adapter: dict[str, Any] | None, b: int, chunk: int
) -> None:
    s = 64
    doc = llm_doc("llama", b, s, precision, adapter, chunked_loss=True)
    doc["model"]["config"]["hidden_size"] = 128
    spec = parse_spec(doc)
    monkeypatch.setattr(loss_memory, "CHUNK_TOKENS", chunk)
    lines = parts(spec)
    lm: Any = build_llm(spec).train()
    lm = getattr(lm, "get_base_model", lambda: lm)()
    ids = torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(0))
    head = lm.get_output_embeddings()
    with torch.autocast("cpu", enabled=precision == "bf16"):
        hidden = lm.model(input_ids=ids, use_cache=False).last_hidden_state
        with LiveBytes() as warm:  # autocast's cached 16-bit weight is the estimate's autocast_copies
            head(hidden[0, :1])
        with LiveBytes(hidden, head.weight) as tracked:
            tracked.seen |= warm.seen
            chunked_cross_entropy(hidden, head, ids, chunk=chunk)
    estimated = lines["chunked_loss_gradients"] + lines["chunked_loss_chunk"]
    assert 0.99 <= estimated / tracked.peak <= 1.01, f"estimated {estimated}, allocated at the peak {tracked.peak}"


@pytest.mark.parametrize("adapter", [None, LORA])
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_chunked_loss_saves_the_logits_of_a_large_vocabulary(precision: str, adapter: dict[str, Any] | None) -> None:
    # a micro-batch a user runs, 4 x 1024 tokens (4 chunks): one chunk's transient (one fp32 chunk of
    # logits, 1.5 under autocast) and the head's fp32 gradient are a fraction of the batch's logits
    b, s, vocab, hidden = 4, 1024, 32_000, 1024
    doc = llm_doc("llama", b, s, precision, adapter)
    doc["model"]["config"].update(vocab_size=vocab, hidden_size=hidden, max_position_embeddings=s)
    plain = estimate_memory(parse_spec(doc))
    chunked = estimate_memory(parse_spec({**doc, "efficiency": {**doc["efficiency"], "chunked_loss": True}}))
    w = 2 if precision == "bf16" else 4
    logits = b * s * vocab * (w + 4)  # the head's output and its fp32 copy
    lines, plain_lines = lines_of(chunked), lines_of(plain)
    assert plain_lines["logits_fp32"] == b * s * vocab * 4
    assert plain_lines["activations"] - lines["activations"] == b * s * vocab * w
    hidden_grad = b * s * hidden * (4 if adapter is None or precision == "no" else 2)
    held = hidden_grad + (vocab * hidden * 4 if adapter is None else 0)  # the head trains without an adapter
    assert lines["chunked_loss_gradients"] == held
    assert plain.total_bytes - chunked.total_bytes == logits - held - lines["chunked_loss_chunk"]
    assert plain.total_bytes - chunked.total_bytes > 0.5 * logits  # most of the logits


@pytest.mark.parametrize("adapter", [None, LORA])
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_liger_counts_the_loss_as_the_chunked_loss(precision: str, adapter: dict[str, Any] | None) -> None:
    """Liger's fused linear cross-entropy holds no logits either; its other kernels are estimated as the
    plain model's activations (approximate), so every line but the loss's equals the plain estimate's."""
    doc = llm_doc("llama", 16, 64, precision, adapter)
    plain = lines_of(estimate_memory(parse_spec(doc)))
    chunked = estimate_memory(parse_spec({**doc, "efficiency": {**doc["efficiency"], "chunked_loss": True}}))
    liger = estimate_memory(parse_spec({**doc, "efficiency": {**doc["efficiency"], "liger": True}}))
    assert lines_of(liger) == lines_of(chunked) and liger.total_bytes == chunked.total_bytes
    assert lines_of(liger)["chunked_loss_gradients"] > 0 and "logits_fp32" not in lines_of(liger)
    for name in ("parameters", "gradients", "optimizer_state", "autocast_copies"):
        assert lines_of(liger)[name] == plain[name]
    note = next(p.note for p in liger.parts if p.name == "chunked_loss_gradients")
    assert note is not None and "liger" in note


@pytest.mark.parametrize("setting", ["chunked_loss", "liger"])
@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_preference_runs_keep_their_logits(method: str, setting: str) -> None:
    """DPO/ORPO's policy_logps computes the full logits whatever the setting."""
    doc = {**llm_doc("llama", 4, 64, "bf16", None), "method": method}
    on = parse_spec({**doc, "efficiency": {**doc["efficiency"], setting: True}})
    assert estimate_memory(on).model_dump() == estimate_memory(parse_spec(doc)).model_dump()


def test_planner_turns_the_chunked_loss_on_when_the_logits_do_not_fit() -> None:
    """A full fine-tune of a small model with a 128k vocabulary: its logits are what does not fit."""
    doc = llm_doc("llama", 16, 512, "bf16", None)
    doc["model"]["config"].update(vocab_size=128_256, hidden_size=256, max_position_embeddings=512)
    spec = parse_spec(doc)
    chunked = apply_changes(spec, {"efficiency.chunked_loss": True})
    plain_total, chunked_total = estimate_memory(spec).total_bytes, estimate_memory(chunked).total_bytes
    budget_gb = (plain_total + chunked_total) / 2 / 1024**3
    plan = plan_memory(spec, budget_gb)
    first = plan.entries[0]
    assert first.changes == {"efficiency.chunked_loss": True} and first.estimate_total_bytes == chunked_total
    assert "chunked loss" in first.reason
    for entry in plan.entries:
        assert estimate_memory(entry.spec).total_bytes == entry.estimate_total_bytes <= plan.budget_bytes


def test_planner_leaves_the_loss_alone_where_it_cannot_or_need_not_chunk() -> None:
    doc = llm_doc("llama", 16, 512, "bf16", None)
    doc["model"]["config"].update(vocab_size=128_256, hidden_size=256, max_position_embeddings=512)
    fits = plan_memory(parse_spec(doc), 80)
    assert fits.entries[0].changes == {}
    # Gemma 2 soft-caps its logits after the head: preflight refuses the chunked loss for it
    capped = {**doc, "model": {"config": {**doc["model"]["config"], "final_logit_softcapping": 30.0}}}
    entries = plan_memory(parse_spec(capped), 1).entries + plan_memory(parse_spec(capped), 4).entries
    assert all("efficiency.chunked_loss" not in e.changes for e in entries)
    liger = parse_spec({**doc, "efficiency": {**doc["efficiency"], "liger": True}})
    assert all("efficiency.chunked_loss" not in e.changes for e in plan_memory(liger, 4).entries)
