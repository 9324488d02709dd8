"""Idempotent submits: an ``Idempotency-Key`` header on ``POST /v1/jobs`` and ``POST /v1/datasets``.

A client whose submit got no answer (a connection reset, the API killed right after its INSERT) cannot
tell whether the job exists; sending the request again without a key makes a second job. With a key,
the same key from the same owner within :data:`IDEMPOTENCY_TTL` returns the first answer (marked
``Idempotent-Replayed: true``) and creates nothing; the same key with another request is a 422 naming
the header. Another owner's key of the same text is another key.

The first answer is stored in the transaction that stores what the submit created (:meth:`Idempotency.record`),
so no moment exists where the job is stored and its key is not: a retry after the API died past its
commit finds the answer. Only creations are stored: a refused submit created nothing, and its retry
is checked afresh. Of two requests racing with one key, the later one's transaction fails on the key
and rolls back what it created (:class:`KeyTaken`), and it answers with the earlier one's answer.
An owner's expired keys are deleted by that owner's next keyed submit, so the table keeps about a
day of keyed submits.

Testing aid: ``TRAINJOBS_FAULT_API_EXIT_AFTER_INSERT=1`` in the API's environment makes the API process
exit (status 70, no answer) right after a submit's transaction commits, before it answers or enqueues,
the moment a client's retry must not create a second job. Unset, :func:`exit_if_asked` does nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Any

from fastapi import Header
from fastapi.responses import JSONResponse
from sqlalchemy import Connection, Table, delete, insert, select
from sqlalchemy.exc import IntegrityError

from api.problems import Problem, validation_problem
from service_core.db.base import as_utc, utcnow
from service_core.db.models import IdempotencyKey
from trainer_core.spec import FieldError

log = logging.getLogger(__name__)

IDEMPOTENCY_TTL = timedelta(hours=24)
KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
FAULT_EXIT_ENV = "TRAINJOBS_FAULT_API_EXIT_AFTER_INSERT"
FAULT_EXIT_STATUS = 70  # EX_SOFTWARE: the testing aid, not a crash
_TABLE: Table = IdempotencyKey.__table__  # type: ignore[assignment]

# Visible ASCII: what every HTTP stack carries unchanged (a UUID is the usual choice).
KEY_PATTERN = r"^[\x21-\x7e]{1,255}$"

IdempotencyKeyHeader = Annotated[
    str | None,
    Header(
        alias=KEY_HEADER,
        pattern=KEY_PATTERN,
        description="Makes the submit safe to retry: the same key from the same owner within 24 h returns the "
        "first answer (with `Idempotent-Replayed: true`) and creates nothing; with another body it is a 422.",
    ),
]


class KeyTaken(Exception):
    """Another request stored an answer under this key first (the caller's transaction rolls back)."""


def fingerprint(method: str, path: str, body: Any) -> str:
    """What makes two requests the same request: method, path and body (keys in a fixed order)."""
    text = json.dumps([method, path, body], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Idempotency:
    """One owner's key of one submit."""

    owner: str
    key: str

    @classmethod
    def of(cls, owner: str, key: str | None) -> Idempotency | None:
        return None if key is None else cls(owner, key)

    def answer(self, conn: Connection, request: Callable[[], str]) -> JSONResponse | None:
        """The first answer stored under this key within the TTL, or None; a 422 when it answered another
        request. ``request`` gives this request's fingerprint, asked only when there is one to compare
        (an upload's costs a pass over the file)."""
        row = conn.execute(select(_TABLE).where(_TABLE.c.owner == self.owner, _TABLE.c.key == self.key)).first()
        if row is None or as_utc(row.created_at) < utcnow() - IDEMPOTENCY_TTL:
            return None
        if request() != row.fingerprint:
            raise self.reused()
        stored = dict(row.response)
        headers = {**stored.get("headers", {}), REPLAYED_HEADER: "true"}
        return JSONResponse(stored["body"], status_code=row.status_code, headers=headers)

    def reused(self) -> Problem:
        message = "this key was used with another request in the last 24 hours; use a new key for a new submit"
        return validation_problem([FieldError(KEY_HEADER, message, "idempotency_key_reused")])

    def record(
        self, conn: Connection, request: str, status_code: int, body: Any, headers: dict[str, str] | None = None
    ) -> None:
        """Store the answer in ``conn``'s transaction (the one that stores what the submit created);
        :class:`KeyTaken` when a live answer is there already."""
        conn.execute(
            delete(_TABLE).where(_TABLE.c.owner == self.owner, _TABLE.c.created_at < utcnow() - IDEMPOTENCY_TTL)
        )
        row = {"body": body, "headers": headers or {}}
        values = {"owner": self.owner, "key": self.key, "fingerprint": request, "status_code": status_code}
        try:
            conn.execute(insert(_TABLE).values(**values, response=row, created_at=utcnow()))
        except IntegrityError as exc:
            raise KeyTaken(self.key) from exc

    def after_race(self, conn: Connection, request: str) -> JSONResponse:
        """The answer of the request that took this key first (see :class:`KeyTaken`)."""
        answer = self.answer(conn, lambda: request)
        if answer is None:  # its row expired in between: nothing to replay, nothing was stored for this one
            raise Problem(409, "another request with this Idempotency-Key was answered meanwhile; send it again")
        return answer

    def forget(self, conn: Connection) -> None:
        """Drop the stored answer: what it named did not happen after all (the queue refused the job)."""
        conn.execute(delete(_TABLE).where(_TABLE.c.owner == self.owner, _TABLE.c.key == self.key))


def exit_if_asked() -> None:
    """The testing aid of the module docstring: exit the API process at once when it is set."""
    if os.environ.get(FAULT_EXIT_ENV) == "1":
        log.warning("%s is set: the API exits after the submit's commit, before answering", FAULT_EXIT_ENV)
        os._exit(FAULT_EXIT_STATUS)
