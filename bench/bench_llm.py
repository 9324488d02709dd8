"""LLM fine-tuning speed: trainjobs' LoRA and QLoRA against PEFT's documented script and TRL's SFTTrainer.

One run fine-tunes the same tiny Llama (random weights, saved to disk once so every variant loads the
same checkpoint) on the same generated prompt/completion data, with the same adapter (r 16, alpha 32,
dropout 0.05, all linear layers), batch, learning rate, precision and epochs, and prints tokens/s
(counted tokens: every non-padding token of the training rows, over ``train_runtime``) side by side:

- the *PEFT script*: ``get_peft_model(model, LoraConfig(...))`` and 🤗 ``Trainer`` as PEFT's quicktour
  writes it; for QLoRA the base is loaded with ``BitsAndBytesConfig(load_in_4bit=True, nf4, double quant)``
  and passed through ``prepare_model_for_kbit_training`` (gradient checkpointing off, as in the spec).
  Prompt tokens are masked to -100 and batches padded by ``DataCollatorForSeq2Seq``; with packing, the
  script packs rows itself (greedy to ``max_length``, positions restarting per example) and flattens
  batches like ``DataCollatorWithFlattening``;
- *TRL*: ``SFTTrainer`` with ``SFTConfig(packing=...)`` as TRL's docs write it (prompt/completion rows, a
  ``peft_config``; packed: best-fit-decreasing, padding-free), with precision and gradient checkpointing
  set to the spec's (fp32, off), since TRL's defaults (bf16, checkpointing) differ from a plain
  Trainer's. Its tokens are its own: TRL appends the eos token itself, so it trains about a token a
  row more than the other two (each side's tokens/s counts what it trained);
- trainjobs (``trainer_core.run.train_job``, the ``trainer`` backend by default) on the same spec; packed,
  its batches stay rows with a block-diagonal mask on eager/SDPA (issue 25).

Each pair runs without and with ``preprocessing.packing``; the goals are trainjobs >= 1.0x the PEFT
script and >= 1.2x TRL (issue 25). Packed, ``fill`` is each side's trained tokens over rows x max_length.
``vs unpacked`` is each side's packed tokens/s over its own unpacked tokens/s, on the same varied-length
data: what packing buys (the script's flattened batches attend over ``(B*L)^2`` on CPU).

    .venv/bin/python bench/bench_llm.py [--train 512] [--max-length 256] [--batch 8] [--repeats 2]
        [--adapters lora,qlora] [--backend trainer] [--only baseline]

``--only baseline`` runs just the baselines (the PEFT script and TRL). Each run is a process of its own
(bench/child_runs.py), so ``peak RSS`` is that run's alone: the packed-run memory issue 25 compares.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from child_runs import report, run_child

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GOAL = 1.0  # trainjobs tokens/s over the PEFT script's
TRL_GOAL = 1.2  # trainjobs tokens/s over TRL's SFTTrainer's (issue 25)
LORA = {"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"}
SUBJECTS = ["the movie", "this film", "the food", "our stay", "the service", "the book", "the concert", "the hotel"]
WORDS = ["plot", "acting", "music", "scenes", "story", "cast", "ending", "camera", "pacing", "was", "felt",
         "really", "quite", "and", "but", "also", "overall", "good", "bad", "long", "short", "warm"]  # fmt: skip


def write_data(root: Path, n: int, seed: int = 0) -> dict[str, str]:
    """``train.jsonl`` of prompt/completion rows whose completions vary in length (5 to ~200 words)."""
    rng = random.Random(seed)
    path = root / "train.jsonl"
    with path.open("w", encoding="utf-8") as fh:
        for _ in range(n):
            subject = rng.choice(SUBJECTS)
            words = max(5, min(200, round(rng.lognormvariate(3.2, 0.8))))
            answer = " ".join(rng.choice(WORDS) for _ in range(words))
            fh.write(json.dumps({"prompt": f"what did you think of {subject}?", "completion": f" {answer}."}) + "\n")
    return {"train": str(path)}


def write_model(root: Path, files: dict[str, str], args: argparse.Namespace) -> Path:
    """A tiny random Llama and a WordPiece tokenizer trained on the data, saved as one checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainer_core.data.text import train_wordpiece

    texts = Path(files["train"]).read_text(encoding="utf-8").splitlines()
    tokenizer = train_wordpiece(texts, 512, model_max_length=args.max_length, with_token_types=False)
    tokenizer.eos_token = tokenizer.sep_token  # what every side ends a sequence with (trainjobs' own choice)
    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 4, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=len(tokenizer),
        max_position_embeddings=args.max_length, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    path = root / "tiny-llama"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def adapter_section(kind: str) -> dict[str, Any]:
    """The spec's adapter: LoRA or QLoRA (NF4, double quant, bf16 compute) with :data:`LORA`."""
    return {"type": kind, **LORA, **({"compute_dtype": "bf16"} if kind == "qlora" else {})}


def peft_config() -> Any:
    """:data:`LORA` as the baselines pass it to PEFT / TRL."""
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules=LORA["target_modules"])  # fmt: skip


def quantization(kind: str) -> Any:
    """The baselines' ``quantization_config``: QLoRA's NF4 base (double quant, bf16 compute), else None."""
    import torch
    from transformers import BitsAndBytesConfig

    if kind != "qlora":
        return None
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip


def add_model_arguments(p: argparse.ArgumentParser, lr: float) -> None:
    """The arguments both LLM benches share: batch, rate, model size, adapters, backend, repeats."""
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--adapters", type=lambda s: s.split(","), default=["lora", "qlora"])
    p.add_argument("--backend", choices=["trainer", "accelerate"], default="trainer")
    p.add_argument("--repeats", type=int, default=2, help="runs per variant; the fastest counts")


def lm_spec(kind: str, packing: bool, model: Path, files: dict[str, str], args: argparse.Namespace) -> dict:
    """The trainjobs spec both sides share the settings of."""
    return {
        "name": f"bench-{kind}", "task": "causal-lm", "model": {"name_or_path": str(model)},
        "dataset": {"path": "json", "data_files": files},
        "preprocessing": {"max_length": args.max_length, "packing": packing},
        "training": {"backend": args.backend, "num_train_epochs": 1, "per_device_train_batch_size": args.batch,
                     "learning_rate": args.lr, "seed": 42, "eval_strategy": "no", "logging_steps": 50,
                     "save_steps": 100_000},
        "adapter": adapter_section(kind),
    }  # fmt: skip


def counted_tokens(spec: dict, cache: Path) -> int:
    """Non-padding tokens of the training rows as trainjobs prepares them (the same for the script)."""
    from trainer_core.data import prepare_data
    from trainer_core.spec import parse_spec

    return int(sum(prepare_data(parse_spec(spec), cache).train["length"]))


def run_trainjobs(spec: dict, out: Path, cache: Path) -> dict[str, float]:
    """One trainjobs run in this process; the training time from its ``done`` summary."""
    from trainer_core.events import EventCollector
    from trainer_core.run import train_job
    from trainer_core.spec import parse_spec

    events = EventCollector()
    status = train_job(parse_spec(spec), out, emit=events, cache_dir=cache)
    summary = events.of_kind("done")[-1]["summary"]
    assert status == "succeeded", summary
    return {"runtime_s": summary["train"]["train_runtime_s"], "loss": summary["train"]["train_loss"]}


def _peft_model(kind: str, model_path: Path) -> Any:
    """Base model plus LoRA adapter, as PEFT's quicktour and its QLoRA guide build it."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=quantization(kind))
    if kind == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return get_peft_model(model, peft_config())


def _script_rows(tokenizer: Any, files: dict[str, str], max_length: int) -> list[dict[str, list[int]]]:
    """Prompt + completion + eos, prompt labels -100, truncated: the usual SFT preprocessing."""
    rows = []
    for line in Path(files["train"]).read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        prompt = tokenizer(row["prompt"])["input_ids"][:-1]  # [CLS] + prompt (the trailing [SEP] dropped)
        completion = [*tokenizer(row["completion"], add_special_tokens=False)["input_ids"], tokenizer.sep_token_id]
        ids = (prompt + completion)[:max_length]
        labels = ([-100] * len(prompt) + completion)[:max_length]
        if any(label != -100 for label in labels[1:]):
            rows.append({"input_ids": ids, "labels": labels})
    return rows


def _pack(rows: list[dict[str, list[int]]], max_length: int) -> list[dict[str, list[int]]]:
    packed: list[dict[str, list[int]]] = []
    for row in rows:
        if not packed or len(packed[-1]["input_ids"]) + len(row["input_ids"]) > max_length:
            packed.append({"input_ids": [], "labels": [], "position_ids": []})
        packed[-1]["input_ids"] += row["input_ids"]
        packed[-1]["labels"] += [-100, *row["labels"][1:]]
        packed[-1]["position_ids"] += list(range(len(row["input_ids"])))
    return packed


def _flatten(features: list[dict[str, list[int]]]) -> dict[str, Any]:
    import torch

    return {k: torch.tensor([[v for f in features for v in f[k]]]) for k in ("input_ids", "labels", "position_ids")}


def run_peft_script(kind: str, packing: bool, model_path: Path, files: dict[str, str], args: argparse.Namespace,
                    out: Path) -> dict[str, float]:  # fmt: skip
    """The user's own PEFT + Trainer script."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = _script_rows(tokenizer, files, args.max_length)
    data = Dataset.from_list(_pack(rows, args.max_length) if packing else rows)
    collator = _flatten if packing else DataCollatorForSeq2Seq(tokenizer, padding=True)
    training_args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=args.batch, num_train_epochs=1, learning_rate=args.lr,
        seed=42, eval_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=50,
        use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    trainer = Trainer(model=_peft_model(kind, model_path), args=training_args, train_dataset=data,
                      data_collator=collator)  # fmt: skip
    metrics = trainer.train().metrics
    return {"runtime_s": metrics["train_runtime"], "loss": metrics["train_loss"],
            "tokens": sum(len(r["input_ids"]) for r in rows)}  # fmt: skip


def run_trl(kind: str, packing: bool, model_path: Path, files: dict[str, str], args: argparse.Namespace,
            out: Path) -> dict[str, float]:  # fmt: skip
    """TRL's ``SFTTrainer`` as its docs show it, on the same rows, adapter, batch, rate and precision."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = SFTConfig(
        output_dir=str(out), per_device_train_batch_size=args.batch, num_train_epochs=1, learning_rate=args.lr,
        seed=42, max_length=args.max_length, packing=packing, bf16=False, gradient_checkpointing=False,
        save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=50, eos_token=tokenizer.sep_token,
        use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=quantization(kind))
    data = load_dataset("json", data_files=files["train"], split="train")
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                         peft_config=peft_config())  # fmt: skip
    rows = trainer.train_dataset["input_ids"]
    metrics = trainer.train().metrics
    tokens = sum(len(ids) for ids in rows)
    return {"runtime_s": metrics["train_runtime"], "loss": metrics["train_loss"], "tokens": tokens,
            "fill": tokens / (len(rows) * args.max_length)}  # fmt: skip


def compare(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    """Every (adapter, packing) pair: script and trainjobs, ``args.repeats`` times each, fastest kept."""
    files = write_data(root, args.train)
    model = write_model(root, files, args)
    rows = []
    for kind in args.adapters:
        for packing in (False, True):
            spec = lm_spec(kind, packing, model, files, args)
            names = ["PEFT script", "TRL"] + (["trainjobs"] if args.only != "baseline" else [])
            runners: dict[str, Callable[[Path], dict[str, float]]] = {
                name: lambda out, n=name, k=kind, p=packing: measured(args, root, n, k, p, out) for name in names
            }
            tokens = counted_tokens(spec, root / "cache")
            best: dict[str, dict[str, float]] = {}
            # A shared machine slows whichever run overlaps other work: alternate the order, keep the fastest.
            for repeat in range(args.repeats):
                order = list(runners) if repeat % 2 == 0 else list(reversed(runners))
                for i, name in enumerate(order):
                    result = runners[name](root / f"run-{kind}-{packing}-{repeat}-{i}")
                    kept = best.get(name)
                    # the fastest run counts, with the lowest peak of all its runs
                    peak = min(result["peak_rss_mb"], kept["peak_rss_mb"]) if kept else result["peak_rss_mb"]
                    if kept is None or result["runtime_s"] < kept["runtime_s"]:
                        kept = best[name] = result
                    kept["peak_rss_mb"] = peak
            script_tokens = int(best["PEFT script"]["tokens"])
            assert script_tokens == tokens, f"the script trained {script_tokens} tokens, trainjobs {tokens}"
            fill = packed_fill(spec, root / "cache", args.max_length) if packing else None
            for name, result in best.items():
                trained = int(result["tokens"]) if name == "TRL" else tokens
                rows.append({"adapter": kind, "packing": packing, "name": name, "tokens": trained,
                             "tokens_per_s": trained / result["runtime_s"], "loss": result["loss"],
                             "peak_rss_mb": result["peak_rss_mb"],
                             "fill": {"TRL": result.get("fill"), "trainjobs": fill}.get(name)})  # fmt: skip
    return rows


PASSED = ("batch", "lr", "max_length", "backend")  # what a child run reads of the bench's arguments


def measured(
    args: argparse.Namespace, root: Path, name: str, kind: str, packing: bool, out: Path
) -> dict[str, float]:
    """One run of ``name`` in a child process (bench/child_runs.py): its result and its own peak RSS."""
    argv = ["--child", name, "--kind", kind, "--root", str(root), "--out", str(out),
            *(["--packing"] if packing else []),
            *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in PASSED)]  # fmt: skip
    return run_child(__file__, argv, f"{name} {kind} packing={packing}")


def child(args: argparse.Namespace) -> None:
    """One run in this process (``--child``), on the data and model the bench wrote under ``--root``."""
    root, out = Path(args.root), Path(args.out)
    files, model = {"train": str(root / "train.jsonl")}, root / "tiny-llama"
    if args.child == "trainjobs":
        result = run_trainjobs(lm_spec(args.kind, args.packing, model, files, args), out, root / "cache")
    elif args.child == "TRL":
        result = run_trl(args.kind, args.packing, model, files, args, out)
    else:
        result = run_peft_script(args.kind, args.packing, model, files, args, out)
    report(result)


def packed_fill(spec: dict, cache: Path, max_length: int) -> float:
    """trainjobs' packed rows: trained tokens over rows x max_length (the script packs the same rows greedily,
    so its fill is not trainjobs'; it is left out)."""
    from trainer_core.data import prepare_data
    from trainer_core.spec import parse_spec

    train = prepare_data(parse_spec(spec), cache).train
    return float(sum(train["length"])) / (len(train) * max_length)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--train", type=int, default=512)
    add_model_arguments(p, lr=2e-4)
    p.add_argument("--only", choices=["baseline"], default=None, help="run only the baselines (PEFT script, TRL)")
    p.add_argument("--child", choices=["PEFT script", "TRL", "trainjobs"], help=argparse.SUPPRESS)
    for hidden in ("--kind", "--root", "--out"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--packing", action="store_true", help=argparse.SUPPRESS)
    return p


def main() -> None:
    import torch

    args = parser().parse_args()
    if args.child:
        child(args)
        return
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = compare(args, Path(tmp))
    print(f"\ntiny Llama (hidden {args.hidden}, {args.layers} layers), {args.train} prompt/completion rows, "
          f"batch {args.batch}, max_length {args.max_length}, backend {args.backend}, "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}, torch threads {torch.get_num_threads()}")  # fmt: skip
    print(f"{'adapter':8} {'packing':8} {'run':12} {'tokens':>8} {'tokens/s':>10} {'loss':>7} {'fill':>6} "
          f"{'peak RSS':>9} {'vs script':>10} {'vs TRL':>8} {'vs unpacked':>12}  "
          f"goals >= {GOAL:.1f}x script, >= {TRL_GOAL:.1f}x TRL")  # fmt: skip
    by = {(r["adapter"], r["packing"], r["name"]): r["tokens_per_s"] for r in rows}
    missed = False
    for r in rows:
        key = (r["adapter"], r["packing"])
        ratio, vs_trl = r["tokens_per_s"] / by[(*key, "PEFT script")], r["tokens_per_s"] / by[(*key, "TRL")]
        gain = f"{r['tokens_per_s'] / by[(r['adapter'], False, r['name'])]:11.2f}x" if r["packing"] else f"{'-':>12}"
        status = "-"
        if r["name"] == "trainjobs":
            status = "PASS" if ratio >= GOAL and vs_trl >= TRL_GOAL else "MISS"
        missed |= status == "MISS"
        fill = f"{r['fill']:6.3f}" if r["fill"] is not None else f"{'-':>6}"
        print(f"{r['adapter']:8} {r['packing']!s:8} {r['name']:12} {r['tokens']:8d} {r['tokens_per_s']:10.0f} "
              f"{r['loss']:7.3f} {fill} {r['peak_rss_mb']:7.0f}MB {ratio:9.2f}x {vs_trl:7.2f}x {gain}  "
              f"{status}")  # fmt: skip
    print(f"(best of {args.repeats} runs each; total wall time {time.perf_counter() - started:.0f} s)")
    raise SystemExit(1 if missed else 0)


if __name__ == "__main__":
    main()
