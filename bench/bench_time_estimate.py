"""How well the time estimate predicts a run's training time (issue 29), on this machine's CPU.

Three calibration jobs train first; the queue's efficiency is fitted from them exactly as the service
fits a queue's finished jobs (``trainer_core.time_estimate.calibrate`` over ``Observation(counted FLOPs,
train_runtime_s, steps)``: a per-step overhead and a rate where the three differ enough in work per
step). Then ten new specs, differing in model size, batch, max length, packing, adapter,
gradient checkpointing and optimizer, are predicted (``predict_seconds`` on their counted FLOPs,
``trainer_core.flops.training_flops``, the service's own count) and trained, and the table prints
predicted / actual train time for each. Goal: every ratio within 0.8-1.25 (stretch 0.9-1.1).

Every run is the engine's (``trainer_core.run.train_job``, in this process, ``trainer`` backend, fp32,
no evaluation). The text rows are longer than ``max_length``, and the causal-LM data is the varied
prompt/completion set of ``bench_llm.py``, packed or padded as each spec says; the count takes each
sample's positions from the data's own lengths as preflight does (``trainer_core/token_lengths.py``). Packed
rows stay rows under eager/SDPA (attention B*L^2 a batch, issue 25), and the count models that path.

    .venv/bin/python bench/bench_time_estimate.py [--steps 30]
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LOW, HIGH = 0.8, 1.25
WORDS = ["plot", "acting", "music", "scenes", "story", "cast", "ending", "camera", "pacing", "was", "felt",
         "really", "quite", "and", "but", "also", "overall", "good", "bad", "long", "short", "warm"]  # fmt: skip


def bert(hidden: int, layers: int) -> dict[str, Any]:
    config = {"model_type": "bert", "hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": 2000,
              "num_attention_heads": max(2, hidden // 64), "intermediate_size": 4 * hidden,
              "max_position_embeddings": 512, "hidden_dropout_prob": 0.0,
              "attention_probs_dropout_prob": 0.0}  # fmt: skip
    return config


def text_spec(name: str, files: dict[str, str], config: dict[str, Any], batch: int, max_length: int,
              steps: int, **sections: Any) -> dict[str, Any]:  # fmt: skip
    spec: dict[str, Any] = {
        "name": name, "task": "text-classification", "model": {"config": config},
        "dataset": {"path": "csv", "data_files": files},
        "preprocessing": {"max_length": max_length},
        "training": {"max_steps": steps, "per_device_train_batch_size": batch, "seed": 42, "eval_strategy": "no",
                     "logging_steps": 1000, "save_steps": 100_000},
    }  # fmt: skip
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value}
    return spec


def lm_spec(name: str, files: dict[str, str], model: Path, batch: int, max_length: int, steps: int,
            packing: bool, adapter: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    spec: dict[str, Any] = {
        "name": name, "task": "causal-lm", "model": {"name_or_path": str(model)},
        "dataset": {"path": "json", "data_files": files},
        "preprocessing": {"max_length": max_length, "packing": packing},
        "training": {"max_steps": steps, "per_device_train_batch_size": batch, "seed": 42, "eval_strategy": "no",
                     "logging_steps": 1000, "save_steps": 100_000},
    }  # fmt: skip
    if adapter is not None:
        spec["adapter"] = adapter
    return spec


def write_reviews(root: Path, n: int, seed: int = 0) -> dict[str, str]:
    """Reviews of 300-400 words: every row fills any ``max_length`` used here."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "train.csv"
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text", "label"])
        for i in range(n):
            writer.writerow([" ".join(rng.choice(WORDS) for _ in range(rng.randint(300, 400))), i % 2])
    return {"train": str(path)}


def measure(spec: dict[str, Any], out: Path) -> tuple[float, float]:
    """(counted FLOPs, train_runtime_s) of one run of ``spec``."""
    from datasets import load_dataset

    from trainer_core.events import EventCollector
    from trainer_core.flops import training_flops
    from trainer_core.memory.parameters import model_structure
    from trainer_core.run import train_job
    from trainer_core.spec import parse_spec
    from trainer_core.token_lengths import estimate_sample_tokens

    parsed = parse_spec(spec)
    events = EventCollector()
    status = train_job(parsed, out, emit=events, cache_dir=out.parent / "cache")
    summary = events.of_kind("done")[-1]["summary"]
    assert status == "succeeded", summary
    # max_steps: the run trains steps x batch rows (packed rows when packing), the count's samples, each
    # of the positions the data's lengths give (preflight's measure; max_length where it has none).
    rows = parsed.training.max_steps * parsed.training.per_device_train_batch_size
    data = load_dataset(parsed.dataset.path, data_files=dict(parsed.dataset.data_files or {}))["train"]
    measured = estimate_sample_tokens(parsed, data)
    tokens = round(measured.tokens) if measured is not None else None
    work = training_flops(model_structure(parsed.model, parsed.task), parsed, train_rows=rows, eval_rows=0,
                          tokens=tokens)  # fmt: skip
    return float(work.total), float(summary["train"]["train_runtime_s"])


def main() -> None:
    import torch
    from bench_llm import write_data as write_lm_data
    from bench_llm import write_model

    from trainer_core.time_estimate import Observation, calibrate, device_peak, predict_seconds

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        reviews = write_reviews(root / "reviews", 2000)
        (root / "lm").mkdir()
        lm_files = write_lm_data(root / "lm", 2000)
        llama = write_model(root, lm_files, argparse.Namespace(hidden=128, layers=2, max_length=256))
        lora = {"type": "lora", "r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}
        s = args.steps
        calibration = [
            text_spec("cal-bert-192x3", reviews, bert(192, 3), 16, 128, s),
            text_spec("cal-bert-128x4-len192", reviews, bert(128, 4), 8, 192, s),
            lm_spec("cal-llama-lora-padded-len64", lm_files, llama, 8, 64, s, False, lora),
        ]
        new = [
            text_spec("bert-128x2", reviews, bert(128, 2), 8, 128, s),
            text_spec("bert-256x4", reviews, bert(256, 4), 8, 128, s),
            text_spec("bert-128x2-batch32-len64", reviews, bert(128, 2), 32, 64, s),
            text_spec("bert-128x2-len256", reviews, bert(128, 2), 8, 256, s),
            text_spec("bert-256x4-ckpt", reviews, bert(256, 4), 8, 128, s, efficiency={"gradient_checkpointing": True}),
            text_spec("bert-192x3-adafactor", reviews, bert(192, 3), 16, 128, s, optimizer={"name": "adafactor"}),
            text_spec("bert-384x6", reviews, bert(384, 6), 8, 128, s),
            lm_spec("llama-full-packed", lm_files, llama, 8, 128, s, True, None),
            lm_spec("llama-lora-packed-len256", lm_files, llama, 4, 256, s, True, lora),
            lm_spec("llama-lora-padded", lm_files, llama, 8, 128, s, False, lora),
        ]
        peak = device_peak("cpu", "fp32")
        history = []
        for spec in calibration:
            flops, seconds = measure(spec, root / "runs" / spec["name"])
            history.append(Observation(flops, seconds, steps=spec["training"]["max_steps"]))
            print(f"calibration {spec['name']:<28} {flops / 1e9:10.1f} GFLOP {seconds:8.2f} s", flush=True)
        fit = calibrate(history, peak)
        print(f"fitted efficiency {fit.efficiency:.3f} of the nominal peak, overhead {1000 * fit.overhead_s:.1f} ms "
              f"a step, spread {fit.spread:.3f}, calibrated {fit.calibrated}\n")  # fmt: skip
        print(f"{'spec':<28} {'GFLOP':>9} {'predicted s':>12} {'p10-p90 s':>15} {'actual s':>9} {'ratio':>6}  goal")
        inside = 0
        for spec in new:
            flops, seconds = measure(spec, root / "runs" / spec["name"])
            predicted = predict_seconds(flops, peak, fit, steps=spec["training"]["max_steps"])
            ratio = predicted.seconds / seconds
            ok = LOW <= ratio <= HIGH
            inside += ok
            print(f"{spec['name']:<28} {flops / 1e9:9.1f} {predicted.seconds:12.2f} "
                  f"{predicted.low:7.1f}-{predicted.high:<7.1f} {seconds:9.2f} {ratio:6.2f}  "
                  f"{'PASS' if ok else 'MISS'}", flush=True)  # fmt: skip
        print(f"\n{inside} of {len(new)} within {LOW}-{HIGH}")


if __name__ == "__main__":
    main()
