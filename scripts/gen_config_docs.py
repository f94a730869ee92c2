"""Regenerate docs/configuration.md from the settings classes.

Run ``.venv/bin/python scripts/gen_config_docs.py`` from anywhere; commit the result.

Lives outside the packages because it imports all of them, which ``outbox`` itself may not.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ of this checkout

from console.settings import ConsoleSettings
from consumers.settings import ConsumerSettings
from outbox.worker import WorkerSettings
from relay.settings import RelaySettings
from tools.settings_docs import configuration_reference, settings_table

TARGET = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


WORKER = """
## Agent worker (`OUTBOXKIT_WORKER_*`)

`outbox worker module:app` (docs/worker.md) reads these; its flags `--concurrency`, `--name`,
`--http-port` and `--database-url` override the ones they name.

"""

CONSOLE = """
## Operator console (`OUTBOXKIT_CONSOLE_*`)

`outbox console` (docs/console.md) reads these; its flags `--host`, `--port` and
`--database-url` override the ones they name.

"""


def render() -> str:
    return (configuration_reference(RelaySettings, ConsumerSettings) + WORKER
            + settings_table([WorkerSettings], flags=False) + CONSOLE
            + settings_table([ConsoleSettings], flags=False))


if __name__ == "__main__":
    TARGET.write_text(render())
    print(f"wrote {TARGET}")
