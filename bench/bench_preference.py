"""DPO speed and memory: trainjobs against TRL's ``DPOTrainer`` script, LoRA and QLoRA (issue 27).

One run tunes the same tiny Llama (random weights, saved to disk once so every run loads the same
checkpoint) on the same generated prompt/chosen/rejected rows (answers of varied length), with the
same adapter (r 16, alpha 32, dropout 0.05, all linear layers), batch, learning rate, beta, precision
and epoch, and prints tokens/s and peak RSS side by side:

- *TRL*: ``DPOTrainer(model, args=DPOConfig(...), train_dataset, processing_class, peft_config)`` as
  TRL's DPO docs write it; the reference is the base with the adapter disabled, as trainjobs' is. TRL's
  defaults that differ from a plain Trainer's (bf16, gradient checkpointing) are set to the spec's
  (fp32, off). For QLoRA the base is loaded with ``BitsAndBytesConfig(load_in_4bit=True, nf4, double
  quant)``;
- trainjobs: ``trainer_core.run.train_job`` on the spec (``method: dpo``), ``--backend`` chosen.

Tokens are each side's own: the prompt, chosen and rejected tokens of every pair trained (the
reference forward is not counted twice), over ``train_runtime``. Peak RSS is the run's own process
(each run is a fresh child: bench/child_runs.py), so imports and data count on both sides alike.

    .venv/bin/python bench/bench_preference.py [--pairs 256] [--batch 8] [--max-length 256]
        [--adapters lora,qlora] [--backend trainer] [--repeats 2]

Goal: trainjobs tokens/s >= 1.0x TRL's, stretch 1.2x.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_llm import adapter_section, add_model_arguments, peft_config, quantization, write_model
from child_runs import report, run_child

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GOAL, STRETCH = 1.0, 1.2  # trainjobs tokens/s over TRL's
SUBJECTS = ["the movie", "this film", "the food", "our stay", "the service", "the book", "the concert", "the hotel"]
KIND = ["good", "warm", "fine", "great", "lovely", "kind", "clear", "fresh", "bright", "calm"]
UNKIND = ["bad", "cold", "poor", "dull", "awful", "rude", "weak", "stale", "dark", "loud"]
FILL = ["plot", "acting", "music", "scenes", "story", "cast", "ending", "pacing", "was", "felt", "really", "and"]


def _answer(rng: random.Random, words: list[str]) -> str:
    n = max(3, min(120, round(rng.lognormvariate(2.8, 0.8))))
    return " ".join(rng.choice(words if i % 3 == 0 else FILL) for i in range(n))


def write_data(root: Path, n: int, seed: int = 0) -> dict[str, str]:
    """``train.jsonl`` of prompt/chosen/rejected rows: kind answers chosen, unkind rejected, lengths varied."""
    rng = random.Random(seed)
    path = root / "train.jsonl"
    with path.open("w", encoding="utf-8") as fh:
        for _ in range(n):
            prompt = f"what did you think of {rng.choice(SUBJECTS)}?"
            row = {"prompt": prompt, "chosen": f" {_answer(rng, KIND)}.", "rejected": f" {_answer(rng, UNKIND)}."}
            fh.write(json.dumps(row) + "\n")
    return {"train": str(path)}


def spec(kind: str, model: Path, files: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """The trainjobs spec whose settings both sides share."""
    return {
        "name": f"bench-dpo-{kind}", "task": "causal-lm", "method": "dpo", "model": {"name_or_path": str(model)},
        "dataset": {"path": "json", "data_files": files},
        "preprocessing": {"max_length": args.max_length},
        "preference": {"beta": args.beta},
        "training": {"backend": args.backend, "num_train_epochs": 1, "per_device_train_batch_size": args.batch,
                     "learning_rate": args.lr, "seed": 42, "eval_strategy": "no", "logging_steps": 50,
                     "save_steps": 100_000},
        "adapter": adapter_section(kind),
    }  # fmt: skip


def run_trainjobs(job: dict[str, Any], out: Path) -> dict[str, float]:
    """One trainjobs run; tokens are the prepared pairs' prompt + chosen + rejected tokens."""
    from trainer_core.data import prepare_data
    from trainer_core.events import EventCollector
    from trainer_core.run import train_job
    from trainer_core.spec import parse_spec

    parsed = parse_spec(job)
    events = EventCollector()
    status = train_job(parsed, out / "run", emit=events, cache_dir=out / "cache")
    summary = events.of_kind("done")[-1]["summary"]
    assert status == "succeeded", summary
    train = prepare_data(parsed, out / "cache").train  # a cache hit: the rows the run trained on
    tokens = sum(len(ids) for ids in train["chosen_input_ids"]) + sum(len(ids) for ids in train["rejected_input_ids"])
    return {"runtime_s": summary["train"]["train_runtime_s"], "loss": summary["train"]["train_loss"], "tokens": tokens}


def run_trl(kind: str, model_path: Path, files: dict[str, str], args: argparse.Namespace, out: Path) -> dict:
    """TRL's ``DPOTrainer`` as its docs show it, on the same rows, adapter, batch, rate, beta and precision."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = DPOConfig(
        output_dir=str(out), per_device_train_batch_size=args.batch, num_train_epochs=1, learning_rate=args.lr,
        beta=args.beta, seed=42, max_length=args.max_length, bf16=False, gradient_checkpointing=False,
        save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=50,
        use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=quantization(kind))
    data = load_dataset("json", data_files=files["train"], split="train")
    trainer = DPOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                         peft_config=peft_config())  # fmt: skip
    rows = trainer.train_dataset  # prompt_ids, chosen_ids, rejected_ids: each answer trains after the prompt
    tokens = sum(2 * len(p) + len(c) + len(r) for p, c, r in zip(
        rows["prompt_ids"], rows["chosen_ids"], rows["rejected_ids"], strict=True))  # fmt: skip
    metrics = trainer.train().metrics
    return {"runtime_s": metrics["train_runtime"], "loss": metrics["train_loss"], "tokens": tokens}


def child(args: argparse.Namespace) -> None:
    """One run in this process; its result as JSON on the last stdout line."""
    root = Path(args.root)
    files, model = json.loads((root / "files.json").read_text()), root / "tiny-llama"
    out = Path(tempfile.mkdtemp(dir=root))
    if args.child == "trainjobs":
        result = run_trainjobs(spec(args.kind, model, files, args), out)
    else:
        result = run_trl(args.kind, model, files, args, out)
    report(result)


def measured(args: argparse.Namespace, root: Path, side: str, kind: str) -> dict[str, float]:
    """A run of ``side`` in a child process: its result and its own peak RSS."""
    argv = ["--child", side, "--kind", kind, "--root", str(root),
            *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in PASSED)]  # fmt: skip
    return run_child(__file__, argv, f"{side} {kind}")


PASSED = ("batch", "lr", "beta", "max_length", "hidden", "layers", "backend")


def compare(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    files = write_data(root, args.pairs)
    (root / "files.json").write_text(json.dumps(files))
    write_model(root, files, args)
    rows = []
    for kind in args.adapters:
        best: dict[str, dict[str, float]] = {}
        for repeat in range(args.repeats):  # alternate the order; the fastest run counts, the lowest peak too
            for side in (["TRL", "trainjobs"] if repeat % 2 == 0 else ["trainjobs", "TRL"]):
                result = measured(args, root, side, kind)
                kept = best.get(side)
                peak = min(result["peak_rss_mb"], kept["peak_rss_mb"]) if kept else result["peak_rss_mb"]
                if kept is None or result["runtime_s"] < kept["runtime_s"]:
                    kept = best[side] = result
                kept["peak_rss_mb"] = peak
        for side, result in best.items():
            speed = result["tokens"] / result["runtime_s"]
            rows.append({"adapter": kind, "name": side, **result, "tokens_per_s": speed})
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--pairs", type=int, default=256)
    p.add_argument("--beta", type=float, default=0.1)
    add_model_arguments(p, lr=5e-5)
    p.add_argument("--child", choices=["trainjobs", "TRL"], help=argparse.SUPPRESS)
    p.add_argument("--kind", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = parser().parse_args()
    if args.child:
        child(args)
        return
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = compare(args, Path(tmp))
    print(f"\ntiny Llama (hidden {args.hidden}, {args.layers} layers), {args.pairs} pairs, batch {args.batch}, "
          f"max_length {args.max_length}, beta {args.beta}, backend {args.backend}, cpu")  # fmt: skip
    print(f"{'adapter':8} {'run':10} {'tokens':>8} {'tokens/s':>10} {'loss':>7} {'peak RSS':>10} {'vs TRL':>8}"
          f"  goal >= {GOAL:.1f}x (stretch {STRETCH:.1f}x)")  # fmt: skip
    by = {(r["adapter"], r["name"]): r for r in rows}
    missed = False
    for r in rows:
        ratio = r["tokens_per_s"] / by[(r["adapter"], "TRL")]["tokens_per_s"]
        status = "-" if r["name"] == "TRL" else ("PASS" if ratio >= GOAL else "MISS")
        missed |= status == "MISS"
        print(f"{r['adapter']:8} {r['name']:10} {int(r['tokens']):8d} {r['tokens_per_s']:10.0f} {r['loss']:7.3f} "
              f"{r['peak_rss_mb']:8.0f}MB {ratio:7.2f}x  {status}")  # fmt: skip
    print(f"(best of {args.repeats} runs each; total wall time {time.perf_counter() - started:.0f} s)")
    raise SystemExit(1 if missed else 0)


if __name__ == "__main__":
    main()
