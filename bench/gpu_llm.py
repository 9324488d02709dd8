"""LLM memory rows for ``bench/gpu_check.py``: causal-LM steps against the estimate, and the lighter losses.

On a GPU: Llama-3.2-1B from the catalog config (random weights, offline), bf16 autocast, gradient
checkpointing, micro-batch 4 x 512 tokens, built by the engine's own builder (``build_training_model``:
PEFT, a 4-bit NF4 base for QLoRA, Liger's kernels); the estimate (without its overhead constant) against
``torch.cuda.max_memory_allocated``, goal 0.9-1.1, for full, LoRA and QLoRA steps and for LoRA with
``efficiency.chunked_loss`` and with ``efficiency.liger`` (whose logits part the estimate drops). Then,
in fp32 on the same weights and batch, the loss and the LoRA gradients of both lighter losses against
the plain loss (issue 25: rel 1e-5 for the chunked loss, whose arithmetic is the plain loss's; Liger's
Triton kernels reorder sums, so rel 1e-4). With ``--smoke`` (CPU): a tiny Llama, no Liger (Triton needs
CUDA), and the static parts (parameters with the 4-bit state, gradients, optimizer state) must equal the
estimate to the byte.
"""

from __future__ import annotations

import gc
from functools import partial
from typing import Any

import torch
from gpu_memory import Row, fenced

from trainer_core.backends.common import build_training_model
from trainer_core.backends.objective import Objective, chunked_loss_for
from trainer_core.memory import estimate_memory
from trainer_core.memory.catalog import catalog_config
from trainer_core.memory_report import memory_values
from trainer_core.optimizers import build_optimizer
from trainer_core.spec import JobSpec, parse_spec

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
              "max_position_embeddings": 64}  # fmt: skip
ADAPTERS: dict[str, dict[str, Any] | None] = {
    "full": None, "lora": {"type": "lora", "r": 16}, "qlora": {"type": "qlora", "r": 16},
}  # fmt: skip
# LoRA steps with a lighter loss: the kind's name, and its efficiency switch.
LIGHT_LOSSES = {"lora chunked-loss": "chunked_loss", "lora liger": "liger"}
# Loss and gradients of a lighter loss against the plain one (fp32): the bound, and Liger's.
LOSS_RTOL = {"chunked_loss": 1e-5, "liger": 1e-4}


def llm_spec(config: dict[str, Any], kind: str, batch: int, seq: int, mp: str) -> JobSpec:
    """``kind``: an adapter of :data:`ADAPTERS`, or a lighter loss of :data:`LIGHT_LOSSES` (with LoRA)."""
    light = LIGHT_LOSSES.get(kind)
    return parse_spec({
        "name": "gpu-check-llm", "task": "causal-lm", "model": {"config": config}, "dataset": {"path": "json"},
        "adapter": ADAPTERS["lora" if light else kind], "preprocessing": {"max_length": seq},
        "training": {"per_device_train_batch_size": batch},
        "efficiency": {"gradient_checkpointing": True, "mixed_precision": mp, **({light: True} if light else {})},
    })  # fmt: skip


def _loss(spec: JobSpec, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The step's loss through the backends' own objective: chunked under ``chunked_loss``, else the
    model's (Liger's fused one once patched in)."""
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    loss, _ = Objective(spec, chunked=chunked_loss_for(spec, model))(model, batch)
    return loss


def _step(spec: JobSpec, device: str) -> tuple[dict[str, int | None], int | None]:
    """One training step as the backends take it; the static bytes and the CUDA peak (None on CPU)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    model = build_training_model(spec, []).to(device).train()
    optimizer = build_optimizer(model, spec.optimizer, 1e-4, 0.0)
    b, s = spec.training.per_device_train_batch_size, spec.preprocessing.max_length
    vocab = int((spec.model.config or {})["vocab_size"])
    ids = torch.randint(0, vocab, (b, s), device=device)
    bf16 = spec.efficiency.mixed_precision == "bf16"
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        loss = _loss(spec, model, ids)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    values = memory_values(model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else None
    del model, optimizer
    return values, peak


def llm_memory_rows(smoke: bool) -> list[Row]:
    """One row per {full, lora, qlora, lora chunked-loss, lora liger (CUDA)}; on CUDA, the lighter losses'
    agreement rows too."""
    device = "cpu" if smoke else "cuda"
    name, config, batch, seq = ("tiny-llama", TINY_LLAMA, 2, 32) if smoke else (
        "Llama-3.2-1B", catalog_config("meta-llama/Llama-3.2-1B"), 4, 512)
    kinds = [*ADAPTERS, *(k for k, switch in LIGHT_LOSSES.items() if not (smoke and switch == "liger"))]
    rows = []
    for kind in kinds:
        spec = llm_spec(config, kind, batch, seq, "no" if smoke else "bf16")

        def one(spec: JobSpec = spec) -> Row:
            estimate = estimate_memory(spec, overhead_bytes=0)
            values, peak = _step(spec, device)
            static = (values["parameter_bytes"], values["gradient_bytes"], values["optimizer_state_bytes"])
            exact = static == (estimate.parameter_bytes, estimate.gradient_bytes, estimate.optimizer_state_bytes)
            detail = f"estimate {estimate.total_bytes:,} B; params/grads/optimizer {'exact' if exact else static}"
            if peak is None:
                return {"value": "no CUDA peak", "goal": "static parts exact (CPU)",
                        "status": "PASS" if exact else "MISS", "detail": detail}
            ratio = estimate.total_bytes / peak
            return {"value": f"{ratio:.3f}", "goal": "0.9-1.1",
                    "status": "PASS" if 0.9 <= ratio <= 1.1 and exact else "MISS",
                    "detail": f"{detail}; peak {peak:,} B"}

        rows.append(fenced("memory", f"{name} causal-lm {kind} ckpt bf16" if not smoke else f"{name} {kind} fp32", one))
    if not smoke:
        for kind, switch in LIGHT_LOSSES.items():
            agree = partial(light_loss_row, config, kind, switch, device)
            rows.append(fenced("memory", f"{name} {kind}: loss and LoRA grads vs plain, fp32", agree))
    return rows


def light_loss_row(config: dict[str, Any], kind: str, switch: str, device: str) -> Row:
    """The lighter loss against the plain one on the same weights and batch (fp32, as the specs of the
    memory rows otherwise: LoRA, gradient checkpointing)."""
    results = []
    for spec in (llm_spec(config, "lora", 2, 256, "no"), llm_spec(config, kind, 2, 256, "no")):
        torch.manual_seed(0)
        model = build_training_model(spec, []).to(device).train()
        torch.manual_seed(1)
        ids = torch.randint(0, int(config["vocab_size"]), (2, 256), device=device)
        loss = _loss(spec, model, ids)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
        del model
    (plain, plain_grads), (light, light_grads) = results
    bound = LOSS_RTOL[switch]
    same_params = plain_grads.keys() == light_grads.keys()
    loss_rel = float((light - plain).abs() / plain.abs())
    grad_rel = max((float((light_grads[n] - g).norm() / g.norm().clamp_min(1e-12))
                    for n, g in plain_grads.items() if n in light_grads), default=float("inf"))  # fmt: skip
    return {"value": f"loss rel {loss_rel:.1e}, grad rel {grad_rel:.1e}", "goal": f"<= {bound:g}",
            "status": "PASS" if same_params and max(loss_rel, grad_rel) <= bound else "MISS",
            "detail": f"{len(plain_grads)} LoRA tensors" + ("" if same_params else "; different trainable tensors")}
