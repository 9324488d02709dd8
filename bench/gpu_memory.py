"""Memory and MFU measurements for ``bench/gpu_check.py``: real training steps on catalog or tiny configs.

Both train the way the two backends do (autocast, the grad scaler for fp16, clipping,
``zero_grad(set_to_none=True)``) on random weights and random data, so nothing is downloaded.
"""

from __future__ import annotations

import gc
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from trainer_core.memory import estimate_memory
from trainer_core.memory.catalog import catalog_config
from trainer_core.modeling import build_model
from trainer_core.optimizers import build_optimizer
from trainer_core.spec import JobSpec, parse_spec
from trainer_core.torch_optim import optimizer_state_bytes

Row = dict[str, Any]
LABELS = ["0", "1"]
GPU_MODELS = [  # (catalog id, task, micro-batch)
    ("bert-base-uncased", "text-classification", 32),
    ("google/vit-base-patch16-224", "image-classification", 32),
]
TINY = {
    "text-classification": {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
                            "num_attention_heads": 2, "intermediate_size": 128, "vocab_size": 300},
    "image-classification": {"model_type": "vit", "hidden_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 2, "intermediate_size": 128, "image_size": 32,
                             "patch_size": 8},
}  # fmt: skip
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s of an H100/H200 SXM (the vendor's figure, no sparsity)


def make_spec(config: dict[str, Any], task: str, batch: int, optimizer: str, ckpt: bool, mp: str) -> JobSpec:
    return parse_spec({
        "name": "gpu-check", "task": task, "model": {"config": config}, "dataset": {"path": "csv"},
        "preprocessing": {"max_length": 128}, "training": {"per_device_train_batch_size": batch},
        "optimizer": {"name": optimizer}, "efficiency": {"gradient_checkpointing": ckpt, "mixed_precision": mp},
    })  # fmt: skip


def make_batch(spec: JobSpec, device: str, seq: int | None = None) -> dict[str, torch.Tensor]:
    """Random inputs of the shapes the estimate assumes (max_length tokens, full-size images)."""
    b = spec.training.per_device_train_batch_size
    labels = torch.randint(0, len(LABELS), (b,), device=device)
    config = spec.model.config or {}
    if spec.task == "text-classification":
        shape = (b, seq or spec.preprocessing.max_length)
        ids = torch.randint(0, int(config.get("vocab_size", 30522)), shape, device=device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    size = int(config.get("image_size", 224))
    return {"pixel_values": torch.randn(b, 3, size, size, device=device), "labels": labels}


def train_steps(
    spec: JobSpec, device: str, steps: int, seq: int | None = None
) -> tuple[torch.nn.Module, Any, list[float]]:
    """``steps`` real steps as both backends take them (autocast, grad scaler for fp16, clipping,
    ``zero_grad(set_to_none=True)``); returns the model, the optimizer and each step's seconds."""
    model = build_model(spec.task, spec.model, LABELS).to(device).train()
    if spec.efficiency.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    optimizer = build_optimizer(model, spec.optimizer, spec.training.learning_rate, 0.01)
    batch = make_batch(spec, device, seq)
    mp = spec.efficiency.mixed_precision
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mp)
    scaler = torch.amp.GradScaler(device, enabled=mp == "fp16")
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return model, optimizer, seconds


def memory_rows(smoke: bool) -> list[Row]:
    """The grid of the module docstring: estimate / measured peak per configuration."""
    device = "cpu" if smoke else "cuda"
    models = ([("tiny-bert", TINY["text-classification"], "text-classification", 4),
               ("tiny-vit", TINY["image-classification"], "image-classification", 4)] if smoke
              else [(m, catalog_config(m), task, b) for m, task, b in GPU_MODELS])  # fmt: skip
    grid = [(opt, ckpt, mp) for opt in ("adamw", "adafactor", "adamw_8bit") for ckpt in (False, True)
            for mp in ("no", "bf16")] + [("adamw", False, "fp16")]  # fmt: skip
    rows = []
    for name, config, task, batch in models:
        for optimizer, ckpt, mp in grid:
            spec = make_spec(config, task, batch, optimizer, ckpt, mp)
            check = f"{name} {optimizer} ckpt={'on' if ckpt else 'off'} {mp if mp != 'no' else 'fp32'}"

            def one(spec: JobSpec = spec) -> Row:
                estimate = estimate_memory(spec, num_labels=len(LABELS), overhead_bytes=0)
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated() if device == "cuda" else 0
                model, optimizer_, _ = train_steps(spec, device, 1 if smoke else 3)
                state = optimizer_state_bytes(optimizer_)
                peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else None
                del model, optimizer_
                exact = state == estimate.optimizer_state_bytes
                same = "exact" if exact else f"DIFF {state:,}"
                detail = f"estimate {estimate.total_bytes:,} B; optimizer state {same}"
                if peak is None:
                    return {"value": "no CUDA peak", "goal": "optimizer state exact (CPU)",
                            "status": "PASS" if exact else "MISS", "detail": detail}
                ratio = estimate.total_bytes / peak
                return {"value": f"{ratio:.3f}", "goal": "0.9-1.1",
                        "status": "PASS" if 0.9 <= ratio <= 1.1 else "MISS", "detail": f"{detail}; peak {peak:,} B"}

            rows.append(fenced("memory", check, one))
    return rows


def mfu_row(smoke: bool) -> Row:
    """FLOPs a BERT-base bf16 training step does (6 per parameter per token + attention) over its time."""
    device = "cpu" if smoke else "cuda"
    config = TINY["text-classification"] if smoke else catalog_config("bert-base-uncased")
    batch, seq = (4, 64) if smoke else (32, 512)
    spec = make_spec(config, "text-classification", batch, "adamw", False, "no" if smoke else "bf16")
    model, _, times = train_steps(spec, device, 3 if smoke else 30, seq=seq)
    seconds = statistics.median(times[len(times) // 2 :])  # the first steps pay for warm-up and autotuning
    embed = sum(p.numel() for n, p in model.named_parameters() if "embeddings" in n)
    params = sum(p.numel() for p in model.parameters()) - embed
    layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    tokens = batch * seq
    flops = 6 * params * tokens + 12 * layers * hidden * seq * tokens  # PaLM appendix B
    achieved = flops / seconds
    if smoke:
        return {"value": f"{achieved / 1e12:.4f} TFLOP/s", "goal": "report", "status": "INFO",
                "detail": "CPU: no peak to divide by"}
    return {"value": f"{achieved / H200_BF16_PEAK:.1%}", "goal": "report", "status": "INFO",
            "detail": f"{achieved / 1e12:.0f} TFLOP/s of {H200_BF16_PEAK / 1e12:.0f}; batch {batch}x{seq}, "
                      f"{seconds * 1e3:.1f} ms/step, {torch.cuda.get_device_name()}"}  # fmt: skip


def fenced(section: str, check: str, fn: Callable[[], Row]) -> Row:
    """Run one check; an exception becomes an ERROR row instead of ending the whole script."""
    try:
        return {"section": section, "check": check, **fn()}
    except Exception as exc:
        return error_row(section, check, exc)


def error_row(section: str, check: str, exc: Exception) -> Row:
    traceback.print_exception(exc)
    return {"section": section, "check": check, "value": "-", "goal": "-", "status": "ERROR",
            "detail": f"{type(exc).__name__}: {exc}"[:300]}
