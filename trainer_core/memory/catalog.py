"""The built-in model catalog: popular architectures stored as their config numbers.

Each ``catalog/*.json`` file holds one entry: ``id`` (the hub id users write), ``task``, the
``config`` (a transformers config dict naming its ``model_type``), ``parameters`` (the count of the
model built for its ``task``: the classifier with two labels, or the causal LM; pinned by a test) and
``published`` (the size the model's authors state and the model class it refers to, also pinned by
a test). Estimates for these ids work offline: no config is downloaded.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any


@cache
def _entries() -> dict[str, dict[str, Any]]:
    """All catalog entries by id, read once from the package data."""
    folder = resources.files("trainer_core.memory").joinpath("catalog")
    entries: dict[str, dict[str, Any]] = {}
    for item in sorted(folder.iterdir(), key=lambda f: f.name):
        if item.name.endswith(".json"):
            entry = json.loads(item.read_text(encoding="utf-8"))
            entries[entry["id"]] = entry
    return entries


def catalog_ids() -> list[str]:
    """The ids of every catalog model, sorted."""
    return sorted(_entries())


def in_catalog(model_id: str) -> bool:
    """Whether ``model_id`` names a catalog model."""
    return model_id in _entries()


def catalog_entry(model_id: str) -> dict[str, Any]:
    """What ``GET /v1/models/catalog`` lists for one model: id, task, model_type, parameters.

    Raises ``KeyError`` for an id not in the catalog.
    """
    entry = _entries()[model_id]
    return {
        "id": entry["id"],
        "task": entry["task"],
        "model_type": entry["config"]["model_type"],
        "parameters": entry["parameters"],
    }


def catalog_config(model_id: str) -> dict[str, Any]:
    """A copy of the stored config dict of ``model_id`` (callers may modify it)."""
    return json.loads(json.dumps(_entries()[model_id]["config"]))


def catalog_published(model_id: str) -> dict[str, Any]:
    """The published size of ``model_id``: ``parameters``, ``auto_class``, ``num_labels``, ``source``."""
    return dict(_entries()[model_id]["published"])
