"""A run's events served by the console over real HTTP (uvicorn) against real PostgreSQL:
server-sent events resumed from ``Last-Event-ID`` miss nothing and repeat nothing, a step
that rolled back never shows, the stream ends with the run; the same events as JSON."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import Engine

from console import run_events as streams
from console.run_events import RunStreams
from outbox import App, Envelope
from outbox.runs.leases import Lease
from outbox.runs.lifecycle import claim, save_checkpoint, start_run, transition
from outbox.settings import OutboxSettings
from tests.integration.console_support import PASSWORDS, call, serving

APP = App()


@pytest.fixture
def console(database_url: str) -> Iterator[str]:
    with serving(database_url) as base:
        yield base


def _running(engine: Engine) -> Lease:
    """A claimed run with two log entries: events 1..4 (queued, running, two responses)."""
    with engine.begin() as conn:
        start_run(conn, workflow="wf", workflow_version="1", idempotency_key="followed")
    with engine.begin() as conn:
        got = claim(conn, worker="w", lease_seconds=120)
        assert got is not None
        return save_checkpoint(conn, got.lease, {"n": 2}, log={
            0: {"op": "agent.model.request", "result": "first"},
            1: {"op": "agent.model.request#1", "result": "second"}})


def _emit(engine: Engine, run_id: uuid.UUID, key: str) -> None:
    with engine.begin() as conn:
        APP.emit(conn, Envelope(topic="orders", type="order", key=key, payload={},
                                run_id=run_id))


@contextmanager
def _stream(base: str, path: str, *, last_event_id: str | None = None) -> Iterator[Any]:
    """The open event stream of *path* as a viewer; each item an event's fields."""
    token = base64.b64encode(f"vic:{PASSWORDS['vic']}".encode()).decode()
    headers = {"Authorization": f"Basic {token}"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    request = urllib.request.Request(base + path, headers=headers)  # noqa: S310 - loopback
    with urllib.request.urlopen(request, timeout=20) as response:  # noqa: S310
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        yield _events(response)


def _events(response: Any) -> Iterator[dict[str, str]]:
    fields: dict[str, str] = {}
    for raw in response:
        line = raw.decode().rstrip("\n")
        if not line:
            if fields:
                yield fields
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            fields[name] = value


def test_a_client_that_reconnects_with_its_last_event_id_misses_nothing_and_sees_nothing_twice(
        console: str, engine: Engine) -> None:
    lease = _running(engine)
    run_id = lease.run_id
    with _stream(console, f"/runs/{run_id}/events") as events:
        first = [next(events) for _ in range(3)]  # then the client goes away
    assert [(e["id"], e["event"]) for e in first] == [
        ("1", "state"), ("2", "state"), ("3", "model_response")]
    assert json.loads(first[2]["data"])["data"]["summary"] == '"first"'
    # While it is away: an effect, and a step that rolls back (never an event).
    _emit(engine, run_id, "while-away")
    with engine.connect() as conn:
        APP.emit(conn, Envelope(topic="orders", type="order", key="rolled-back", payload={},
                                run_id=run_id))
        conn.rollback()
    seen: list[dict[str, str]] = []
    with _stream(console, f"/runs/{run_id}/events", last_event_id=first[-1]["id"]) as events:
        for event in events:
            seen.append(event)
            if event.get("id") == "5":  # caught up: the run goes on while it listens
                _emit(engine, run_id, "while-listening")
                with engine.begin() as conn:
                    transition(conn, lease, "done", evidence={"ok": True})
            if event["event"] == "end":
                break
    assert [e.get("id") for e in seen] == ["4", "5", "6", "7", None]
    assert [e["event"] for e in seen] == [
        "model_response", "effect_sent", "effect_sent", "state", "end"]
    keys = [json.loads(e["data"])["data"].get("key") for e in seen[:4]]
    assert keys == [None, "while-away", "while-listening", None]
    # Finished, everything sent: a browser asking again is told not to reconnect.
    token = base64.b64encode(f"vic:{PASSWORDS['vic']}".encode()).decode()
    again = urllib.request.Request(console + f"/runs/{run_id}/events",  # noqa: S310
                                   headers={"Authorization": f"Basic {token}",
                                            "Last-Event-ID": "7"})
    with urllib.request.urlopen(again, timeout=20) as response:  # noqa: S310
        assert response.status == 204


def test_after_starts_a_stream_and_last_event_id_wins_over_it(
        console: str, engine: Engine) -> None:
    lease = _running(engine)
    with engine.begin() as conn:
        transition(conn, lease, "failed", reason="cancelled")
    with _stream(console, f"/runs/{lease.run_id}/events?after=2") as events:
        assert [e.get("id") for e in events] == ["3", "4", "5", None]
    with _stream(console, f"/runs/{lease.run_id}/events?after=0",
                 last_event_id="4") as events:
        assert [e.get("id") for e in events] == ["5", None]


def test_the_events_as_json_a_page_at_a_time(console: str, engine: Engine) -> None:
    lease = _running(engine)
    page = call(console, f"/runs/{lease.run_id}/events?format=json&after=1&limit=2",
                user="vic")
    assert page.status == 200, page.body
    found = page.json()
    assert [(e["seq"], e["kind"]) for e in found["events"]] == [
        (2, "state"), (3, "model_response")]
    assert (found["last"], found["state"], found["finished"]) == (3, "running", False)
    rest = call(console, f"/runs/{lease.run_id}/events?after={found['last']}",
                as_json=True).json()
    assert [e["seq"] for e in rest["events"]] == [4]
    assert call(console, f"/runs/{lease.run_id}/events?after=4", as_json=True).json()[
        "events"] == []


def test_reading_events_needs_a_user_a_known_run_and_a_number(
        console: str, engine: Engine) -> None:
    lease = _running(engine)
    assert call(console, f"/runs/{lease.run_id}/events", user=None).status == 401
    missing = call(console, f"/runs/{uuid.uuid4()}/events", as_json=True)
    assert missing.status == 404
    assert "error" in missing.json()
    token = base64.b64encode(f"vic:{PASSWORDS['vic']}".encode()).decode()
    stream = urllib.request.Request(console + f"/runs/{uuid.uuid4()}/events",  # noqa: S310
                                    headers={"Authorization": f"Basic {token}"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(stream, timeout=20)  # noqa: S310
    assert refused.value.code == 404
    refused.value.close()
    for query, said in (("?after=-1", "not an event number"), ("?after=x", "not an event"),
                        ("?format=json&limit=0", "limit"), ("?format=json&limit=5000", "limit")):
        answer = call(console, f"/runs/{lease.run_id}/events{query}", as_json=True)
        assert answer.status == 400, query
        assert said in answer.json()["error"]


def test_ending_the_streams_ends_an_open_one(engine: Engine, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    """What the console does on SIGTERM (outbox console's server): a stream of a run that
    is still going ends, after keeping the connection alive while nothing happened."""
    monkeypatch.setattr(streams, "KEEPALIVE_SECONDS", 0.05)
    lease = _running(engine)
    runs = RunStreams(engine, OutboxSettings(), poll=0.02)

    async def follow() -> list[str]:
        sent: list[str] = []
        async for chunk in runs.stream(lease.run_id, 3):
            sent.append(chunk)
            if chunk.startswith(":"):
                assert runs.open == 1
                runs.end_streams()
        return sent

    sent = asyncio.run(asyncio.wait_for(follow(), timeout=10))
    assert sent[0].startswith("id: 4\nevent: model_response\n")
    assert sent[-1] == ": still following\n\n"
    assert runs.open == 0


def test_one_user_cannot_take_every_stream(engine: Engine, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    monkeypatch.setattr(streams, "MAX_STREAMS_PER_USER", 1)
    monkeypatch.setattr(streams, "KEEPALIVE_SECONDS", 0.05)
    lease = _running(engine)
    runs = RunStreams(engine, OutboxSettings(), poll=0.02)
    seen: list[tuple[str | None, str | None]] = []

    async def follow() -> None:
        async for chunk in runs.stream(lease.run_id, 3, user="vic"):
            if chunk.startswith(":"):  # vic's one stream is open
                seen.append((runs.refused("vic"), runs.refused("ann")))
                runs.end_streams()

    asyncio.run(asyncio.wait_for(follow(), timeout=10))
    assert seen == [("vic has 1 run event streams open already", None)]
    assert runs.refused("vic") is None  # closed: vic may open another
