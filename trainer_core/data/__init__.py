"""The data layer: load a spec's dataset, map labels, preprocess per modality, collate, cache on disk.

Backends call :func:`prepare_data` and get a :class:`PreparedData`; :func:`load_processor` gives the
tokenizer / image processor / feature extractor alone.
"""

from trainer_core.data.prepare import PreparedData, prepare_data
from trainer_core.data.preprocess import load_processor

__all__ = ["PreparedData", "load_processor", "prepare_data"]
