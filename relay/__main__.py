"""``python -m relay``: the outbox relay daemon."""

from relay.cli import main

raise SystemExit(main())
