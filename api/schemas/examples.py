"""Worked examples for the OpenAPI document, runnable as they stand against ``trainjobs dev --example``.

The submit example names what that launcher places under the data root (``trainjobs.launcher.
write_example``): the packaged MiniLM in ``models/all-MiniLM-L6-v2`` and the sentiment CSVs in
``examples/``, so Swagger UI's "Try it out" gives a job that succeeds (one short epoch on 2 CPU cores).
tests/ui/test_docs.py submits it through Swagger UI and waits for success.
"""

from __future__ import annotations

from typing import Any

# Relative paths are read under DATA_ROOT (see api/paths.py): the launcher's layout, on any install.
EXAMPLE_SPEC: dict[str, Any] = {
    "name": "reviews-minilm",
    "task": "text-classification",
    "model": {"name_or_path": "models/all-MiniLM-L6-v2"},
    "dataset": {
        "path": "csv",
        "data_files": {"train": "examples/sentiment-train.csv", "validation": "examples/sentiment-validation.csv"},
        "text_column": "text",
        "label_column": "label",
    },
    "preprocessing": {"max_length": 32},
    "training": {
        "backend": "accelerate",
        "num_train_epochs": 1,
        "per_device_train_batch_size": 16,
        "per_device_eval_batch_size": 32,
        "learning_rate": 5e-5,
        "weight_decay": 0.01,
        "lr_scheduler_type": "linear",
        "warmup_ratio": 0.0,
        "seed": 42,
        "logging_steps": 1,
        "eval_strategy": "epoch",
        "save_steps": 50,
        "save_total_limit": 2,
    },
    "optimizer": {"name": "adamw"},
    "efficiency": {"gradient_accumulation_steps": 2, "gradient_checkpointing": True, "mixed_precision": "no"},
    "resources": {"num_processes": 1},
    "metrics": ["accuracy", "f1"],
}

EXAMPLE_JOB_CREATE: dict[str, Any] = {**EXAMPLE_SPEC, "priority": 5, "queue": "default"}

EXAMPLE_ESTIMATE_REQUEST: dict[str, Any] = {
    "spec": {
        "name": "bert-large-budget",
        "task": "text-classification",
        "model": {"name_or_path": "bert-large-uncased"},
        "dataset": {"path": "csv", "data_files": "examples/sentiment-train.csv"},
        "training": {"per_device_train_batch_size": 32},
        "optimizer": {"name": "adamw"},
        "preprocessing": {"max_length": 128},
    },
    "gpu_memory_gb": 16,
    "devices": 1,
}
