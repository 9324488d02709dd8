"""The ``integrations`` section of the job spec: where a run's W&B and MLflow mirrors go.

Kept apart from :mod:`trainer_core.spec` like the adapter section: the spec imports it. Which trackers
are on is said once, by ``training.report_to``; a section here only configures one of them, and a
section for a tracker ``report_to`` does not name is refused (JobSpec), never silently ignored.
Credentials never come from a spec: they are the worker's (worker/run_env.py). The run's side is
:mod:`trainer_core.trackers`.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field

from trainer_core.net_guard import host_problem
from trainer_core.spec_base import StrictModel

# The schemes a spec's tracking URI may use: a remote server. A local store (file:, sqlite:, a bare
# path) would write wherever the worker's process points; a run without a URI logs under its own
# output directory instead (trainer_core/trackers.py), and an operator's MLFLOW_TRACKING_URI may be anything.
TRACKING_URI_SCHEMES = ("http", "https")


class WandbSpec(StrictModel):
    """A Weights & Biases run: the spec becomes its config; the key is the worker's ``WANDB_API_KEY``."""

    project: str | None = Field(default=None, min_length=1, max_length=128, description="Default: the job's name.")
    entity: str | None = Field(default=None, min_length=1, max_length=128, description="Default: the key's own.")
    name: str | None = Field(default=None, min_length=1, max_length=128, description="Default: the job's name.")
    tags: list[str] = Field(default_factory=list, max_length=64)


class MlflowSpec(StrictModel):
    """An MLflow run: the spec (flattened) as params, every metric point, the final model if asked."""

    tracking_uri: str | None = Field(
        default=None, min_length=1, max_length=2048,
        description="An http(s) MLflow server on a public host. Default: the worker's MLFLOW_TRACKING_URI, else a "
        "store in the job's output directory (`mlruns/`).",
    )  # fmt: skip
    experiment: str | None = Field(default=None, min_length=1, max_length=256, description="Default: the job's name.")
    log_model: bool = Field(default=False, description="Upload the final model (or adapter) as the run's artifacts.")


class IntegrationsSpec(StrictModel):
    wandb: WandbSpec | None = None
    mlflow: MlflowSpec | None = None


def tracking_uri_problem(uri: str, *, allow_private: bool) -> str | None:
    """Why a spec's MLflow ``tracking_uri`` must not be used, or None. The API checks it at submit,
    with the data URLs' public-address rule (trainer_core/net_guard.py) unless ``allow_private``."""
    parts = urlsplit(uri)
    if parts.scheme not in TRACKING_URI_SCHEMES:
        return "must be an http(s) URL of an MLflow server"
    if allow_private:
        return None
    problem = host_problem(parts.hostname or "")
    return f"host {problem}" if problem else None
