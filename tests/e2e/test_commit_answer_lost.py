"""A commit whose answer is lost: PostgreSQL committed, the client heard an error (issue 32).

The client's PostgreSQL connections go through a Toxiproxy proxy to the real server. Right
before the COMMIT the proxy is told to stop delivering the server's answers (a downstream
toxic), so the COMMIT reaches the server, which commits, and the client gets a connection
error instead of its answer. Each test proves from the database (read directly, not through
the proxy) that the commit happened, then what the retry does:

a) an application's emit: a naive retry (a new message, no key on its own row) doubles the
   order, shown; the recipe of docs/guarantees.md (the request's own key on its row, the
   message id fixed by the request) leaves one order and one message;
b) a worker's step (emit + move to waiting, one transaction) in an ``outbox worker`` process:
   the worker drops the step as an outage, and the run goes on from what committed: one order;
   and a loop of one's own over ``app.claim`` whose step keeps the lease: retried from the
   claimed handle (``job.on``), the step is refused (``LeaseLost``), and the run taken again
   after its lease finds the step done; retried through the failed attempt's handle, it
   orders twice, shown;
c) a consumer's batch (effects + dedup marks) in a consumer process: redelivered, the batch's
   messages are dropped by their marks: each effect once, and the duplicates are counted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import OperationalError

from outbox import App, ClaimedRun, Envelope, LeaseLost
from outbox.db.dsn import libpq_url, sqlalchemy_url
from outbox.testing.processes import free_port
from outbox.testing.toxiproxy import Client, Server
from tests.e2e import answer_lost_app
from tests.e2e.conftest import wait_until
from tests.e2e.consumer_support import (
    ConsumerProcesses,
    create_effects,
    effects,
    produce,
    scrape,
)
from tests.e2e.test_relay_failures import make_topic

ROOT = Path(__file__).resolve().parents[2]
OUTBOX = Path(sys.executable).parent / "outbox"


@dataclass
class Cut:
    """A proxy in front of the test's PostgreSQL, and what clients connect to instead."""

    api: Client
    proxy: str
    url: str  # the test database's libpq URL, through the proxy

    def lose_answers(self, kind: str = "limit_data") -> None:
        """From now on the server's answers do not reach the clients: ``limit_data`` closes
        a connection at the first byte the server sends; ``timeout`` drops what it sends,
        and closes the connection after a second of that."""
        if kind == "limit_data":
            self.api.limit_data(self.proxy, 0)
        else:
            self.api.timeout(self.proxy, 1000)

    def restore(self) -> None:
        """The network is back: every toxic of the proxy removed, whoever added it (new
        connections only: the cut ones stay cut)."""
        for toxic in self.api.toxics(self.proxy):
            self.api.remove_toxic(self.proxy, str(toxic["name"]))


@pytest.fixture
def cut(toxiproxy_server: Server, database_url: str) -> Iterator[Cut]:
    api = toxiproxy_server.client
    name = f"pg-{uuid.uuid4().hex[:8]}"
    url = api.front(name, libpq_url(database_url))
    try:
        yield Cut(api, name, url)
    finally:
        api.delete(name)


def count(engine: Engine, sql: str, **params: object) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql), params).scalar_one())


# --- a) an application's emit -----------------------------------------------------------------
ORDERS_DDL = (
    "CREATE TABLE public.orders (id bigserial PRIMARY KEY, request_id text UNIQUE,"
    " item text NOT NULL, qty integer NOT NULL)"
)
ORDERS = uuid.UUID("1f0c8a3e-5b1d-4c7a-9e2f-3d4b5a6c7d8e")  # the namespace of order message ids
app = App()


def place_order_naively(engine: Engine, item: str, qty: int,
                        before_commit: Callable[[], None] = lambda: None) -> None:
    """What not to do: each attempt is a new order row and a new message."""
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO public.orders (item, qty) VALUES (:i, :q)"),
                     {"i": item, "q": qty})
        app.emit(conn, Envelope(topic="order.submit", type="order.submit", key="supplier-acme",
                                payload={"item": item, "qty": qty}))
        before_commit()


def place_order(engine: Engine, request_id: str, item: str, qty: int,
                before_commit: Callable[[], None] = lambda: None) -> uuid.UUID:
    """The recipe (docs/guarantees.md): the request's key on the order's row, and the message
    id drawn from it, so an attempt after one that committed unheard changes nothing."""
    message_id = uuid.uuid5(ORDERS, request_id)
    with engine.begin() as conn:
        placed = conn.execute(
            text("INSERT INTO public.orders (request_id, item, qty) VALUES (:r, :i, :q) "
                 "ON CONFLICT (request_id) DO NOTHING RETURNING id"),
            {"r": request_id, "i": item, "q": qty},
        ).first()
        if placed is not None:  # None: an earlier attempt committed, its message with it
            app.emit(conn, Envelope(message_id=message_id, topic="order.submit",
                                    type="order.submit", key="supplier-acme",
                                    payload={"request": request_id, "item": item, "qty": qty}))
        before_commit()
    return message_id


def _orders_and_messages(engine: Engine) -> tuple[int, int]:
    return (count(engine, "SELECT count(*) FROM public.orders"),
            count(engine, "SELECT count(*) FROM outboxkit.outbox_messages"))


@pytest.fixture
def app_engine(cut: Cut, engine: Engine) -> Iterator[Engine]:
    """The application's engine, through the proxy; *engine* reads the truth directly."""
    with engine.begin() as conn:
        conn.execute(text(ORDERS_DDL))
    proxied = create_engine(sqlalchemy_url(cut.url))
    try:
        yield proxied
    finally:
        proxied.dispose()


def test_an_emit_whose_commits_answer_is_lost_committed_and_a_naive_retry_doubles_it(
    cut: Cut, app_engine: Engine, engine: Engine
) -> None:
    started = time.monotonic()
    with pytest.raises(OperationalError, match="closed the connection"):
        place_order_naively(app_engine, "widget", 3, before_commit=lambda: cut.lose_answers(
            "timeout"))
    # The client saw an error after its COMMIT, and the database has the order and its message.
    assert time.monotonic() - started >= 0.9  # the answer did not come; the proxy closed
    assert _orders_and_messages(engine) == (1, 1)
    cut.restore()
    place_order_naively(app_engine, "widget", 3)  # the application's retry
    assert _orders_and_messages(engine) == (2, 2)  # two orders, two different messages


def test_an_emit_whose_commits_answer_is_lost_is_retried_once_with_the_recipe(
    cut: Cut, app_engine: Engine, engine: Engine
) -> None:
    with pytest.raises(OperationalError, match="closed the connection"):
        place_order(app_engine, "ticket-813", "widget", 3,
                    before_commit=lambda: cut.lose_answers("timeout"))
    assert _orders_and_messages(engine) == (1, 1)  # committed, though the client heard not
    cut.restore()
    message_id = place_order(app_engine, "ticket-813", "widget", 3)  # the retry
    assert _orders_and_messages(engine) == (1, 1)
    assert count(engine, "SELECT count(*) FROM outboxkit.outbox_messages WHERE message_id = :m",
                 m=message_id) == 1
    # The same message emitted again (by a retry that took another path) is one row too.
    with engine.begin() as conn:
        app.emit(conn, Envelope(message_id=message_id, topic="order.submit",
                                type="order.submit", key="supplier-acme", payload={}))
    assert _orders_and_messages(engine) == (1, 1)


# --- b) a worker's step -----------------------------------------------------------------------
def _steps(port: int, outcome: str) -> float:
    """``outboxkit_worker_steps_total`` of *outcome*, summed over workflows (0: none yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            body = reply.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith("outboxkit_worker_steps_total{")
               and f'outcome="{outcome}"' in line)


@pytest.mark.timeout(90)
def test_a_workers_step_whose_commits_answer_is_lost_is_not_done_twice(
    cut: Cut, engine: Engine, toxiproxy_server: Server, tmp_path: Path
) -> None:
    port = free_port()
    env = {
        **os.environ,
        "OUTBOXKIT_DATABASE_URL": cut.url,
        "OUTBOXKIT_WORKER_HTTP_PORT": str(port),
        "OUTBOXKIT_WORKER_LEASE_SECONDS": "2",
        "OUTBOXKIT_WORKER_POLL_SECONDS": "0.5",
        "OUTBOXKIT_WORKER_LOG_LEVEL": "DEBUG",
        "TEST_TOXIPROXY_API": toxiproxy_server.api,
        "TEST_TOXIPROXY_PROXY": cut.proxy,
    }
    log = tmp_path / "worker.log"
    with log.open("ab") as out:
        worker = subprocess.Popen(
            [str(OUTBOX), "worker", "tests.e2e.answer_lost_app:app", "--name", "w-cut"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    wapp = answer_lost_app.app
    try:
        with engine.begin() as conn:
            run = wapp.start_run(conn, answer_lost_app.supplier_order, idempotency_key="po-1",
                                 checkpoint=answer_lost_app.Order(item="widget", qty=3, cut=True))

        def state() -> tuple[str, str | None]:
            with engine.connect() as conn:
                got = wapp.get_run(conn, run.id)
            return got.state.value, got.step

        # The step's transaction committed (read directly)...
        wait_until(lambda: state() == ("waiting", "ordered"), 30, "the step's commit")
        # ...and the worker heard an error instead, and dropped the step as an outage.
        wait_until(lambda: _steps(port, "db_unavailable") >= 1, 30,
                   "the worker to drop the step")
        assert _steps(port, "moved") == 0
        cut.restore()
        with engine.begin() as conn:
            wapp.signal(conn, run.id, "supplier-answer", signal_id="sa-1",
                        payload={"ref": "ACME-77"}, sender="supplier")
        wait_until(lambda: state()[0] == "done", 30, "the run to go on and finish")
        assert worker.poll() is None, log.read_text(errors="replace")
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    # One order, whatever the worker heard; the run's checkpoint carries the answer.
    assert count(engine, "SELECT count(*) FROM outboxkit.outbox_messages WHERE run_id = :r",
                 r=run.id) == 1
    with engine.connect() as conn:
        assert wapp.get_run(conn, run.id).checkpoint["supplier_ref"] == "ACME-77"


# --- b') a loop of your own over app.claim: the lease is held across the commit ---------------
def _order_step(job: ClaimedRun[Any], before_commit: Callable[[], None] = lambda: None) -> None:
    """A step of one's own loop: the order and the checkpoint that says it was placed, in the
    job's transaction, the lease kept (the run stays ``running``)."""
    job.save_checkpoint({**job.run.checkpoint, "ordered": True}, step="ordered")
    job.emit(Envelope(topic="order.submit", type="order.submit", key="supplier-acme",
                      payload={"item": "widget", "qty": 3}))
    before_commit()


def _claimed_run(engine: Engine, worker: str) -> ClaimedRun[Any]:
    with engine.begin() as conn:
        job = answer_lost_app.app.claim(conn, worker=worker, lease_seconds=2)
    assert job is not None
    return job


@pytest.fixture
def order_run(engine: Engine) -> uuid.UUID:
    with engine.begin() as conn:
        run = answer_lost_app.app.start_run(
            conn, answer_lost_app.supplier_order, idempotency_key=f"po-{uuid.uuid4().hex[:6]}",
            checkpoint=answer_lost_app.Order(item="widget", qty=3))
    return run.id


def _messages_of(engine: Engine, run_id: uuid.UUID) -> int:
    return count(engine, "SELECT count(*) FROM outboxkit.outbox_messages WHERE run_id = :r",
                 r=run_id)


def test_a_claimed_runs_step_whose_commits_answer_is_lost_is_refused_when_retried(
    cut: Cut, app_engine: Engine, engine: Engine, order_run: uuid.UUID
) -> None:
    job = _claimed_run(app_engine, "worker-1")
    with pytest.raises(OperationalError, match="closed the connection"), \
            app_engine.begin() as conn:
        _order_step(job.on(conn), before_commit=lambda: cut.lose_answers("timeout"))
    assert _messages_of(engine, order_run) == 1  # committed, though worker-1 heard an error
    cut.restore()
    # worker-1 retries the step from the lease it had before it (job.on): the step committed,
    # so that lease is behind the run's, and the first write is refused, nothing written.
    with pytest.raises(LeaseLost), app_engine.begin() as conn:
        _order_step(job.on(conn))
    assert _messages_of(engine, order_run) == 1
    # worker-1 gives up on the run; once its lease ran out, worker-2 takes the run again and
    # finds the step done in the checkpoint: it waits for the supplier, orders nothing.
    time.sleep(2.2)
    again = _claimed_run(engine, "worker-2")
    assert again.run.id == order_run
    assert (again.run.step, again.run.checkpoint["ordered"]) == ("ordered", True)
    with engine.begin() as conn:
        again.on(conn).wait_for_signal("supplier-answer", step="ordered")
    assert _messages_of(engine, order_run) == 1


def test_a_claimed_runs_step_retried_with_the_failed_attempts_handle_orders_twice(
    cut: Cut, app_engine: Engine, engine: Engine, order_run: uuid.UUID
) -> None:
    """What not to do: the handle the failed attempt wrote through carries that attempt's
    lease, which the commit made the run's own, so a retry through it is not refused."""
    job = _claimed_run(app_engine, "worker-1")
    written: list[ClaimedRun[Any]] = []  # the handle the failed attempt wrote through

    def attempt() -> None:
        with app_engine.begin() as conn:
            written.append(job.on(conn))
            _order_step(written[0], before_commit=lambda: cut.lose_answers("timeout"))

    with pytest.raises(OperationalError, match="closed the connection"):
        attempt()
    cut.restore()
    with app_engine.begin() as conn:
        _order_step(written[0].on(conn))
    assert _messages_of(engine, order_run) == 2


# --- c) a consumer's batch --------------------------------------------------------------------
# The batch's transaction, its handlers' effects written, waiting before its COMMIT: idle in
# it for a while (between two handlers' statements it is idle too, for microseconds: cut then,
# the next statement's answer is lost and nothing commits). The consumer's start-up checks
# have transactions of their own: not those.
IN_TRANSACTION = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
    "AND state = 'idle in transaction' AND query LIKE '%consumer_effects%' "
    "AND clock_timestamp() - state_change > interval '300 milliseconds'"
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("marks", ["kept", "purged"])
def test_a_consumers_batch_whose_commits_answer_is_lost_has_its_effects_once(
    cut: Cut, engine: Engine, kafka_bootstrap: str, tmp_path: Path, marks: str
) -> None:
    """With the batch's dedup marks *purged* while the consumer is cut off, the same run
    shows what the marks prevent: the redelivered batch's effects happen twice."""
    topic = f"answer-lost-{uuid.uuid4().hex[:8]}"
    make_topic(kafka_bootstrap, topic)
    create_effects(engine)
    consumers = ConsumerProcesses(cut.url, kafka_bootstrap, topic, tmp_path)
    port = free_port()
    # The first batch's transaction waits 2 s before its COMMIT: the test cuts then.
    consumer = consumers.start(http_port=port,
                               OUTBOXKIT_FAILPOINTS="consumer.after_handler=sleep(2000)@1")
    try:
        ids = produce(kafka_bootstrap, topic, [{"n": n} for n in range(20)], partition=0)
        wait_until(lambda: count(engine, IN_TRANSACTION) > 0, 60,
                   "the consumer's first batch to wait before its commit")
        cut.lose_answers("limit_data")
        wait_until(lambda: bool(effects(engine)), 10, "the batch's commit")
        in_batch = effects(engine)  # committed, though the consumer heard an error
        assert count(engine, "SELECT count(*) FROM outboxkit.consumer_inbox") == len(in_batch)
        if marks == "purged":
            with engine.begin() as conn:
                conn.execute(text("DELETE FROM outboxkit.consumer_inbox"))
        time.sleep(0.5)  # the cut connection closes at the answer's first byte
        cut.restore()
        wait_until(lambda: effects(engine).keys() == set(map(str, ids)), 60,
                   "every message handled")
        if marks == "kept":
            wait_until(lambda: _consumer_metric(port, "duplicates_total") >= len(in_batch), 30,
                       "the redelivered batch dropped as duplicates")
        else:
            wait_until(lambda: sum(effects(engine).values()) >= len(ids) + len(in_batch), 30,
                       "the redelivered batch handled again")
        assert consumer.poll() is None, consumers.logs()
    finally:
        consumers.stop_all()
    assert in_batch, "nothing committed before the cut"
    twice = 1 if marks == "kept" else 2
    assert effects(engine) == {m: twice if m in in_batch else 1 for m in map(str, ids)}, (
        consumers.logs())


def _consumer_metric(port: int, name: str) -> float:
    try:
        return scrape(port, f"outboxkit_consumer_{name}")
    except OSError:
        return 0.0
