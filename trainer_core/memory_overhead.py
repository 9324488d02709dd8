"""The memory-overhead setting: one environment variable, in MiB, read by every estimate.

CUDA context, cuBLAS/cuDNN workspaces and allocator fragmentation are memory a job needs that
``torch.cuda.max_memory_allocated`` does not count; the estimator adds a constant for them. The API
reads the same variable through ``service_core.settings`` (which takes its name from here), so
``trainjobs estimate`` and ``POST /v1/estimates/memory`` agree. Standard library only: the service's
settings import it without loading torch.
"""

from __future__ import annotations

import os

OVERHEAD_ENV = "TRAINJOBS_MEMORY_OVERHEAD_MB"
DEFAULT_OVERHEAD_MB = 1024
MIB = 1024**2


def overhead_mb_to_bytes(megabytes: int) -> int:
    """``megabytes`` MiB in bytes: the one conversion the CLI and the API both use."""
    return megabytes * MIB


def overhead_bytes_from_env() -> int:
    """The overhead in bytes: ``TRAINJOBS_MEMORY_OVERHEAD_MB`` (MiB) if set, else 1 GiB."""
    value = os.environ.get(OVERHEAD_ENV, "").strip()
    if not value:
        return overhead_mb_to_bytes(DEFAULT_OVERHEAD_MB)
    try:
        megabytes = int(value)
    except ValueError:
        raise ValueError(f"{OVERHEAD_ENV} must be a whole number of MiB, not {value!r}") from None
    if megabytes < 0:
        raise ValueError(f"{OVERHEAD_ENV} must be >= 0, not {megabytes}")
    return overhead_mb_to_bytes(megabytes)
