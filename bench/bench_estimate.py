"""Benchmark: cold and warm `estimate_memory`, next to accelerate's own size computation.

Run: ``python bench/bench_estimate.py``. For each catalog model it prints the first (cold: config
resolved and model built on the meta device) and the median warm estimate time, then the time
``accelerate.utils.calculate_maximum_sizes`` (what ``accelerate estimate-memory`` uses) takes on the
same meta model, and both training figures: accelerate's "4 x model size" for Adam and ours.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = [
    "bert-base-uncased",
    "roberta-large",
    "google/vit-base-patch16-224",
    "facebook/wav2vec2-base",
    "Qwen/Qwen2.5-0.5B",
    "meta-llama/Meta-Llama-3-8B",
]
WARM_RUNS = 200


def main() -> None:
    start = time.perf_counter()
    from accelerate import init_empty_weights
    from accelerate.utils import calculate_maximum_sizes

    from trainer_core.memory import catalog_entry, estimate_memory
    from trainer_core.memory.catalog import catalog_config
    from trainer_core.memory.estimator import human_bytes
    from trainer_core.modeling import MODEL_CLASSES, config_from_dict, label_config
    from trainer_core.spec import parse_spec

    # Importing trainer_core.memory loads transformers' modeling code (seconds, once per process; the
    # API does it at start-up), so "cold" below is the per-model cost: config, meta build, estimate.
    print(f"import trainer_core.memory + accelerate: {time.perf_counter() - start:.2f} s\n")
    header = f"{'model':<34} {'cold ms':>9} {'warm ms':>8} {'accel ms':>9} {'accel 4x':>11} {'ours':>11}"
    print(header)
    print("-" * len(header))
    for model_id in MODELS:
        task = catalog_entry(model_id)["task"]
        spec = parse_spec({"name": "bench", "task": task, "model": {"name_or_path": model_id},
                           "dataset": {"path": "csv"}})  # fmt: skip
        t0 = time.perf_counter()
        estimate = estimate_memory(spec)
        cold = time.perf_counter() - t0
        times = []
        for _ in range(WARM_RUNS):
            t0 = time.perf_counter()
            estimate_memory(spec)
            times.append(time.perf_counter() - t0)
        warm = statistics.median(times)

        config = config_from_dict(catalog_config(model_id))
        for key, value in label_config(["0", "1"]).items():
            setattr(config, key, value)
        with init_empty_weights():
            model = MODEL_CLASSES[task].from_config(config)
        t0 = time.perf_counter()
        total_size, _largest = calculate_maximum_sizes(model)
        accel = time.perf_counter() - t0
        print(
            f"{model_id:<34} {cold * 1e3:>9.1f} {warm * 1e3:>8.3f} {accel * 1e3:>9.2f} "
            f"{human_bytes(4 * total_size):>11} {human_bytes(estimate.total_bytes):>11}"
        )
    print(
        "\naccel 4x: accelerate estimate-memory's Adam training size (4 x weights, no head, no activations);"
        "\nours: per-device total for the default spec (batch 8, max_length 128, fp32, AdamW, 1 GiB overhead)."
    )


LLM_MODEL = "meta-llama/Llama-3.1-70B"
LLM_ADAPTERS = {"full": None, "lora r16": {"type": "lora", "r": 16}, "qlora r16": {"type": "qlora", "r": 16}}


def bench_llm() -> None:
    """Warm latency of causal-LM estimates of the 70B config (goal: under 5 ms), full / LoRA / QLoRA."""
    from trainer_core.memory import estimate_memory
    from trainer_core.memory.estimator import human_bytes
    from trainer_core.spec import parse_spec

    print(f"\n{LLM_MODEL}, causal-lm, max_length 2048, batch 1, bf16")
    header = f"{'setting':<12} {'cold ms':>9} {'warm ms':>8} {'p99 ms':>8} {'total':>11}"
    print(header)
    print("-" * len(header))
    for label, adapter in LLM_ADAPTERS.items():
        spec = parse_spec({
            "name": "bench", "task": "causal-lm", "model": {"name_or_path": LLM_MODEL}, "dataset": {"path": "json"},
            "adapter": adapter, "preprocessing": {"max_length": 2048}, "training": {"per_device_train_batch_size": 1},
            "efficiency": {"mixed_precision": "bf16"},
        })  # fmt: skip
        t0 = time.perf_counter()
        estimate = estimate_memory(spec)
        cold = time.perf_counter() - t0
        times = []
        for _ in range(WARM_RUNS):
            t0 = time.perf_counter()
            estimate_memory(spec)
            times.append(time.perf_counter() - t0)
        times.sort()
        warm, p99 = statistics.median(times), times[int(0.99 * len(times)) - 1]
        total = human_bytes(estimate.total_bytes)
        print(f"{label:<12} {cold * 1e3:>9.1f} {warm * 1e3:>8.3f} {p99 * 1e3:>8.3f} {total:>11}")


if __name__ == "__main__":
    main()
    bench_llm()
