"""The consumers' commands, registered in ``outboxkit.commands``: ``outbox consume`` (run an
app) and ``outbox dlq`` (list dead-lettered messages, replay them once their cause is fixed,
or discard them with a reason).
"""

from __future__ import annotations

import sys
from typing import Any

import click
from pydantic import ValidationError

from consumers.app import Consumer
from consumers.deadletter import KafkaSender
from consumers.errors import ConsumerError, FailureNotFound
from consumers.failures import STATUSES, FailedMessage, discard, get_failure, list_failures
from consumers.replay import rehandle, republish
from consumers.runner import Runner
from consumers.settings import ConsumerSettings
from outbox.cli.apps import import_app
from outbox.cli.daemon import run_daemon
from outbox.cli.flags import env_prefix, explain, settings_options
from outbox.cli.main import (
    database_url_option,
    echo_json,
    echo_table,
    one_line_errors,
    open_engine,
    who_option,
)
from outbox.errors import ConfigurationError
from outbox.kafka import KafkaClientError
from outbox.settings import OutboxSettings


@click.command("consume", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("app_path", metavar="MODULE:APP")
@settings_options(ConsumerSettings)
def consume_command(app_path: str, settings: ConsumerSettings) -> None:
    """Run an idempotent consumer app (also `python -m consumers MODULE:APP`): MODULE:APP
    names the consumers.Consumer object to run, as module:attribute.

    Settings come from OUTBOXKIT_CONSUMER_* environment variables; options override them. A
    bad value is reported as one line naming the setting, and the command exits with status 2.
    """
    # Help and errors name the command as typed (`outbox consume`, `python -m consumers`).
    prog = click.get_current_context().command_path
    # Past the shutdown bound: whatever was committed in PostgreSQL but not in Kafka is
    # redelivered and dropped by the dedup marks.
    sys.exit(run_daemon(prog, lambda: Runner(load_app(app_path, settings), own_process=True),
                        settings))


def load_app(path: str, settings: ConsumerSettings) -> Consumer:
    """Import ``module:attribute`` and give it *settings* (the command's, options applied)."""
    app = import_app(path, Consumer, "a consumers.Consumer")
    app.settings = settings
    app.group_id = settings.group_id or app.group_id
    return app


@click.group("dlq")
def dlq_group() -> None:
    """Messages consumers gave up on: list them, replay them once the cause is fixed."""


@dlq_group.command("list")
@database_url_option
@click.option("--group", help="Only failures of this consumer group.")
@click.option("--status", type=click.Choice(STATUSES), default="dead-lettered",
              show_default=True, help="Which failures to list.")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the failures as JSON.")
@one_line_errors
def dlq_list(database_url: str | None, group: str | None, status: str, limit: int,
             as_json: bool) -> None:
    """Dead-lettered messages (by default), oldest first."""
    with open_engine(database_url) as engine, engine.connect() as conn:
        found = list_failures(conn, group=group, status=status, limit=limit)
    if as_json:
        echo_json([f.as_dict() for f in found])
        return
    echo_table(
        ["id", "group", "topic", "partition", "offset", "message id", "attempts", "failed",
         "dlq topic", "error"],
        [[f.id, f.consumer_group, f.topic, f.partition, f.offset, f.message_id, f.attempts,
          f.last_failed_at, f.dlq_topic, _first_line(f.last_error)] for f in found],
        empty=f"no {status} messages",
    )


@dlq_group.command("replay")
@click.argument("failure_ids", nargs=-1, required=True, type=click.IntRange(min=1))
@click.option("--rehandle", "app_path", metavar="MODULE:APP",
              help="Run this app's handler on each message now, instead of sending it back "
                   "to its topic.")
@click.option("--kafka-bootstrap", envvar="OUTBOXKIT_KAFKA_BOOTSTRAP", show_envvar=True,
              help="Kafka bootstrap servers (to send the messages back to their topics).")
@click.option("--again", is_flag=True,
              help="Send one that is already 'replayed' (a replay killed before it was sent).")
@who_option("--actor", who="who replays it", help="Who replays it; kept on the failure.",
            required=False)
@database_url_option
@one_line_errors
def dlq_replay(*, failure_ids: tuple[int, ...], app_path: str | None,
               kafka_bootstrap: str | None, again: bool, actor: str | None,
               database_url: str | None) -> None:
    """Send dead-lettered messages back to their topics (or --rehandle them now)."""
    settings = OutboxSettings()
    with open_engine(database_url, settings) as engine:
        with engine.connect() as conn:
            for failure_id in failure_ids:
                _replayable(get_failure(conn, failure_id), failure_id, again=again)
        if app_path is not None:
            app = _app(app_path)
            for failure_id in failure_ids:
                _rehandle(app, engine, failure_id, actor)
                click.echo(f"failure {failure_id}: handled again by {app.group_id}")
            return
        if not kafka_bootstrap:
            raise ConfigurationError(
                "no Kafka: pass --kafka-bootstrap or set OUTBOXKIT_KAFKA_BOOTSTRAP "
                "(or --rehandle MODULE:APP to run the handler here)")
        # TLS/SASL come from the consumer's settings (OUTBOXKIT_CONSUMER_KAFKA_*).
        try:
            backend = ConsumerSettings(kafka_bootstrap=kafka_bootstrap).kafka()
        except ValidationError as exc:
            raise ConfigurationError(explain(exc, env_prefix(ConsumerSettings))) from exc
        sender = KafkaSender(backend, client_id="outbox-dlq-replay")
        try:
            for failure_id in failure_ids:
                try:
                    sent = republish(engine, sender, failure_id, settings=settings,
                                     again=again, actor=actor)
                except KafkaClientError as exc:
                    raise ConsumerError(f"failure {failure_id}: cannot send to Kafka at "
                                        f"{kafka_bootstrap}: {exc}") from exc
                click.echo(f"failure {failure_id}: republished to {sent.topic}"
                           f"[{sent.partition}]@{sent.offset}")
        finally:
            sender.close()


@dlq_group.command("discard")
@click.argument("failure_ids", nargs=-1, required=True, type=click.IntRange(min=1))
@click.option("--reason", required=True, help="Why it will never be handled; recorded.")
@who_option("--actor", who="who discards it", help="Who discards it; recorded.")
@database_url_option
@one_line_errors
def dlq_discard(failure_ids: tuple[int, ...], reason: str, actor: str,
                database_url: str | None) -> None:
    """Decide dead-lettered messages will never be handled (kept, with who and why; their
    redeliveries are dropped). All or none: one that is not dead-lettered changes nothing."""
    with open_engine(database_url) as engine, engine.begin() as conn:
        for failure_id in failure_ids:
            discard(conn, failure_id, actor=actor, reason=reason)
    for failure_id in failure_ids:
        click.echo(f"failure {failure_id}: discarded by {actor} ({reason})")


def _replayable(failure: FailedMessage | None, failure_id: int, *, again: bool) -> None:
    if failure is None:
        raise FailureNotFound(failure_id)
    if failure.status == "replayed" and not again:
        raise ConsumerError(f"failure {failure_id} was replayed already: nothing was replayed "
                            "(--again sends it once more: a replay killed before it was sent)")
    if failure.status not in ("dead-lettered", "replayed"):
        raise ConsumerError(f"failure {failure_id} is {failure.status!r}, not dead-lettered: "
                            "nothing to replay; nothing was replayed")


def _app(path: str) -> Consumer:
    try:
        settings = ConsumerSettings()
    except ValidationError as exc:
        raise ConfigurationError(
            explain(exc, env_prefix(ConsumerSettings)).splitlines()[0]) from exc
    return load_app(path, settings)


def _rehandle(app: Consumer, engine: Any, failure_id: int, actor: str | None) -> None:
    try:
        rehandle(app, engine, failure_id, actor=actor)
    except ConsumerError:
        raise
    except Exception as exc:
        raise ConsumerError(f"failure {failure_id}: the handler raised {type(exc).__name__}: "
                            f"{_first_line(str(exc))}; its transaction was rolled back") from exc


def _first_line(text: str | None) -> str:
    return (text or "-").strip().splitlines()[0][:80] if text and text.strip() else "-"
