"""The environment a training run gets: an allow-list, never the service's own secrets.

A run executes a user's spec (a model's code paths, a dataset's loader) with the worker's user id,
so anything in its environment is readable from ``/proc/<pid>/environ`` and by the code it runs.
The worker's environment holds ``TRAINJOBS_SECRET_KEY``, the admin ``TRAINJOBS_API_KEY``,
``DATABASE_URL`` and ``BROKER_URL`` (with passwords); none of them may reach a run. So a run gets
only what the training stack reads:

- names: ``PATH``, ``HOME``, ``USER``, ``LOGNAME``, ``LANG``, ``LANGUAGE``, ``TZ``, ``TMPDIR``,
  ``TEMP``, ``TMP``, ``LD_LIBRARY_PATH``, ``VIRTUAL_ENV``, ``SSL_CERT_FILE``, ``SSL_CERT_DIR``,
  ``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE``, ``HTTP(S)_PROXY``/``NO_PROXY`` (either case);
- prefixes: ``LC_``, ``PYTHON``, ``HF_``, ``HUGGINGFACE_``, ``TRANSFORMERS_``, ``TOKENIZERS_``,
  ``ACCELERATE_``, ``CUDA_``, ``NVIDIA_``, ``NCCL_``, ``TORCH_``, ``TORCHINDUCTOR_``, ``PYTORCH_``,
  ``OMP_``, ``MKL_``, ``KMP_``, ``XDG_``, the estimator's ``TRAINJOBS_MEMORY_OVERHEAD_`` and the
  ``TRAINJOBS_FAULT_`` testing aids;
- a tracker's settings and credentials, only for a run whose spec names that tracker in
  ``training.report_to`` (:data:`TRACKER_VARS`: ``WANDB_API_KEY``, ``WANDB_MODE``, ``WANDB_DIR``,
  ``WANDB_BASE_URL``; ``MLFLOW_TRACKING_URI``, ``MLFLOW_TRACKING_USERNAME``, ``MLFLOW_TRACKING_PASSWORD``,
  ``MLFLOW_TRACKING_TOKEN``). A spec never carries a key: these are the operator's;
- whatever ``TRAINJOBS_RUN_ENV_EXTRA`` names (comma-separated; ``NAME`` or ``PREFIX*``), for an
  operator's own additions.

The service's secrets are refused even when an allow rule (or the extra list) would match them.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path

ALLOWED_NAMES = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TEMP", "TMP",
        "LD_LIBRARY_PATH", "VIRTUAL_ENV", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    }
)  # fmt: skip
ALLOWED_PREFIXES = (
    "LC_", "PYTHON", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "ACCELERATE_",
    "CUDA_", "NVIDIA_", "NCCL_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "OMP_", "MKL_", "KMP_", "XDG_",
    "TRAINJOBS_MEMORY_OVERHEAD_", "TRAINJOBS_FAULT_",
)  # fmt: skip
# The service's credentials: never passed on, whatever the rules above or the extra list say.
SECRETS = frozenset({"TRAINJOBS_SECRET_KEY", "TRAINJOBS_API_KEY", "DATABASE_URL", "BROKER_URL"})
EXTRA_VAR = "TRAINJOBS_RUN_ENV_EXTRA"
# report_to name -> what its run needs from the worker's environment (trainer_core/trackers.py reads them)
TRACKER_VARS: dict[str, frozenset[str]] = {
    "wandb": frozenset({"WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_BASE_URL"}),
    "mlflow": frozenset(
        {"MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"}
    ),
}


def _extra_rules(value: str) -> tuple[frozenset[str], tuple[str, ...]]:
    items = [item.strip() for item in value.split(",") if item.strip()]
    names = frozenset(item for item in items if not item.endswith("*"))
    prefixes = tuple(item[:-1] for item in items if item.endswith("*") and len(item) > 1)
    return names, prefixes


def run_env(environ: Mapping[str, str], trackers: Collection[str] = ()) -> dict[str, str]:
    """The allowed part of ``environ`` (the worker's environment) for a training run that reports to
    ``trackers`` (its spec's ``training.report_to``)."""
    extra_names, extra_prefixes = _extra_rules(environ.get(EXTRA_VAR, ""))
    names = ALLOWED_NAMES | extra_names
    for tracker in trackers:
        names |= TRACKER_VARS.get(tracker, frozenset())
    prefixes = ALLOWED_PREFIXES + extra_prefixes
    return {
        key: value
        for key, value in environ.items()
        if key not in SECRETS and (key in names or key.startswith(prefixes))
    }


def run_environment(environ: Mapping[str, str], trackers: Collection[str] = ()) -> dict[str, str]:
    """A run's whole environment: :func:`run_env` with unbuffered output (events must reach the slot
    as they happen). The fork server imports under exactly this, so both must come from here (a run
    with a tracker's variables differs from the server's, so it starts in a fresh interpreter)."""
    return {**run_env(environ, trackers), "PYTHONUNBUFFERED": "1"}


def spec_trackers(spec_file: Path) -> list[str]:
    """``training.report_to`` of the spec the run will train (the API validated it when it was stored)."""
    spec = json.loads(spec_file.read_text(encoding="utf-8"))
    return [str(t) for t in (spec.get("training") or {}).get("report_to") or []]
