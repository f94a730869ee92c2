"""The saga's processes, each a separate OS process (workers, relays, consumers), against one
database and broker and the three systems at *urls*: for the crash test and the fault
harness (:mod:`examples.supplier_order.pipeline` starts and kills them)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from kafka.admin import KafkaAdminClient, NewTopic

from examples.saga import SYSTEMS
from examples.supplier_order.pipeline import Pipeline

COMMANDS = {
    "worker": ["-m", "outbox.cli.main", "worker", "examples.saga.workflow:app"],
    "relay": ["-m", "relay"],
    "consumer": ["-m", "consumers", "examples.saga.consumer:app"],
}


def start(*, database_url: str, bootstrap: str, workdir: Path, urls: Mapping[str, str],
          processes: Sequence[tuple[str, str]], partitions: int = 3,
          env: Mapping[str, str] | None = None) -> Pipeline:
    """Fresh topics (one per system), then *processes* ((kind, name) of :data:`COMMANDS`),
    with short leases so that a killed worker's run is taken over in seconds; *env* is
    given to every process."""
    prefix = f"checkout-{uuid.uuid4().hex[:8]}"
    p = Pipeline(database_url=database_url, bootstrap=bootstrap, topic=prefix,
                 group=f"{prefix}-effects", workdir=workdir, commands=COMMANDS)
    urls_env = {f"OUTBOXKIT_EXAMPLE_{name.upper()}_URL": url for name, url in urls.items()}
    for kind in COMMANDS:
        p.overrides[kind] = {**urls_env, "OUTBOXKIT_WORKER_LEASE_SECONDS": "3",
                             "OUTBOXKIT_WORKER_POLL_SECONDS": "1", **(env or {})}
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:  # created up front: the consumers then join with every partition known
        admin.create_topics([NewTopic(f"{prefix}.{name}", partitions, 1) for name in SYSTEMS])
    finally:
        admin.close()
    for kind, name in processes:
        p.start(kind, name)
    return p
