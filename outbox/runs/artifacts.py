"""Content-addressed artifacts: big things a checkpoint refers to instead of containing.

Bytes are stored once under their sha256 digest (``INSERT ... ON CONFLICT DO NOTHING``);
the :class:`ArtifactRef` (or its :meth:`~ArtifactRef.to_json` form) goes in the checkpoint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert

from outbox.db.execution import Plan, SyncConn, run_plan
from outbox.db.tables import artifacts
from outbox.errors import ArtifactNotFound, ConfigurationError
from outbox.settings import OutboxSettings

_PREFIX = "sha256:"
REF_KEY = "$artifact"


@dataclass(frozen=True)
class ArtifactRef:
    """A reference to stored bytes, small enough for any checkpoint."""

    digest: str
    size: int
    media_type: str

    def to_json(self) -> dict[str, Any]:
        """The reference as checkpoint JSON."""
        return {REF_KEY: self.digest, "size": self.size, "media_type": self.media_type}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> ArtifactRef:
        """Read a reference written by :meth:`to_json`."""
        try:
            return cls(str(value[REF_KEY]), int(value["size"]), str(value["media_type"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigurationError(f"not an artifact reference: {value!r}") from exc


def digest_of(content: bytes) -> str:
    """``sha256:<hex>`` of *content*."""
    return _PREFIX + hashlib.sha256(content).hexdigest()


def store_plan(content: bytes, media_type: str) -> Plan[ArtifactRef]:
    if not isinstance(content, bytes | bytearray | memoryview):
        raise ConfigurationError("artifacts store bytes; encode text first")
    data = bytes(content)
    ref = ArtifactRef(digest_of(data), len(data), media_type)
    yield (
        pg_insert(artifacts)
        .values(digest=ref.digest, media_type=media_type, size=ref.size, content=data)
        .on_conflict_do_nothing(index_elements=[artifacts.c.digest])
    )
    return ref


def load_plan(ref: ArtifactRef | str) -> Plan[bytes]:
    digest = ref if isinstance(ref, str) else ref.digest
    rows = yield select(artifacts.c.content).where(artifacts.c.digest == digest)
    if not rows:
        raise ArtifactNotFound(digest)
    return bytes(rows[0]["content"])


def store_artifact(conn: SyncConn, content: bytes, *,
                   media_type: str = "application/octet-stream",
                   settings: OutboxSettings | None = None) -> ArtifactRef:
    """Store *content* once under its digest and return its reference; never commits."""
    return run_plan(conn, store_plan(content, media_type), settings)


def load_artifact(conn: SyncConn, ref: ArtifactRef | str, *,
                  settings: OutboxSettings | None = None) -> bytes:
    """The bytes behind *ref* (a reference or a ``sha256:`` digest)."""
    return run_plan(conn, load_plan(ref), settings)
