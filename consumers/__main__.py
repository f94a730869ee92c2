"""``python -m consumers module:app``: run an idempotent consumer app."""

from consumers.cli import main

raise SystemExit(main())
