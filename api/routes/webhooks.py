"""``/v1/webhooks``: an owner's signed webhooks, their deliveries, and redelivery.

Another owner's webhook is a 404, as everywhere; an admin sees every owner's. The secret is shown
when a webhook is created and when it is rotated, never in a list. Deliveries are written by the job
store with the events themselves (service_core/webhooks.py) and sent by the workers
(worker/webhook_sender.py); a redelivery is a new delivery of the same payload.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response, status
from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from api.deps import CallerDep, SessionDep, SettingsDep
from api.problems import Problem, validation_problem
from api.schemas.common import problem_responses
from api.schemas.webhooks import DeliveryList, DeliveryOut, WebhookCreate, WebhookCreated, WebhookList, WebhookOut
from service_core.db.base import utcnow
from service_core.db.models import Webhook, WebhookDelivery
from service_core.keys import Caller
from service_core.webhooks import new_delivery, new_secret, url_problem
from trainer_core.spec import FieldError

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"], responses=problem_responses(401, 404, 422))


def owned_webhook(session: Session, webhook_id: str, caller: Caller) -> Webhook:
    """The webhook if the caller may see it; another owner's is a 404 like a missing one."""
    row = session.get(Webhook, webhook_id)
    if row is None or not (caller.is_admin or row.owner == caller.owner):
        raise Problem(404, f"no webhook {webhook_id!r}")
    return row


@router.post("", status_code=status.HTTP_201_CREATED, response_model=WebhookCreated)
def create_webhook(
    body: WebhookCreate, session: SessionDep, settings: SettingsDep, caller: CallerDep
) -> WebhookCreated:
    """Create a webhook for the caller's jobs; the answer holds its signing secret, shown this once."""
    if problem := url_problem(body.url, allow_private=settings.allow_private_targets):
        raise validation_problem([FieldError("url", problem, "url")])
    events = list(dict.fromkeys(body.events))  # each once, in the order given
    row = Webhook(owner=caller.owner, url=body.url, events=events, description=body.description, secret=new_secret(),
                  enabled=True, created_at=utcnow())  # fmt: skip
    session.add(row)
    session.commit()
    return WebhookCreated(**WebhookOut.from_row(row).model_dump(), secret=row.secret)


@router.get("", response_model=WebhookList)
def list_webhooks(session: SessionDep, caller: CallerDep) -> WebhookList:
    """The caller's webhooks (an admin's: every owner's), newest first."""
    query = select(Webhook).order_by(Webhook.created_at.desc(), Webhook.id.desc())
    if not caller.is_admin:
        query = query.where(Webhook.owner == caller.owner)
    return WebhookList(items=[WebhookOut.from_row(row) for row in session.execute(query).scalars()])


@router.get("/{webhook_id}", response_model=WebhookOut)
def get_webhook(webhook_id: str, session: SessionDep, caller: CallerDep) -> WebhookOut:
    return WebhookOut.from_row(owned_webhook(session, webhook_id, caller))


@router.delete("/{webhook_id}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response)
def delete_webhook(webhook_id: str, session: SessionDep, caller: CallerDep) -> Response:
    """Delete a webhook and its deliveries (pending ones are never sent)."""
    session.delete(owned_webhook(session, webhook_id, caller))
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/{webhook_id}/rotate-secret", response_model=WebhookCreated)
def rotate_secret(webhook_id: str, session: SessionDep, caller: CallerDep) -> WebhookCreated:
    """A new signing secret, shown this once; every attempt from now on is signed with it."""
    row = owned_webhook(session, webhook_id, caller)
    row.secret = new_secret()
    session.commit()
    return WebhookCreated(**WebhookOut.from_row(row).model_dump(), secret=row.secret)


@router.get("/{webhook_id}/deliveries", response_model=DeliveryList)
def list_deliveries(
    webhook_id: str, session: SessionDep, caller: CallerDep, limit: Annotated[int, Query(ge=1, le=500)] = 50
) -> DeliveryList:
    """The webhook's newest deliveries, newest first, with every attempt."""
    owned_webhook(session, webhook_id, caller)
    rows = session.execute(
        select(WebhookDelivery)
        .where(WebhookDelivery.webhook_id == webhook_id)
        .order_by(WebhookDelivery.created_at.desc(), WebhookDelivery.seq.desc(), WebhookDelivery.id.desc())
        .limit(limit)
    ).scalars()
    return DeliveryList(items=[DeliveryOut.from_row(row) for row in rows])


@router.post(
    "/{webhook_id}/deliveries/{delivery_id}/redeliver",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=DeliveryOut,
    responses=problem_responses(409),
)
def redeliver(webhook_id: str, delivery_id: str, session: SessionDep, caller: CallerDep) -> DeliveryOut:
    """Send a delivery's payload again, as a new delivery with attempts of its own."""
    hook = owned_webhook(session, webhook_id, caller)
    old = session.get(WebhookDelivery, delivery_id)
    if old is None or old.webhook_id != hook.id:
        raise Problem(404, f"no delivery {delivery_id!r} of webhook {webhook_id!r}")
    if not hook.enabled:
        raise Problem(409, f"webhook {hook.id} is disabled: {hook.disabled_reason}")
    values = new_delivery(hook.id, old.job_id, old.seq, old.event_type, old.payload, utcnow())
    session.execute(insert(WebhookDelivery), [values])
    session.commit()
    fresh = session.get(WebhookDelivery, values["id"])
    assert fresh is not None
    return DeliveryOut.from_row(fresh)
