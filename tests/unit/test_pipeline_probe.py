"""The example's probe of a consumer's HTTP port survives a consumer killed mid-answer."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from examples.supplier_order.pipeline import Pipeline, Proc


@pytest.fixture
def cut_short() -> Iterator[int]:
    """A port whose server promises 3,372 bytes of /metrics, sends none and closes."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 3372\r\n\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        thread.join(5)
        server.close()


def test_an_answer_cut_short_reads_as_no_answer(cut_short: int, tmp_path: Path) -> None:
    pipeline = Pipeline(database_url="", bootstrap="", topic="t", group="g", workdir=tmp_path)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with (tmp_path / "log").open("wb") as log:
            pipeline.procs["consumer-1"] = Proc("consumer-1", "consumer", alive, log, cut_short)
            assert pipeline.metric("consumer-1", "outboxkit_consumer_duplicates_total") is None
    finally:
        alive.kill()
        alive.wait(10)
