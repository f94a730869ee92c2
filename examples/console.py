"""`make console`: the operator console on the demo's services, at http://127.0.0.1:8470/.

Run `make demo` first: the console then shows its runs, the order whose outcome was
unknown and was reconciled, and the refused order. With no OUTBOXKIT_CONSOLE_USERS set it
signs you in as user "demo", password "demo", an operator: for this machine only (it
listens on 127.0.0.1). Stop it with Ctrl-C; `make services-down` stops the services.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from demo import endpoints  # noqa: E402

from console.auth import hash_password  # noqa: E402
from outbox.cli.main import main as outbox  # noqa: E402


def run() -> None:
    database_url, bootstrap = endpoints()
    os.environ.setdefault("OUTBOXKIT_DATABASE_URL", database_url)
    os.environ.setdefault("OUTBOXKIT_KAFKA_BOOTSTRAP", bootstrap)
    if not os.environ.get("OUTBOXKIT_CONSOLE_USERS"):
        os.environ["OUTBOXKIT_CONSOLE_USERS"] = f"demo:operator:{hash_password('demo')}"
        print("sign in as user demo, password demo (an operator; set "
              "OUTBOXKIT_CONSOLE_USERS for your own users)")
    outbox(["console"])


if __name__ == "__main__":
    run()
