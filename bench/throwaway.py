"""The services a benchmark runs against: the ones given, or a throwaway pair started here."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def services(args: argparse.Namespace, name: str,
             log: Callable[[str], None]) -> Iterator[tuple[str, str]]:
    """``--database-url``/``--kafka-bootstrap`` if both are given, else a PostgreSQL and a
    Kafka in ``--state-dir`` (default ``/tmp/<name>-<pid>``), stopped at the end."""
    if args.database_url and args.kafka_bootstrap:
        yield args.database_url, args.kafka_bootstrap
        return
    if args.database_url or args.kafka_bootstrap:
        raise SystemExit("give both --database-url and --kafka-bootstrap, or neither")
    from outbox.testing.services import LocalServices  # noqa: PLC0415

    state = Path(args.state_dir or f"/tmp/{name}-{os.getpid()}")  # noqa: S108
    local = LocalServices(state)
    log(f"starting a throwaway PostgreSQL and Kafka in {state}")
    try:
        endpoints = local.up()
        yield endpoints.database_url, endpoints.kafka_bootstrap
    finally:
        local.down()  # before logging: a closed stdout/stderr must not leave them running
        if not args.state_dir:
            shutil.rmtree(state, ignore_errors=True)
        log("stopped the throwaway services")
