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
- whatever ``TRAINJOBS_RUN_ENV_EXTRA`` names (comma-separated; ``NAME`` or ``PREFIX*``), for an
  operator's own additions such as a tracker's key.

The service's secrets are refused even when an allow rule (or the extra list) would match them.
"""

from __future__ import annotations

from collections.abc import Mapping

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


def _extra_rules(value: str) -> tuple[frozenset[str], tuple[str, ...]]:
    items = [item.strip() for item in value.split(",") if item.strip()]
    names = frozenset(item for item in items if not item.endswith("*"))
    prefixes = tuple(item[:-1] for item in items if item.endswith("*") and len(item) > 1)
    return names, prefixes


def run_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The allowed part of ``environ`` (the worker's environment) for a training run."""
    extra_names, extra_prefixes = _extra_rules(environ.get(EXTRA_VAR, ""))
    names = ALLOWED_NAMES | extra_names
    prefixes = ALLOWED_PREFIXES + extra_prefixes
    return {
        key: value
        for key, value in environ.items()
        if key not in SECRETS and (key in names or key.startswith(prefixes))
    }


def run_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """A run's whole environment: :func:`run_env` with unbuffered output (events must reach the slot
    as they happen). The fork server imports under exactly this, so both must come from here."""
    return {**run_env(environ), "PYTHONUNBUFFERED": "1"}
