"""`outbox status` on the real PostgreSQL: dead relays read as dead, ages are never negative."""

from __future__ import annotations

import json
import re

from sqlalchemy import Engine, text

from relay.lanes import LaneManager
from tests.integration.cli_support import outbox
from tests.integration.relay_support import pool_of


def add_relay(engine: Engine, relay_id: str, *, heartbeat: str, idle: bool = False,
              lanes: range = range(0)) -> None:
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO outboxkit.relays (relay_id, host, pid, idle, heartbeat_at)"
            f" VALUES (:r, 'test', 1, :idle, {heartbeat})"), {"r": relay_id, "idle": idle})
        conn.execute(text(
            "INSERT INTO outboxkit.relay_lanes (lane, owner, token, expires_at)"
            " SELECT g, :r, 1, now() + interval '10 seconds'"
            " FROM generate_series(CAST(:a AS int), CAST(:b AS int)) g"
            " ON CONFLICT (lane) DO UPDATE SET owner = EXCLUDED.owner,"
            " expires_at = EXCLUDED.expires_at"), {"r": relay_id, "a": lanes.start,
                                                   "b": lanes.stop - 1})


def test_a_silent_relay_is_dead_and_a_fresh_heartbeat_is_never_a_negative_age(
    engine: Engine, database_url: str
) -> None:
    # Killed a while ago, while busy: its row still says busy.
    add_relay(engine, "killed", heartbeat="now() - interval '107.9 seconds'")
    # Heartbeat committed after the status's transaction began (as seen from it: ahead).
    add_relay(engine, "live", heartbeat="now() + interval '30 seconds'", idle=True,
              lanes=range(0, 4))

    result = outbox("status", "--database-url", database_url)
    assert result.returncode == 0, result.stderr
    lines = {line.split()[1]: line for line in result.stdout.splitlines()
             if line.startswith("relay ")}
    assert re.search(r"dead, heartbeat 1[0-9]{2}\.[0-9] s ago, 0 lanes$", lines["killed"])
    assert "idle, heartbeat 0.0 s ago, 4 lanes 0-3" in lines["live"]
    assert not re.search(r"-[0-9.]+ s\b", result.stdout), result.stdout
    assert "none alive" not in result.stdout

    as_json = json.loads(outbox("status", "--json", "--database-url", database_url).stdout)
    by_id = {relay["relay_id"]: relay for relay in as_json["relays"]}
    assert by_id["killed"]["state"] == "dead"
    assert by_id["killed"]["dead"] is True
    assert by_id["live"]["state"] == "idle"
    assert by_id["live"]["heartbeat_age_s"] == 0.0
    assert as_json["oldest_pending_age_s"] >= 0


def test_the_lease_that_makes_a_relay_dead_comes_from_the_relays_setting(
    engine: Engine, database_url: str
) -> None:
    add_relay(engine, "slow", heartbeat="now() - interval '20 seconds'")
    default = outbox("status", "--database-url", database_url)
    assert "slow" in default.stdout
    assert "dead" in default.stdout  # the default lease is 10 s
    assert "relays               none alive" in default.stdout
    longer = outbox("status", "--database-url", database_url,
                    OUTBOXKIT_RELAY_LANE_LEASE_SECONDS="30")
    assert re.search(r"slow +busy, heartbeat 2[0-9]\.[0-9] s ago", longer.stdout)
    bad = outbox("status", "--database-url", database_url, "--lease-seconds", "0")
    assert bad.returncode == 2
    assert "--lease-seconds" in bad.stderr


def test_dead_relays_are_swept_after_six_leases(engine: Engine) -> None:
    add_relay(engine, "long-gone", heartbeat="now() - interval '7 seconds'")
    add_relay(engine, "just-died", heartbeat="now() - interval '3 seconds'")
    sweeper = LaneManager(pool_of(engine), schema="outboxkit", relay_id="sweeper", lanes=64,
                          lease_seconds=1.0, host="test", pid=1)
    assert sweeper.forget_dead_relays() == 1
    with engine.connect() as conn:
        left = conn.execute(text("SELECT relay_id FROM outboxkit.relays")).scalars().all()
    assert left == ["just-died"]  # still shown, as dead, for a while
