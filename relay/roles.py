"""The least privilege a relay needs: its own tables, and the outbox rows it publishes.

A relay reads outbox rows (it never updates them), records the broker's proof and the
refused rows, deletes old published rows (retention), and keeps its heartbeat, lane leases
and cursors. It never needs the agent runs,
their checkpoints, approvals or artifacts, so its role cannot read them.
"""

from __future__ import annotations

from outbox.db.queries import driver_sql, quote_identifier


def relay_grants(schema: str, role: str) -> str:
    """The GRANT statements for a relay's role (both names must be plain identifiers)."""
    for name in (schema, role):
        if not name.replace("_", "a").isalnum() or not name[0].isalpha():
            raise ValueError(f"{name!r} is not a plain identifier")
    grants = driver_sql("relay", "relay_role_grants", schema)
    return grants.replace("{role}", quote_identifier(role))
