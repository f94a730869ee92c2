"""The support agent's worker: claims runs and drives them until they wait or end.

    OUTBOXKIT_DATABASE_URL=postgresql://... python -m examples.support_agent.worker

Stops on SIGTERM or SIGINT after the run in hand reaches a commit point. A worker killed
outright loses nothing that committed: its runs' leases expire and a worker (this one,
restarted) takes each over from its last checkpoint. With ``OUTBOXKIT_AGENT_MODEL`` set it
drives the agent of :mod:`.real_model` instead of the scripted one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from sqlalchemy.ext.asyncio import create_async_engine

from outbox.db.dsn import sqlalchemy_url
from outbox_agents import DurableAgent


def the_agent() -> DurableAgent[None, str]:
    if os.environ.get("OUTBOXKIT_AGENT_MODEL"):
        from examples.support_agent.real_model import live_agent  # noqa: PLC0415

        return live_agent()
    from examples.support_agent.agent import durable  # noqa: PLC0415

    return durable


async def serve(database_url: str, worker: str) -> int:
    durable = the_agent()
    engine = create_async_engine(sqlalchemy_url(database_url), pool_pre_ping=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        return await durable.serve(engine, worker=worker, stop=stop, poll_seconds=0.2)
    finally:
        await engine.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", default=f"support-worker-{os.getpid()}")
    args = parser.parse_args()
    database_url = os.environ.get("OUTBOXKIT_DATABASE_URL")
    if not database_url:
        raise SystemExit("set OUTBOXKIT_DATABASE_URL to the PostgreSQL URL")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    advanced = asyncio.run(serve(database_url, args.worker))
    print(f"{args.worker}: stopped after advancing {advanced} runs", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
