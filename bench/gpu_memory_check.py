"""Accuracy of the memory estimate on a real GPU: estimated total vs torch.cuda.max_memory_allocated.

Run: ``python bench/gpu_memory_check.py`` on a CUDA machine (a few minutes on one H200). It trains a
grid of 24 configurations, the three optimizers x gradient checkpointing on/off x fp32/bf16 autocast on
two catalog architectures (BERT-base on text, ViT-base on images; random weights, random data, so no
download) for a few steps each, the way both backends do (autocast around the forward, clipping,
``zero_grad(set_to_none=True)``), and prints per configuration the estimate (total minus the overhead
constant, which the allocator does not count), the measured peak, their ratio, and whether the
optimizer state matched to the byte. Goal: every ratio within 0.9-1.1.

Without CUDA it exits with status 2 and says so; ``--smoke`` instead runs the same loop on the CPU with
tiny models for one step (no peak to compare: it checks that the script itself works).
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from trainer_core.memory import estimate_memory
from trainer_core.memory.catalog import catalog_config
from trainer_core.modeling import build_model
from trainer_core.optimizers import build_optimizer
from trainer_core.spec import JobSpec, parse_spec
from trainer_core.torch_optim import optimizer_state_bytes

STEPS = 3
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


def make_spec(config: dict[str, Any], task: str, batch: int, optimizer: str, ckpt: bool, mp: str) -> JobSpec:
    return parse_spec({
        "name": "gpu-check", "task": task, "model": {"config": config}, "dataset": {"path": "csv"},
        "preprocessing": {"max_length": 128},
        "training": {"per_device_train_batch_size": batch},
        "optimizer": {"name": optimizer},
        "efficiency": {"gradient_checkpointing": ckpt, "mixed_precision": mp},
    })  # fmt: skip


def make_batch(spec: JobSpec, device: str) -> dict[str, torch.Tensor]:
    """Random inputs of the shapes the estimate assumes (max_length tokens, full-size images)."""
    b = spec.training.per_device_train_batch_size
    labels = torch.randint(0, len(LABELS), (b,), device=device)
    config = spec.model.config or {}
    if spec.task == "text-classification":
        ids = torch.randint(0, int(config.get("vocab_size", 30522)), (b, spec.preprocessing.max_length), device=device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    size = int(config.get("image_size", 224))
    return {"pixel_values": torch.randn(b, 3, size, size, device=device), "labels": labels}


def measure(spec: JobSpec, device: str, steps: int) -> tuple[int | None, int]:
    """(peak allocated bytes during training, optimizer-state bytes) for ``steps`` real steps."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    model = build_model(spec.task, spec.model, LABELS).to(device).train()
    if spec.efficiency.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    optimizer = build_optimizer(model, spec.optimizer, spec.training.learning_rate, 0.01)
    batch = make_batch(spec, device)
    mp = spec.efficiency.mixed_precision
    for _ in range(steps):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=mp == "bf16"):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = optimizer_state_bytes(optimizer)
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else None
    del model, optimizer, batch
    return peak, state


def main(argv: list[str]) -> int:
    smoke = "--smoke" in argv
    if not torch.cuda.is_available() and not smoke:
        print(
            "gpu_memory_check: no CUDA device found. This script validates the estimate against "
            "torch.cuda.max_memory_allocated and needs a GPU; run it on a CUDA machine "
            "(or with --smoke to exercise the loop on the CPU).",
            file=sys.stderr,
        )
        return 2
    device = "cpu" if smoke else "cuda"
    models = (
        [(TINY[task], task, 4) for _, task, _ in GPU_MODELS]
        if smoke
        else [(catalog_config(model_id), task, batch) for model_id, task, batch in GPU_MODELS]
    )
    names = ["tiny-bert", "tiny-vit"] if smoke else [m for m, _, _ in GPU_MODELS]
    print(f"{'model':<28} {'optimizer':<10} {'ckpt':<5} {'mp':<4} {'estimate':>14} {'peak':>14} "
          f"{'ratio':>6} state")  # fmt: skip
    ratios = []
    for name, (config, task, batch) in zip(names, models, strict=True):
        for optimizer in ("adamw", "adamw_8bit", "adafactor"):
            for ckpt in (False, True):
                for mp in ("no", "bf16"):
                    spec = make_spec(config, task, batch, optimizer, ckpt, mp)
                    estimate = estimate_memory(spec, num_labels=len(LABELS), overhead_bytes=0)
                    peak, state = measure(spec, device, 1 if smoke else STEPS)
                    ratio = estimate.total_bytes / peak if peak else float("nan")
                    ratios.append(ratio)
                    same = "exact" if state == estimate.optimizer_state_bytes else f"DIFF {state}"
                    print(f"{name:<28} {optimizer:<10} {ckpt!s:<5} {mp:<4} {estimate.total_bytes:>14,} "
                          f"{peak or 0:>14,} {ratio:>6.3f} {same}")  # fmt: skip
    if not smoke:
        inside = sum(0.9 <= r <= 1.1 for r in ratios)
        print(f"\n{inside}/{len(ratios)} ratios within 0.9-1.1 (estimate without the overhead constant)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
