"""The daemons' shared runtime: readiness, liveness, backoff, the health server, run_daemon."""

from __future__ import annotations

import logging
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from consumers import Consumer, Runner
from consumers.settings import ConsumerSettings
from outbox.backoff import Backoff
from outbox.cli.daemon import EXIT_CONFIG, EXIT_FAILED, run_daemon
from outbox.errors import ConfigurationError, OutboxError
from outbox.runtime import HealthServer, Lifecycle, MetricFamilies
from relay.daemon import Relay
from relay.settings import RelaySettings

log = logging.getLogger("tests.runtime")


def lifecycle(
    *, alive_while_starting: bool = False, base: float = 0.2
) -> tuple[Lifecycle, CollectorRegistry]:
    """A relay's lifecycle, and the registry holding its ready gauge."""
    families = MetricFamilies("test")
    life = Lifecycle("relay", "r1", log=log, ready_gauge=families.gauge("ready", "1 when ready"),
                     backoff=Backoff(base=base, cap=1.0), stuck_after_s=10.0,
                     alive_while_starting=alive_while_starting)
    return life, families.registry


class TestReadiness:
    def test_a_change_is_logged_once_with_its_cause_and_sets_the_gauge(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        life, registry = lifecycle()
        caplog.set_level(logging.INFO, logger="tests.runtime")
        life.set_ready(True)
        life.set_ready(True)
        life.set_ready(False, "claiming failed: refused")
        life.set_ready(False, "again")
        events = [(r.event, r.getMessage()) for r in caplog.records]  # type: ignore[attr-defined]
        assert events == [("relay.ready", "relay r1 is ready"),
                          ("relay.not_ready", "relay r1 is not ready: claiming failed: refused")]
        assert caplog.records[1].levelno == logging.WARNING
        assert registry.get_sample_value("outboxkit_test_ready") == 0

    def test_a_stopping_daemon_is_not_ready(self) -> None:
        life, registry = lifecycle()
        life.set_ready(True)
        assert life.ready()
        assert registry.get_sample_value("outboxkit_test_ready") == 1
        life.stop()
        assert not life.ready()


class TestLiveness:
    def test_a_loop_that_stops_going_round_is_not_alive(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        now = [1000.0]
        monkeypatch.setattr(time, "monotonic", lambda: now[0])
        life, _ = lifecycle()
        now[0] += 9.9
        assert life.healthy()
        now[0] += 0.2  # the clock started at construction: 10.1 s without a beat
        assert not life.healthy()
        life.beat()
        assert life.healthy()

    def test_start_up_waits_are_not_a_hang_when_asked(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        now = [1000.0]
        monkeypatch.setattr(time, "monotonic", lambda: now[0])
        life, _ = lifecycle(alive_while_starting=True)
        now[0] += 3600
        assert life.healthy()
        life.beat()
        now[0] += 10.1
        assert not life.healthy()


class TestBackOff:
    def test_each_failure_in_a_row_waits_longer_until_a_success(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        life, _ = lifecycle()
        waits: list[float | None] = []

        def wait(timeout: float | None = None) -> bool:
            waits.append(timeout)
            return False

        monkeypatch.setattr(life.stopping, "wait", wait)
        caplog.set_level(logging.WARNING, logger="tests.runtime")
        for _ in range(4):
            life.back_off("claiming failed")
        life.succeeded()
        life.back_off("claiming failed")
        assert waits == [0.2, 0.4, 0.8, 1.0, 0.2]
        assert life.is_ready
        assert caplog.records[0].getMessage() == "claiming failed; retrying in 0.20 s"
        assert caplog.records[0].event == "relay.backoff"  # type: ignore[attr-defined]

    def test_a_stop_cuts_the_wait_short(self) -> None:
        life, _ = lifecycle(base=1.0)
        threading.Timer(0.05, life.stop).start()
        started = time.monotonic()
        life.back_off("down")
        assert time.monotonic() - started < 0.9


class TestTheDaemonsDelays:
    """Moving onto one Backoff kept each daemon's delays: half to all of
    ``min(max, initial * 2**failures)``, the consumer's initial at least 0.1 s."""

    @staticmethod
    def unjittered(backoff: Backoff, failures: int) -> list[float]:
        return [replace(backoff, jitter=0.0).delay(n) for n in range(1, failures + 1)]

    def test_the_relay(self) -> None:
        settings = RelaySettings(database_url="postgresql://u@127.0.0.1:1/x",
                                 kafka_bootstrap="127.0.0.1:1", backoff_initial_seconds=0.2,
                                 backoff_max_seconds=1.0)
        backoff = Relay(settings).lifecycle.backoff
        assert self.unjittered(backoff, 5) == [0.2, 0.4, 0.8, 1.0, 1.0]
        assert backoff.jitter == 0.5

    def test_the_consumer_runner(self) -> None:
        settings = ConsumerSettings(database_url="postgresql://u@127.0.0.1:1/x",
                                    kafka_bootstrap="127.0.0.1:1", backoff_initial_seconds=0.0,
                                    backoff_max_seconds=0.3)
        app = Consumer("g", settings=settings)
        app.register("t", lambda ctx, payload: None)
        backoff = Runner(app).lifecycle.backoff
        assert self.unjittered(backoff, 4) == [0.1, 0.2, 0.3, 0.3]
        assert backoff.jitter == 0.5


class TestHealthServer:
    @pytest.fixture
    def server(self) -> Iterator[tuple[HealthServer, dict[str, bool]]]:
        state = {"healthy": True, "ready": False}
        families = MetricFamilies("test")
        families.gauge("ready", "1 when ready").set(1)
        http = HealthServer("127.0.0.1", 0, families.registry, lambda: state["healthy"],
                            lambda: state["ready"])
        http.start()
        yield http, state
        http.stop()

    @staticmethod
    def get(http: HealthServer, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http.port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def test_probes_answer_as_their_callables_say_per_request(
        self, server: tuple[HealthServer, dict[str, bool]]
    ) -> None:
        http, state = server
        assert self.get(http, "/healthz") == (200, "ok\n")
        assert self.get(http, "/readyz") == (503, "not ready\n")
        state.update(healthy=False, ready=True)
        assert self.get(http, "/healthz") == (503, "unhealthy\n")
        assert self.get(http, "/readyz") == (200, "ready\n")
        assert self.get(http, "/nothing") == (404, "not found\n")

    def test_metrics_are_the_daemons_own_registry(
        self, server: tuple[HealthServer, dict[str, bool]]
    ) -> None:
        status, body = self.get(server[0], "/metrics")
        assert status == 200
        assert "outboxkit_test_ready 1.0" in body


class FakeDaemon:
    def __init__(self, outcome: int | OutboxError) -> None:
        self.outcome = outcome

    def run(self) -> int:
        if isinstance(self.outcome, OutboxError):
            raise self.outcome
        return self.outcome

    def stop(self) -> None:
        pass


class Settings:
    log_format, log_level, shutdown_timeout_seconds = "text", "INFO", 1.0


class TestRunDaemon:
    @pytest.fixture(autouse=True)
    def restore_process_state(self) -> Iterator[None]:
        """run_daemon configures logging and signals for the whole process: put them back."""
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        term, interrupt = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        yield
        root.handlers[:], root.level = handlers, level
        signal.signal(signal.SIGTERM, term)
        signal.signal(signal.SIGINT, interrupt)

    def test_the_daemons_status_is_the_exit_status(self) -> None:
        assert run_daemon("relay", lambda: FakeDaemon(0), Settings()) == 0

    def test_a_refusal_while_building_is_one_line_and_a_config_exit(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        def build() -> FakeDaemon:
            raise ConfigurationError("postgresql://u:secret@h/db")

        assert run_daemon("relay", build, Settings()) == EXIT_CONFIG
        # One line, and a URL in it loses its password.
        assert capsys.readouterr().err == "relay: postgresql://u:***@h/db\n"

    def test_errors_found_on_connecting_exit_by_their_kind(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        refused = FakeDaemon(ConfigurationError("the Kafka producer refused its settings"))
        assert run_daemon("consume", lambda: refused, Settings()) == EXIT_CONFIG
        failed = FakeDaemon(OutboxError("the schema is not migrated"))
        assert run_daemon("consume", lambda: failed, Settings()) == EXIT_FAILED
        assert capsys.readouterr().err.splitlines() == [
            "consume: the Kafka producer refused its settings",
            "consume: the schema is not migrated",
        ]

    def test_sigterm_stops_the_daemon(self) -> None:
        stopped = threading.Event()

        class Waits(FakeDaemon):
            def run(self) -> int:
                signal.raise_signal(signal.SIGTERM)
                return 0 if stopped.wait(5) else 3

            def stop(self) -> None:
                stopped.set()

        class Patient(Settings):
            # The bound's timer ends the process (os._exit): far beyond this test session.
            shutdown_timeout_seconds = 1e7

        assert run_daemon("relay", lambda: Waits(0), Patient()) == 0
