"""Does ``torch.compile`` pay off for a classification fine-tune on this machine? (issue 13 P1)

    .venv/bin/python bench/bench_compile.py [--train 640] [--batch 16] [--bucket 32] [--epochs 1] [--only ...]
        [--out FILE]

Trains the packaged pretrained MiniLM on ``bench_training.py``'s review text (same data, batch,
learning rate, ``max_length`` 256, fp32) with the batches trainjobs builds (``length_grouped_order``,
``TextCollator``) and its AdamW (``build_optimizer``: the fused kernel on the CPU), four ways, each from
the same initial weights and in the same order:

- ``eager``: pad each batch to its longest input (what both backends do today);
- ``eager-bucketed``: pad to a multiple of ``--bucket`` tokens, so shapes repeat (the padding cost alone);
- ``compiled-bucketed``: ``torch.compile(model)`` over bucketed batches with static shapes: one
  compilation of forward and backward per bucket;
- ``compiled-dynamic``: ``torch.compile(model, dynamic=True)`` over batches padded to their longest.

For each it prints samples/s over the whole run (compilation included: what a user waits for); set step
by step against ``eager`` on the same batches, the speed of the steps that did not compile (the steady
state), the number of steps that compiled (dynamo or inductor built a graph) and the seconds they took
beyond eager's; padded tokens per step; the loss difference from ``eager`` at the first step (same
weights, same batch: compiled kernels must compute the same loss) and the largest over the run; and
the steps a run would need before compiling pays for itself. Dropout is off in every variant, so the
losses compare. Verdict line: compiling is worth offering as ``efficiency.compile`` only if a compiled
variant beats ``eager`` over the whole run (PASS); otherwise MISS, and trainjobs does not offer it.

Inductor's on-disk caches are pointed at a fresh directory, so every compiled variant compiles cold,
as a user's first job on a new worker does.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Cold compiles: no cache from an earlier run (the FX graph and kernel caches live under this directory).
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-compile-")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_training import minilm_path, write_data

from trainer_core.backends.sampling import length_grouped_order
from trainer_core.data.text import TextCollator, TextEncoder
from trainer_core.optimizers import OptimizerSpec, build_optimizer

VARIANTS = ("eager", "eager-bucketed", "compiled-bucketed", "compiled-dynamic")
# The first step starts from the same weights and batch: fp32 kernels that reorder sums (or pad more,
# masked) move the loss by ~1e-6; a wrong graph by far more. Later steps drift apart as weights do.
FIRST_LOSS_ATOL = 1e-4


def batches(tokenizer: Any, files: dict[str, str], args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    """The epoch's batches as unpadded features (trainjobs' ``TextEncoder``: its input columns, the label
    and the length the collator drops), in trainjobs' length-grouped order."""
    with open(files["train"], newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    encode = TextEncoder(tokenizer, "text", None, "label", {"negative": 0, "positive": 1}, args.max_length)
    columns = encode({name: [r[name] for r in rows] for name in ("text", "label")})
    features = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
    lengths = columns["length"]
    out: list[list[dict[str, Any]]] = []
    for epoch in range(args.epochs):
        order = length_grouped_order(lengths, args.batch, torch.Generator().manual_seed(epoch))
        out.extend([features[i] for i in order[at : at + args.batch]] for at in range(0, len(order), args.batch))
    return out


def compile_events() -> int:
    """Graphs dynamo has captured plus graphs inductor has built (forward and, at the first backward, backward)."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return counters["frames"]["total"] + inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_hit"]


def train(variant: str, model_path: str, tokenizer: Any, epoch: list[list[dict[str, Any]]],
          args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """One pass over ``epoch``: each step's seconds, whether it compiled, and its loss."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(42)
    torch._dynamo.reset()
    # Dropout off in every variant: eager and inductor draw different random masks, and the losses are
    # compared step by step to show that the compiled graph computes the same thing.
    model = AutoModelForSequenceClassification.from_pretrained(
        model_path, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    model.train()
    # trainjobs' own AdamW (its optimizer table: the fused kernel on the CPU), so the step is the backends'.
    optimizer = build_optimizer(model, OptimizerSpec(), args.lr, weight_decay=0.0)
    step_fn = model
    if variant.startswith("compiled"):
        step_fn = torch.compile(model, dynamic=variant == "compiled-dynamic")
    # trainjobs' own collator: each batch padded to its longest input, or to a multiple of the bucket.
    collate = TextCollator(tokenizer, pad_to_multiple_of=args.bucket if variant.endswith("bucketed") else None)
    times: list[float] = []
    compiled: list[bool] = []
    losses: list[float] = []
    widths: list[int] = []
    started = time.perf_counter()
    for batch in epoch:
        inputs = collate(batch)
        events, t0 = compile_events(), time.perf_counter()
        loss = step_fn(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
        compiled.append(compile_events() > events)
        widths.append(inputs["input_ids"].shape[1])
    wall = time.perf_counter() - started
    samples = sum(len(b) for b in epoch)
    tokens = sum(w * len(b) for w, b in zip(widths, epoch, strict=True))
    return {"variant": variant, "samples_per_s": samples / wall, "wall_s": wall, "step_s": times, "compiled": compiled,
            "widths": widths, "losses": losses, "tokens_per_step": tokens / len(epoch)}  # fmt: skip


def against_eager(row: dict[str, Any], eager: dict[str, Any]) -> dict[str, Any]:
    """Compilation cost, steady-state speed and break-even, each step set against eager's same step.

    ``compile_s``: what the steps that compiled took beyond eager's time for the same batches;
    ``steady``: eager's time over this variant's on the steps that did not compile (> 1: faster);
    ``break_even_steps``: steps at that saving that would pay back ``compile_s`` (inf: never)."""
    pairs = list(zip(row["step_s"], eager["step_s"], row["compiled"], strict=True))
    compile_s = sum(t - e for t, e, c in pairs if c)
    steady = [(t, e) for t, e, c in pairs if not c]
    ratio = sum(e for _, e in steady) / sum(t for t, _ in steady) if steady else math.nan
    saving = sum(e - t for t, e in steady) / len(steady) if steady else 0.0
    even = 0.0 if compile_s <= 0 else (compile_s / saving if saving > 0 else math.inf)
    return {"compile_steps": sum(row["compiled"]), "compile_s": compile_s, "steady": ratio, "break_even_steps": even}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--train", type=int, default=640)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--bucket", type=int, default=32, help="bucketed variants pad to a multiple of this")
    p.add_argument("--only", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--out", type=Path, default=None, help="also write every figure here (JSON)")
    return p


def main() -> int:
    args = parser().parse_args()
    chosen = [v for v in VARIANTS if v in args.only.split(",")]
    if "eager" not in chosen:
        chosen.insert(0, "eager")  # every ratio is against it
    from transformers import AutoTokenizer

    model_path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    with tempfile.TemporaryDirectory() as tmp:
        epoch = batches(tokenizer, write_data(Path(tmp), args.train, 1), args)
    results = {v: train(v, model_path, tokenizer, epoch, args) for v in chosen}
    eager = results["eager"]
    print(f"\nMiniLM-L6, {args.train} reviews x {args.epochs} epoch(s) = {len(epoch)} steps, batch {args.batch}, "
          f"max_length {args.max_length}, bucket {args.bucket}, fp32, cpu, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}")  # fmt: skip
    print(f"{'variant':18} {'samples/s':>9} {'vs eager':>8} {'steady vs eager':>15} {'compiling steps':>15} "
          f"{'compile s':>9} {'tokens/step':>11} {'dloss@1':>8} {'max dloss':>9} {'break-even steps':>16}")  # fmt: skip
    for row in results.values():
        row.update(against_eager(row, eager))
        diffs = [abs(a - b) for a, b in zip(row["losses"], eager["losses"], strict=True)]
        print(f"{row['variant']:18} {row['samples_per_s']:9.2f} {row['samples_per_s'] / eager['samples_per_s']:7.2f}x "
              f"{row['steady']:14.2f}x {row['compile_steps']:15d} {row['compile_s']:9.1f} "
              f"{row['tokens_per_step']:11.0f} {diffs[0]:8.1e} {max(diffs):9.1e} "
              f"{row['break_even_steps']:16.0f}")  # fmt: skip
        if diffs[0] > FIRST_LOSS_ATOL:
            print(f"  {row['variant']}: first-step loss differs from eager by {diffs[0]:.1e} (> {FIRST_LOSS_ATOL:g}), "
                  "from the same weights and batch: not the same computation")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))
    compiled = [r for r in results.values() if r["variant"].startswith("compiled")]
    if not compiled:
        return 0
    best = max(compiled, key=lambda r: r["samples_per_s"])
    ratio = best["samples_per_s"] / eager["samples_per_s"]
    verdict = "PASS: worth offering as efficiency.compile" if ratio > 1.0 else "MISS: not offered"
    print(f"best compiled variant {best['variant']}: {ratio:.2f}x eager over the whole run -> {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
