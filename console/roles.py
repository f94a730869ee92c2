"""The least privilege the console's database role needs (docs/console.md)."""

from __future__ import annotations

from outbox.db.queries import driver_sql, quote_identifier


def console_grants(schema: str, role: str, *, replay: bool = False) -> str:
    """The GRANT statements for the console's role (both names plain identifiers); with
    *replay*, what replaying dead letters adds."""
    for name in (schema, role):
        if not name.replace("_", "a").isalnum() or not name[0].isalpha():
            raise ValueError(f"{name!r} is not a plain identifier")
    script = driver_sql("console", "console_role_grants", schema)
    if replay:
        script += driver_sql("console", "console_role_replay_grants", schema)
    return script.replace("{role}", quote_identifier(role))
