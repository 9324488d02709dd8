"""Where a model, tokenizer or processor will be loaded from, checked without loading it.

A local folder must exist and hold the files ``from_pretrained`` reads; a hub id must be in the local
hub cache, or (online only) answer one short metadata request. The model's config is read (a small
JSON file) to check that the task's model class has a head for its architecture.
"""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id
from transformers import AutoConfig, PretrainedConfig

from trainer_core.modeling import MODEL_CLASSES, config_from_dict
from trainer_core.path_guard import os_problem
from trainer_core.spec import TEXT_TASKS, FieldError, JobSpec

HUB_TIMEOUT_S = 3.0
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, but read now (the library reads it at import)."""
    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def _is_local(source: str) -> bool:
    try:
        return source.startswith(("/", ".", "~")) or Path(source).exists()
    except OSError:  # a name the OS refuses to look up (too long, a loop of links) is a path, not a hub id
        return True


class _Source:
    """One location: finds its files locally or in the hub cache, recording what is wrong."""

    def __init__(self, source: str, revision: str | None, field: str, errors: list[FieldError]):
        self.source, self.revision, self.field, self.errors = source, revision, field, errors
        self.kind = "local" if _is_local(source) else "hub"

    def fail(self, message: str) -> None:
        self.errors.append(FieldError(self.field, message, "not_found"))

    def find(self, names: tuple[str, ...]) -> Path | None:
        """The first of ``names`` present (a local path or a cached hub file)."""
        for name in names:
            if self.kind == "local":
                path = Path(self.source).expanduser() / name
                if path.is_file():
                    return path
            else:
                cached = try_to_load_from_cache(self.source, name, revision=self.revision)
                if isinstance(cached, str):
                    return Path(cached)
        return None

    def exists(self) -> bool:
        """The folder exists, or the hub id is cached or (online) known to the hub; else an error."""
        if self.kind == "local":
            if problem := os_problem(str(Path(self.source).expanduser())):
                self.fail(f"{self.source}: {problem}")
                return False
            if not Path(self.source).expanduser().is_dir():
                self.fail(f"no folder {self.source}")
                return False
            return True
        try:
            validate_repo_id(self.source)
        except HFValidationError as exc:  # the hub client raises it from every lookup of such a name
            self.fail(f"{self.source!r} is neither a folder nor a hub id: {str(exc).split(':')[0]}")
            return False
        if self.find(("config.json", *TOKENIZER_FILES, *PROCESSOR_FILES)) is not None:
            self.kind = "hub-cache"
            return True
        if hub_offline():
            self.fail(
                f"{self.source!r} is not in the hub cache {constants.HF_HUB_CACHE} and HF_HUB_OFFLINE is set: "
                "download it there first, or give a local folder"
            )
            return False
        return self._ask_hub()

    def _ask_hub(self) -> bool:
        url = hf_hub_url(self.source, "config.json", revision=self.revision)
        try:
            get_hf_file_metadata(url, timeout=HUB_TIMEOUT_S)
        except (RepositoryNotFoundError, EntryNotFoundError):
            self.fail(f"{self.source!r} is not a model on the hub (or it is private)")
            return False
        except (HfHubHTTPError, OSError) as exc:
            self.fail(f"the hub did not answer for {self.source!r} ({type(exc).__name__}); is it reachable?")
            return False
        return True


def _check_head(task: str, config: PretrainedConfig, field: str, errors: list[FieldError]) -> None:
    cls = MODEL_CLASSES[task]
    if type(config) not in cls._model_mapping:
        errors.append(
            FieldError(field, f"a {config.model_type!r} model has no {cls.__name__} class for {task}", "wrong_head")
        )


def _check_pretrained(spec: JobSpec, errors: list[FieldError], report: dict[str, str]) -> None:
    assert spec.model.name_or_path is not None
    model = _Source(spec.model.name_or_path, spec.model.revision, "model.name_or_path", errors)
    if not model.exists():
        return
    report["model"] = model.kind
    config_file = model.find(("config.json",))
    if config_file is None:
        if model.kind != "hub":
            model.fail(f"{model.source} holds no config.json")
        return
    try:
        config = AutoConfig.from_pretrained(str(config_file.parent))
    except (ValueError, OSError, KeyError) as exc:
        model.fail(f"its config.json cannot be read: {str(exc).splitlines()[0]}")
        return
    _check_head(spec.task, config, model.field, errors)
    if model.find(WEIGHT_FILES) is None:
        model.fail(f"{model.source} holds no weights (one of {', '.join(WEIGHT_FILES)})")


def _check_processor(spec: JobSpec, errors: list[FieldError], report: dict[str, str]) -> None:
    own = spec.model.tokenizer if spec.task in TEXT_TASKS else spec.model.processor
    kind = "tokenizer" if spec.task in TEXT_TASKS else "processor"
    source = own or spec.model.name_or_path
    if source is None:
        return  # config-built: a tokenizer is trained, a default processor is made
    field = f"model.{kind}" if own else "model.name_or_path"
    where = _Source(source, None if own else spec.model.revision, field, errors)
    if not where.exists():
        return
    files = TOKENIZER_FILES if kind == "tokenizer" else PROCESSOR_FILES
    if where.kind != "hub" and where.find(files) is None:
        where.fail(f"{source} holds no {kind} files (one of {', '.join(files)})")
    report[kind] = where.kind


def check_model_sources(spec: JobSpec, report: dict[str, str], checks: list[str]) -> list[FieldError]:
    """Every problem with the spec's model, tokenizer and processor locations, as field errors."""
    errors: list[FieldError] = []
    if spec.model.config is not None:
        try:
            config = config_from_dict(spec.model.config)
        except (ValueError, KeyError, TypeError) as exc:
            return [FieldError("model.config", f"not a usable config: {str(exc).splitlines()[0]}")]
        _check_head(spec.task, config, "model.config.model_type", errors)
        report["model"] = "config"
    else:
        _check_pretrained(spec, errors, report)
    if not errors:
        _check_processor(spec, errors, report)
    checks.append("model")
    return errors
