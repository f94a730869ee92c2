"""A consumer whose Kafka client is alive but no longer works is noticed and rebuilt.

The stall is forced with a failpoint in a separate consumer process (the real one,
librdkafka #5153, a client that never rejoins its group after a broker outage, happens
about once in ten outages and cannot be ordered): ``consumer.leave_group`` makes the
client leave its group behind the loop's back; ``consumer.stuck_fetch`` makes its polls
return nothing while records wait. The process stays alive and its loop goes round;
only the watchdog can tell. Each test checks that ``/readyz`` said not-ready during the
stall, that the client was rebuilt, and that every message then had its effect once. With
the watchdog off (``watchdog_session_timeouts=0``) these tests fail: the messages produced
after the stall are never handled.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from tests.e2e.conftest import wait_until
from tests.e2e.consumer_support import (
    ConsumerProcesses,
    create_effects,
    effects,
    port,
    produce,
    scrape,
)

pytestmark = [pytest.mark.timeout(180)]
SESSION_S = 6  # the processes' session timeout (ConsumerProcesses)
SAMPLE_S = 0.01


@pytest.fixture
def procs(database_url: str, kafka_bootstrap: str, kafka_topic: Callable[..., str],
          tmp_path: Path, engine: Engine) -> Iterator[ConsumerProcesses]:
    create_effects(engine)
    made = ConsumerProcesses(database_url, kafka_bootstrap, kafka_topic(partitions=3), tmp_path)
    try:
        yield made
    finally:
        made.stop_all()


class Readiness:
    """Samples a process's /readyz every 10 ms in a thread: what it said, and when. (A rebuilt
    client that joins an empty group reads again within about 0.1 s: not-ready can be that
    short.)"""

    def __init__(self, http_port: int) -> None:
        self.url = f"http://127.0.0.1:{http_port}/readyz"
        self.seen: list[tuple[float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as reply:  # noqa: S310
                    ready = reply.status == 200
            except urllib.error.HTTPError:
                ready = False
            except OSError:
                continue  # not listening yet
            self.seen.append((time.monotonic(), ready))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def unready_s(self) -> float:
        """How long it said not-ready after having said ready (samples times the interval)."""
        said = [ready for _, ready in self.seen]
        first = said.index(True) if True in said else len(said)
        return SAMPLE_S * sum(1 for ready in said[first:] if not ready)

    def went_unready_and_back(self) -> bool:
        """Ready, then not ready, then ready again (the first answers, before the process
        is ready, do not count)."""
        said = [ready for _, ready in self.seen]
        first = said.index(True) if True in said else len(said)
        rest = said[first:]
        down = rest.index(False) if False in rest else len(rest)
        return True in rest[down:]


def _wait(predicate: Callable[[], bool], timeout: float, what: str,
          procs: ConsumerProcesses) -> None:
    try:
        wait_until(predicate, timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{procs.logs()[-6000:]}") from None


def _stall_then_recover(procs: ConsumerProcesses, engine: Engine, kafka_bootstrap: str,
                        failpoint: str, **env: str) -> None:
    http_port = port()
    # The Nth turn of the loop (about 5 a second when idle): usually after the first wave is
    # done (if not, the first wave waits for the rebuild too, and the checks still hold).
    procs.start(http_port=http_port, OUTBOXKIT_FAILPOINTS=f"{failpoint}=raise@30", **env)
    readiness = Readiness(http_port)
    try:
        first = produce(kafka_bootstrap, procs.topic, [{"n": i} for i in range(20)])
        _wait(lambda: len(effects(engine)) == 20, 60, "the first wave handled", procs)
        _wait(lambda: "failpoint: the Kafka client" in procs.logs(), 60,
              "the failpoint fired", procs)
        stalled_at = time.monotonic()
        second = produce(kafka_bootstrap, procs.topic, [{"n": i} for i in range(20, 40)])
        _wait(lambda: len(effects(engine)) == 40, 90,
              "the second wave handled after the rebuild", procs)
        recovered_s = time.monotonic() - stalled_at
        _wait(lambda: bool(readiness.seen) and readiness.seen[-1][1], 20, "ready again", procs)
    finally:
        readiness.stop()
    print(f"\n{failpoint}: the second wave handled {recovered_s:.1f} s after the stall "
          f"({recovered_s / SESSION_S:.1f} session timeouts); not ready for about "
          f"{readiness.unready_s():.1f} s")
    logs = procs.logs()
    assert "rebuilding it" in logs, logs
    assert "the Kafka client was rebuilt" in logs, logs
    assert scrape(http_port, "outboxkit_consumer_client_rebuilds_total") >= 1
    assert readiness.went_unready_and_back(), readiness.seen
    done = effects(engine)
    assert set(done) == set(first) | set(second)
    assert set(done.values()) == {1}  # no message's effect twice
    assert all(proc.poll() is None for proc in procs.procs)  # one process, never restarted


# Out of its group in batch mode with confluent (librdkafka #5153 is its client's), stuck
# fetches in per-message mode (where the rebuild lets the running handlers finish first)
# with kafka-python: between them, both rules, both loops and both clients. The other six
# pairs pass too (`make test` leaves them out for time: -k watchdog with the pairs below
# widened run them).
@pytest.mark.parametrize(("client", "failpoint", "mode"), [
    ("confluent", "consumer.leave_group", "batch"),
    ("kafka-python", "consumer.stuck_fetch", "per-message"),
])
def test_a_client_alive_but_not_working_is_rebuilt_and_reads_again(  # noqa: PLR0917
    procs: ConsumerProcesses, engine: Engine, kafka_bootstrap: str, client: str,
    failpoint: str, mode: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOXKIT_KAFKA_CLIENT", client)  # the consumer process inherits it
    _stall_then_recover(procs, engine, kafka_bootstrap, failpoint,
                        OUTBOXKIT_CONSUMER_MODE=mode)
