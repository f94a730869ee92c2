"""What must hold after checkout sagas ran (whatever was killed meanwhile), read from the
database and the three systems' own records: each run failed after undoing its effects;
each order reserved and released once at stock, charged and refunded once at payments, never
booked at shipping (it refuses); each key posted once; every refund placed before its
release (the last effect is undone first). Shipping is set to refuse every booking."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence

from sqlalchemy import Engine, text

from examples.supplier_client import SupplierClient

UNDONE = "compensated: 2 effect(s) undone"


def check(engine: Engine, run_ids: Sequence[uuid.UUID], orders: Sequence[str],
          clients: Mapping[str, SupplierClient]) -> list[str]:
    """The violations found, as sentences (none: every invariant holds)."""
    problems: list[str] = []
    with engine.connect() as conn:
        runs = conn.execute(text("SELECT id, state, reason FROM outboxkit.agent_runs "
                                 "WHERE id = ANY(:ids)"), {"ids": list(run_ids)}).all()
        effects = conn.execute(text(
            "SELECT type, state, count(*) FROM outboxkit.run_effects WHERE run_id = ANY(:ids) "
            "GROUP BY type, state"), {"ids": list(run_ids)}).all()
    wrong = [f"{r.id} {r.state} ({r.reason})" for r in runs
             if (r.state, r.reason) != ("failed", UNDONE)]
    if wrong or len(runs) != len(run_ids):
        problems.append(f"runs not failed after undoing 2 effects: {wrong[:5]}")
    counts = {(t, s): n for t, s, n in effects}
    wanted = {("book", "not-applied"): len(run_ids), ("charge", "compensated"): len(run_ids),
              ("reserve", "compensated"): len(run_ids)}
    if counts != wanted:
        problems.append(f"effects {counts}, not {wanted}")
    records = {name: client.record() for name, client in clients.items()}
    placed_at: dict[tuple[str, str], str] = {}
    for name, done, undone in [("stock", "reserve", "release"),
                               ("payments", "charge", "refund")]:
        by_order: dict[str, list[str]] = {}
        for placed in records[name]["orders"]:
            op, order = placed["request"]["item"].split(":")
            by_order.setdefault(order, []).append(op)
            placed_at[(op, order)] = placed["created_at"]
        if by_order != {o: [done, undone] for o in orders}:
            twice = {o: ops for o, ops in by_order.items() if ops != [done, undone]}
            missing = sorted(set(orders) - set(by_order))
            problems.append(f"{name}: not one {done} then one {undone} per order: "
                            f"{dict(list(twice.items())[:5])}, missing {missing[:5]}")
        if records[name]["repeat_posts"]:
            problems.append(f"{name}: keys posted again: {records[name]['repeat_posts']}")
    if records["shipping"]["orders"]:
        problems.append(f"shipping booked {len(records['shipping']['orders'])} orders")
    late = [o for o in orders if ("refund", o) in placed_at and ("release", o) in placed_at
            and not placed_at[("refund", o)] < placed_at[("release", o)]]
    if late:
        problems.append(f"released before refunded (not the last effect first): {late[:5]}")
    return problems
