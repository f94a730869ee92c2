"""The app ``outbox worker`` runs in the process tests (test_worker_process.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pydantic import BaseModel

from outbox import App, ClaimedRun

app = App()


class Nap(BaseModel):
    seconds: float


@app.workflow("nap", version="1")
def nap(job: ClaimedRun[Nap]) -> None:
    # Say the step started (the test then sends SIGTERM), then take the time it was given.
    Path(os.environ["WORKER_TEST_MARKER"]).write_text(str(job.run.id))
    time.sleep(job.checkpoint.seconds)
