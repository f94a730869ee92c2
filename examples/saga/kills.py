"""SIGKILLs while checkout sagas undo their effects, for the crash test and the fault harness:
only processes the given :class:`~examples.supplier_order.pipeline.Pipeline` started are
killed (by pid), each restarted at once, and only while some run still compensates."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Sequence

from sqlalchemy import Engine, text

from examples.supplier_order.pipeline import Pipeline


def states(engine: Engine, ids: Sequence[uuid.UUID]) -> dict[str, int]:
    """How many of *ids* are in each state."""
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT state, count(*) FROM outboxkit.agent_runs "
                                 "WHERE id = ANY(:ids) GROUP BY state"), {"ids": list(ids)}).all()
    return {state: count for state, count in rows}


def compensating(engine: Engine, ids: Sequence[uuid.UUID]) -> int:
    """How many of *ids* are undoing their effects now."""
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM outboxkit.agent_runs WHERE id = ANY(:ids) "
            "AND compensating_since IS NOT NULL"), {"ids": list(ids)}).scalar_one())


def during_compensation(engine: Engine, ids: Sequence[uuid.UUID],
                        pipelines: Sequence[tuple[Pipeline, Sequence[str]]],
                        rng: random.Random, *, kills: int,
                        start_timeout_s: float = 60.0) -> list[str]:
    """Once a run compensates, up to *kills* SIGKILLs of a process among *pipelines*' named
    ones, each restarted, while some run still compensates; return who was killed."""
    deadline = time.monotonic() + start_timeout_s
    while compensating(engine, ids) == 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"no run began compensating in {start_timeout_s:.0f} s")
        time.sleep(0.1)
    victims = [(p, name) for p, names in pipelines for name in names]
    killed: list[str] = []
    for _ in range(kills):
        time.sleep(rng.uniform(0.05, 0.5))
        if compensating(engine, ids) == 0:
            break  # every run is undone: later kills would prove nothing
        pipeline, name = rng.choice(victims)
        pipeline.kill(name)
        killed.append(name)
        time.sleep(rng.uniform(0.1, 0.4))
        pipeline.restart(name)
    return killed


def restart_dead(pipeline: Pipeline) -> None:
    for name in pipeline.dead():
        pipeline.restart(name)


def wait_failed(engine: Engine, ids: Sequence[uuid.UUID], heal: Callable[[], object], *,
                timeout_s: float) -> bool:
    """Until every run of *ids* is failed (undone), calling *heal* (restart what died)."""
    deadline = time.monotonic() + timeout_s
    while states(engine, ids) != {"failed": len(ids)}:
        heal()
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True
