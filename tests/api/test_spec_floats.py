"""Every float field of the job spec is finite and within the range its schema documents, or the
request is a 422 naming the field (issue 31): ``1e400`` (JSON for infinity), ``Infinity`` and ``NaN``
were a 201, stored as null, and the run failed with OverflowError.

The fields are found in the spec's own JSON schema (the OpenAPI document's), so a float field added
later is covered without a change here: over HTTP each one is refused with every non-finite value and
just past each bound; a property test holds the rule for any float, and that what is accepted can be
stored and planned without overflowing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service_core.db.models import Job
from tests.api.conftest import Keys, make_spec
from trainer_core.backends.common import plan_steps, warmup_steps
from trainer_core.optimizers import OPTIMIZER_TABLE
from trainer_core.spec import JobSpec, SpecError, parse_spec

pytestmark = pytest.mark.both_databases

NON_FINITE = ["1e400", "-1e400", "Infinity", "-Infinity", "NaN"]  # as JSON text: 1e400 parses as infinity
PLACEHOLDER = "@float@"


def _walk(schema: dict[str, Any], defs: dict[str, Any], prefix: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, prop in schema.get("properties", {}).items():
        for option in prop.get("anyOf", [prop]):
            if "$ref" in option:
                yield from _walk(defs[option["$ref"].rsplit("/", 1)[1]], defs, f"{prefix}{name}.")
            elif option.get("type") == "number":
                yield f"{prefix}{name}", option


def float_fields() -> dict[str, dict[str, Any]]:
    """Every float field of the spec, by dotted path, with its JSON schema (its documented range)."""
    schema = JobSpec.model_json_schema()
    return dict(_walk(schema, schema["$defs"], ""))


FLOAT_FIELDS = float_fields()


def spec_with(field: str, value: Any) -> dict[str, Any]:
    """A valid spec in which ``field`` applies (its optimizer, an adapter, a DPO job), set to ``value``."""
    spec = make_spec()
    section, name = field.split(".")
    if section == "optimizer":
        spec["optimizer"] = {"name": next(n for n, e in OPTIMIZER_TABLE.items() if name in e.fields)}
    if section == "adapter":
        spec["adapter"] = {"type": "lora"}
    if section == "preference":
        spec.update(task="causal-lm", method="dpo")
    spec.setdefault(section, {})[name] = value
    return spec


def in_range(value: float, schema: dict[str, Any]) -> bool:
    return (
        math.isfinite(value)
        and value >= schema.get("minimum", -math.inf)
        and value > schema.get("exclusiveMinimum", -math.inf)
        and value <= schema.get("maximum", math.inf)
        and value < schema.get("exclusiveMaximum", math.inf)
    )


def beyond_bounds(schema: dict[str, Any]) -> list[float]:
    """Finite values just outside each documented bound."""
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    return [math.nextafter(low, -math.inf) if "minimum" in schema else low,
            math.nextafter(high, math.inf) if "maximum" in schema else high]  # fmt: skip


def test_the_spec_has_float_fields_and_each_documents_a_finite_range() -> None:
    assert {"training.num_train_epochs", "training.learning_rate", "adapter.alpha"} <= set(FLOAT_FIELDS)
    unbounded = [f for f, s in FLOAT_FIELDS.items() if not ({"minimum", "exclusiveMinimum"} & set(s))
                 or not ({"maximum", "exclusiveMaximum"} & set(s))]  # fmt: skip
    assert unbounded == [], "float fields without a documented lower and upper bound"


@pytest.mark.parametrize("field", list(FLOAT_FIELDS))
def test_non_finite_and_out_of_range_floats_are_422_naming_the_field(
    client: TestClient, keys: Keys, session: Session, field: str
) -> None:
    headers = {**keys.auth(keys.alice), "Content-Type": "application/json"}
    template = json.dumps(spec_with(field, PLACEHOLDER))
    values = NON_FINITE + [repr(v) for v in beyond_bounds(FLOAT_FIELDS[field])]
    for text in values:
        body = template.replace(f'"{PLACEHOLDER}"', text)
        for query in ("", "?dry_run=true"):
            response = client.post(f"/v1/jobs{query}", content=body, headers=headers)
            assert response.status_code == 422, (field, text, query, response.text)
            assert response.headers["content-type"] == "application/problem+json"
            assert [e["field"] for e in response.json()["errors"]] == [field], (text, response.text)
    estimate = json.dumps({"spec": spec_with(field, PLACEHOLDER)}).replace(f'"{PLACEHOLDER}"', "1e400")
    answer = client.post("/v1/estimates/memory", content=estimate, headers=headers)
    assert answer.status_code == 422 and [e["field"] for e in answer.json()["errors"]] == [f"spec.{field}"]
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0


def test_infinite_numbers_in_a_free_form_config_are_422_too(client: TestClient, keys: Keys) -> None:
    spec = make_spec()
    spec["model"]["config"]["hidden_dropout_prob"] = PLACEHOLDER
    body = json.dumps(spec).replace(f'"{PLACEHOLDER}"', "Infinity")
    headers = {**keys.auth(keys.alice), "Content-Type": "application/json"}
    response = client.post("/v1/jobs", content=body, headers=headers)
    assert response.status_code == 422, response.text
    assert [e["field"] for e in response.json()["errors"]] == ["model.config.hidden_dropout_prob"]


@settings(max_examples=1500, deadline=None, derandomize=True)
@given(
    field=st.sampled_from(sorted(FLOAT_FIELDS)),
    value=st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0.0, -0.0, 1.0, 1e-300, 5e-324, 1e308, 1e5, 1e6, 600.0, 4096.0, 65536.0]),
)
def test_any_float_is_accepted_exactly_when_finite_and_in_its_documented_range(field: str, value: float) -> None:
    schema = FLOAT_FIELDS[field]
    try:
        spec = parse_spec(spec_with(field, value))
    except SpecError as exc:
        assert not in_range(value, schema), (field, value, exc)
        assert [e.field for e in exc.errors] == [field]
        return
    assert in_range(value, schema), (field, value)
    # What is accepted is stored as the number it is (never null) and plans without overflowing.
    stored = json.loads(json.dumps(spec.model_dump(mode="json"), allow_nan=False))
    section, name = field.split(".")
    assert stored[section][name] == value
    plan = plan_steps(spec, batches_per_epoch=10**9)
    assert plan.total_steps >= 1 and warmup_steps(spec, plan.total_steps) >= 0
