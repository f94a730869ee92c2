"""A process killed between sending an order and recording its outcome (separate OS
processes: the supplier, the worker that dies, and this test as the reconciler)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from dedup.ledger import Ledger, OperationStatus
from examples.supplier_client import SupplierClient
from tests.integration.operations_support import fast_policy, trail

LEDGER = Ledger()

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def supplier_process() -> Iterator[SupplierClient]:
    """``python examples/supplier.py --port 0`` as its own process, stopped by its pid."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "supplier.py"), "--port", "0"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("supplier listening on "), line
        yield SupplierClient(line.split()[-1], timeout=2.0)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_killed_after_sending_leaves_pending_and_reconciling_confirms_without_a_second_call(
    engine: Engine, database_url: str, supplier_process: SupplierClient
) -> None:
    client = supplier_process
    worker = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "integration" / "operations_crash_worker.py"),
         database_url, client.base_url, "m-crash"],
        capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
    )
    assert worker.returncode == -signal.SIGKILL, worker.stdout + worker.stderr
    assert "sent place-order:m-crash: Applied" in worker.stdout

    key = LEDGER.idempotency_key("m-crash", "place-order")
    with engine.connect() as conn:
        op = LEDGER.get_operation(conn, key=key)
    # The intent survived the crash; the outcome was never recorded.
    assert op.status is OperationStatus.PENDING
    assert trail(engine, op) == [("intent", "pending")]
    assert client.posts() == {key: 1}

    # Within the worker's in-flight grace (0.5 s) the reconciler leaves it alone; after it,
    # "pending" means "we may have sent it": ask the supplier.
    deadline = time.monotonic() + 20
    while LEDGER.reconcile_due(engine, [client.system()], policy=fast_policy()).claimed == 0:
        assert time.monotonic() < deadline, "the pending operation never became due"
        time.sleep(0.1)

    with engine.connect() as conn:
        settled = LEDGER.get_operation(conn, key=key)
    assert settled.status is OperationStatus.CONFIRMED
    assert settled.calls == 1
    assert trail(engine, op) == [("intent", "pending"), ("check", "confirmed")]
    [order] = client.all_orders()
    assert order["order_id"] == settled.reference
    assert client.posts() == {key: 1}  # the call was not repeated
