"""Retention of the operations ledger: old settled operations go with their events; open,
recent and parked ones stay; a window shorter than the dedup window is refused."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
from apscheduler.schedulers.background import BackgroundScheduler
from sqlalchemy import Engine, text

from consumers.settings import ConsumerSettings
from dedup.ledger import Applied, Evidence, Ledger, OperationsPurge, Refused
from dedup.ledger.retention import DEFAULT_DEDUP_WINDOW_SECONDS
from outbox.errors import ConfigurationError
from tests.integration.cli_support import one_line, outbox
from tests.integration.databases import fresh_database

LEDGER = Ledger()

DAY = 86_400.0
WINDOW = 30 * DAY


def operation(engine: Engine, name: str, *, status: str, age_days: float = 40,
              resolved_days: float | None = None) -> uuid.UUID:
    """An operation with message id *name* in *status*, created *age_days* ago and settled
    *resolved_days* ago (default: when created), each step with its event."""
    with engine.begin() as conn:
        op = LEDGER.begin(conn, key=f"place-order:{name}", system="supplier",
                          operation="place-order", request={"item": name},
                          message_id=name).operation
        if status == "confirmed":
            LEDGER.record_outcome(conn, op.id, Applied(Evidence(reference=f"PO-{name}")))
        elif status == "rejected":
            LEDGER.record_outcome(conn, op.id, Refused(Evidence(detail={"http_status": 422})))
        elif status == "resolved":  # a human confirmed it after it needed one
            LEDGER.mark_unknown(conn, op.id, reason="timeout")
            conn.execute(text("UPDATE outboxkit.operations SET status = 'needs-human' "
                              "WHERE id = :i"), {"i": op.id})
            LEDGER.resolve_confirmed(conn, op.id, evidence=Evidence(reference="PO-portal"),
                                     actor="alice", reason="seen in the supplier portal")
        elif status == "unknown":
            LEDGER.mark_unknown(conn, op.id, reason="timeout")
        elif status != "pending":
            conn.execute(text("UPDATE outboxkit.operations SET status = :s WHERE id = :i"),
                         {"s": status, "i": op.id})
        settled = age_days if resolved_days is None else resolved_days
        conn.execute(text(
            "UPDATE outboxkit.operations SET created_at = now() - make_interval(days => :a), "
            "updated_at = now() - make_interval(days => :r), "
            "resolved_at = CASE WHEN resolved_at IS NULL THEN NULL "
            "                   ELSE now() - make_interval(days => :r) END WHERE id = :i"),
            {"a": age_days, "r": settled, "i": op.id})
    return op.id


def remaining(engine: Engine) -> set[uuid.UUID]:
    with engine.connect() as conn:
        return set(conn.execute(text("SELECT id FROM outboxkit.operations")).scalars())


def events_of(engine: Engine, ids: set[uuid.UUID]) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM outboxkit.operation_events "
                                     "WHERE operation_id = ANY(:ids)"),
                                {"ids": list(ids)}).scalar_one())


@pytest.fixture
def ledger(engine: Engine) -> tuple[set[uuid.UUID], set[uuid.UUID]]:
    """(old settled operations, everything that must stay)."""
    old = {operation(engine, "old-confirmed", status="confirmed"),
           operation(engine, "old-rejected", status="rejected"),
           operation(engine, "old-resolved", status="resolved")}
    stay = {operation(engine, "recent-confirmed", status="confirmed", age_days=1),
            # created long ago, but a human settled it yesterday: the clock runs from then
            operation(engine, "late-resolved", status="resolved", resolved_days=1),
            operation(engine, "old-pending", status="pending"),
            operation(engine, "old-unknown", status="unknown"),
            operation(engine, "old-not-applied", status="not-applied"),
            operation(engine, "old-needs-human", status="needs-human")}
    return old, stay


def test_old_settled_operations_go_with_their_events_open_and_recent_ones_stay(
    engine: Engine, ledger: tuple[set[uuid.UUID], set[uuid.UUID]]
) -> None:
    old, stay = ledger
    assert events_of(engine, old) >= 6  # intent + outcome each (and more for the resolved one)
    kept_events = events_of(engine, stay)

    assert LEDGER.purge(engine, WINDOW) == 3

    assert remaining(engine) == stay
    assert events_of(engine, old) == 0
    assert events_of(engine, stay) == kept_events
    assert LEDGER.purge(engine, WINDOW) == 0  # nothing left to do: harmless to repeat


def test_dry_run_counts_operations_and_events_and_deletes_nothing(
    engine: Engine, ledger: tuple[set[uuid.UUID], set[uuid.UUID]]
) -> None:
    old, stay = ledger
    old_events = events_of(engine, old)
    with engine.connect() as conn:
        assert LEDGER.count_purgeable(conn, WINDOW) == OperationsPurge(3, old_events)
    assert LEDGER.purge(engine, WINDOW, dry_run=True) == 3
    assert remaining(engine) == old | stay
    assert events_of(engine, old) == old_events


def test_batches_smaller_than_the_set_delete_it_all_one_short_transaction_each(
    engine: Engine
) -> None:
    old = {operation(engine, f"old-{i}", status="confirmed") for i in range(7)}
    recent = operation(engine, "recent", status="confirmed", age_days=2)
    batches: list[OperationsPurge] = []

    assert LEDGER.purge(engine, WINDOW, batch=3, on_batch=batches.append) == 7

    assert [b.operations for b in batches] == [3, 3, 1]
    assert all(b.events == 2 * b.operations for b in batches)  # intent + call each
    assert remaining(engine) == {recent}
    assert events_of(engine, old) == 0


def test_max_batches_bounds_one_pass(engine: Engine) -> None:
    for i in range(5):
        operation(engine, f"old-{i}", status="confirmed")
    assert LEDGER.purge(engine, WINDOW, batch=2, max_batches=1) == 2
    assert len(remaining(engine)) == 3


def test_a_row_locked_by_someone_else_is_skipped_not_waited_for(engine: Engine) -> None:
    busy = operation(engine, "busy", status="confirmed")
    free = operation(engine, "free", status="confirmed")
    with engine.begin() as other:
        other.execute(text("SELECT 1 FROM outboxkit.operations WHERE id = :i FOR UPDATE"),
                      {"i": busy})
        assert LEDGER.purge(engine, WINDOW) == 1
    assert remaining(engine) == {busy}, f"{free} should have gone, {busy} stayed"


@pytest.mark.parametrize(("status", "replayed_days", "kept"), [
    ("retrying", None, True),
    ("dead-lettered", None, True),
    ("replayed", 1, True),     # replayed yesterday: the copy may still be on its way
    ("replayed", 40, False),
    ("recovered", None, False),
])
def test_an_operation_whose_message_is_still_parked_stays(
    engine: Engine, status: str, replayed_days: float | None, kept: bool
) -> None:
    op = operation(engine, "m-parked", status="confirmed")
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO outboxkit.consumer_failures (consumer_group, topic, kafka_partition, "
            "kafka_offset, message_id, status, replayed_at) VALUES ('orders', 'order.submit', "
            "0, 7, 'm-parked', :s, now() - make_interval(days => :d))"),
            {"s": status, "d": replayed_days or 0})
    assert LEDGER.purge(engine, WINDOW) == (0 if kept else 1)
    assert (op in remaining(engine)) is kept


class TestTheWindowOutlivesTheDedupWindow:
    def test_a_window_shorter_than_the_dedup_window_is_refused_naming_both_settings(
        self, engine: Engine, ledger: tuple[set[uuid.UUID], set[uuid.UUID]]
    ) -> None:
        before = remaining(engine)
        with pytest.raises(ConfigurationError) as refused:
            LEDGER.purge(engine, 7 * DAY)  # the consumers' default window is 8 days
        assert "older_than_seconds" in str(refused.value)
        assert "dedup_retention_seconds" in str(refused.value)
        assert "at least 691200 s (8 days)" in str(refused.value)
        with pytest.raises(ConfigurationError), engine.connect() as conn:
            LEDGER.count_purgeable(conn, 40 * DAY, dedup_window_seconds=60 * DAY)
        assert remaining(engine) == before

    def test_marks_kept_forever_leave_no_window_known_safe_unless_given(
        self, engine: Engine, ledger: tuple[set[uuid.UUID], set[uuid.UUID]]
    ) -> None:
        with pytest.raises(ConfigurationError, match="keep dedup marks forever"):
            LEDGER.purge(engine, WINDOW, dedup_window_seconds=0)
        # None: the caller vouches for the window (e.g. checked against its own settings)
        assert LEDGER.purge(engine, WINDOW, dedup_window_seconds=None) == 3

    def test_the_default_dedup_window_is_the_consumers_default(self) -> None:
        field = ConsumerSettings.model_fields["dedup_retention_seconds"]
        assert field.default == DEFAULT_DEDUP_WINDOW_SECONDS


class TestSchedulerJob:
    def test_refuses_a_short_window_when_added_and_purges_when_run(
        self, engine: Engine, ledger: tuple[set[uuid.UUID], set[uuid.UUID]]
    ) -> None:
        _, stay = ledger
        scheduler = BackgroundScheduler()
        with pytest.raises(ConfigurationError, match="older_than_seconds"):
            LEDGER.add_retention_job(scheduler, engine, older_than_seconds=DAY)
        assert scheduler.get_jobs() == []
        job = LEDGER.add_retention_job(scheduler, engine, older_than_seconds=WINDOW,
                                       batch=2)
        assert job.max_instances == 1
        job.func()  # the job body, as the scheduler would run it
        assert remaining(engine) == stay

    def test_a_failing_pass_is_logged_and_does_not_raise(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        from sqlalchemy import create_engine  # noqa: PLC0415

        dead = create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none",
                             connect_args={"connect_timeout": 1})
        job = LEDGER.add_retention_job(BackgroundScheduler(), dead,
                                       older_than_seconds=WINDOW)
        job.func()
        assert [getattr(r, "event", None) for r in caplog.records] == [
            "dedup.operations_retention_failed"]
        dead.dispose()


# --- outbox ops purge -------------------------------------------------------------------------


@pytest.fixture
def unmigrated_url(postgres_dsn: str) -> Iterator[str]:
    with fresh_database(postgres_dsn) as url:
        yield url


class TestCommandLine:
    def test_dry_run_then_purge_in_text_and_json(
        self, engine: Engine, database_url: str, ledger: tuple[set[uuid.UUID], set[uuid.UUID]]
    ) -> None:
        old, stay = ledger
        old_events = events_of(engine, old)
        dry = outbox("ops", "purge", "--older-than", "30", "--dry-run",
                     "--database-url", database_url)
        assert dry.returncode == 0, dry.stderr
        assert f"would purge 3 operations (confirmed, rejected) and their {old_events} " \
               "events, settled before now - 30 days" in dry.stdout
        dry_json = outbox("ops", "purge", "--dry-run", "--json",
                          OUTBOXKIT_DATABASE_URL=database_url)
        assert dry_json.returncode == 0, dry_json.stderr
        assert json.loads(dry_json.stdout) == {
            "dry_run": True, "operations": 3, "events": old_events,
            "statuses": ["confirmed", "rejected"], "older_than_seconds": WINDOW,
            "dedup_window_seconds": DEFAULT_DEDUP_WINDOW_SECONDS}
        assert remaining(engine) == old | stay

        done = outbox("ops", "purge", "--older-than", "30d", "--batch-size", "2", "--json",
                      "--database-url", database_url)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["operations"] == 3
        assert json.loads(done.stdout)["events"] == old_events
        assert remaining(engine) == stay

        again = outbox("ops", "purge", "--database-url", database_url)
        assert again.returncode == 0, again.stderr
        assert "purged 0 operations and their 0 events" in again.stdout

    def test_a_window_shorter_than_the_dedup_window_is_a_usage_error_that_deletes_nothing(
        self, engine: Engine, database_url: str, ledger: tuple[set[uuid.UUID], set[uuid.UUID]]
    ) -> None:
        before = remaining(engine)
        short = outbox("ops", "purge", "--older-than", "7d", "--database-url", database_url)
        assert short.returncode == 2
        assert "--older-than" in one_line(short)
        # the consumers' own setting, read from the environment, raises the floor
        env = outbox("ops", "purge", "--older-than", "30d", "--database-url", database_url,
                     OUTBOXKIT_CONSUMER_DEDUP_RETENTION_SECONDS=str(40 * DAY))
        assert env.returncode == 2
        assert "3456000 s (40 days)" in one_line(env)
        # an explicit --dedup-window wins over the environment
        flag = outbox("ops", "purge", "--older-than", "30d", "--dedup-window", "20d",
                      "--dry-run", "--database-url", database_url,
                      OUTBOXKIT_CONSUMER_DEDUP_RETENTION_SECONDS=str(40 * DAY))
        assert flag.returncode == 0, flag.stderr
        assert remaining(engine) == before

    def test_bad_durations_are_usage_errors(self, database_url: str) -> None:
        result = outbox("ops", "purge", "--older-than", "30 parsecs",
                        "--database-url", database_url)
        assert result.returncode == 2
        assert "not a duration like 30d" in result.stderr

    def test_an_unmigrated_database_says_run_outbox_migrate(self, unmigrated_url: str) -> None:
        result = outbox("ops", "purge", "--dry-run", "--database-url", unmigrated_url)
        assert result.returncode == 1
        assert "run `outbox migrate`" in one_line(result)
