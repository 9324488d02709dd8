"""Uploaded datasets and job artifacts as the API shows them."""

from __future__ import annotations

from pydantic import BaseModel, Field

from api.schemas.common import UtcDatetime
from service_core.db.models import Dataset


class DatasetOut(BaseModel):
    id: str
    owner: str
    name: str
    format: str = Field(description="The `datasets` builder jobs use: csv, json, parquet, imagefolder, audiofolder.")
    content_hash: str = Field(description="sha256 of the uploaded bytes.")
    size_bytes: int
    created_at: UtcDatetime

    @classmethod
    def from_row(cls, row: Dataset) -> DatasetOut:
        return cls(
            id=row.id,
            owner=row.owner,
            name=row.name,
            format=row.format,
            content_hash=row.content_hash,
            size_bytes=row.size_bytes,
            created_at=row.created_at,
        )


class DatasetList(BaseModel):
    items: list[DatasetOut]


class ArtifactOut(BaseModel):
    path: str = Field(description="Relative to the job; download at `/v1/jobs/{id}/artifacts/{path}`.")
    size: int


class ArtifactList(BaseModel):
    items: list[ArtifactOut]
