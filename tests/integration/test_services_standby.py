"""`python -m outbox.testing.services` with a PostgreSQL standby: up, status, a failover
(stop the primary, promote), the old primary refused, down — on nodes of its own."""

from __future__ import annotations

import shutil
from pathlib import Path

import psycopg
import pytest

from outbox.db.dsn import sqlalchemy_url
from outbox.testing import pg_standby
from outbox.testing.processes import pid_alive
from outbox.testing.services import LocalServices, main


@pytest.mark.timeout(120)
def test_a_standby_follows_the_primary_takes_over_and_the_old_primary_stays_down(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "services"
    services = LocalServices(state)
    try:
        primary = services.start_postgres()
        standby = services.start_standby()
        url = services.database_url(primary)
        assert url == (f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}"
                       "/postgres?target_session_attrs=read-write")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (n int)")
            conn.execute("INSERT INTO t VALUES (1)")
        assert main(["--dir", str(state), "status"]) == 3  # no Kafka in this test
        assert '"role": "standby"' in capsys.readouterr().out

        assert main(["--dir", str(state), "stop", "postgres"]) == 0
        assert main(["--dir", str(state), "promote"]) == 0
        # The same URL now reaches the promoted node, which has what the primary had.
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("INSERT INTO t VALUES (2)")
            rows = conn.execute("SELECT n FROM t ORDER BY n").fetchall()
        assert rows == [(1,), (2,)]
        assert sqlalchemy_url(url).startswith("postgresql+psycopg://")
        capsys.readouterr()
        assert main(["--dir", str(state), "status"]) == 3
        assert '"role": "promoted"' in capsys.readouterr().out
        # Starting the old primary would make two nodes that take writes.
        assert main(["--dir", str(state), "start", "postgres"]) == 1
        assert "promoted" in capsys.readouterr().err
    finally:
        assert main(["--dir", str(state), "down"]) == 0
    assert pg_standby.running_standby(services.standby_dir) is None
    assert not pid_alive(standby.pid)
    assert not pid_alive(primary.pid)
    for folder in (services.postgres_dir, services.standby_dir):  # outside tmp_path as root
        shutil.rmtree(folder, ignore_errors=True)
