"""The promises, checked from the three records that matter: the database, the Kafka topic
and the supplier's own list of orders. Nothing here trusts a process's memory.

1. every committed message is in Kafka; nothing is in Kafka that was never committed;
2. per key, Kafka's order (duplicates dropped) is the commit order;
3. every order was placed at the supplier exactly once, and only for a decided run;
4. every run ends ``done`` with evidence, ``failed`` with the refusal as evidence, or
   ``needs-human`` with a reason and evidence; none is left running, queued or waiting;
5. every operation whose outcome was unknown was reconciled or escalated.
"""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from sqlalchemy import Engine, text

from examples.supplier_client import SupplierClient
from outbox.messages.envelope import HEADER_MESSAGE_ID

FINAL = {"done", "failed", "needs-human"}


@dataclass
class Delivery:
    partition: int
    offset: int
    key: bytes | None
    message_id: str


def read_topic(bootstrap: str, topic: str) -> list[Delivery]:
    """Every record of *topic*, from the beginning to the current end of each partition."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                             client_id="invariants", consumer_timeout_ms=5000)
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic)
                                                            or ())]
        if not parts:
            return []
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        end = consumer.end_offsets(parts)
        out: list[Delivery] = []
        remaining = {tp for tp in parts if end[tp] > 0}
        while remaining:
            batch = consumer.poll(timeout_ms=2000)
            if not batch:
                if all(consumer.position(tp) >= end[tp] for tp in remaining):
                    break
                continue
            for tp, records in batch.items():
                for r in records:
                    if r.offset < end[tp]:
                        mid = dict(r.headers).get(HEADER_MESSAGE_ID, b"").decode()
                        out.append(Delivery(r.partition, r.offset, r.key, mid))
                if consumer.position(tp) >= end[tp]:
                    remaining.discard(tp)
        return out
    finally:
        consumer.close(autocommit=False)


@dataclass
class Findings:
    committed: int = 0
    in_kafka: int = 0
    duplicates_delivered: int = 0
    lost: list[str] = field(default_factory=list)
    phantom: list[str] = field(default_factory=list)
    order_violations: list[str] = field(default_factory=list)
    supplier_effects: int = 0
    double_effects: list[str] = field(default_factory=list)
    undecided_orders: list[str] = field(default_factory=list)
    blind_repeats: int = 0
    runs_by_state: dict[str, int] = field(default_factory=dict)
    stuck_runs: list[str] = field(default_factory=list)
    without_evidence: list[str] = field(default_factory=list)
    wrong_evidence: list[str] = field(default_factory=list)
    open_operations: list[str] = field(default_factory=list)
    unknown_reconciled: int = 0
    unknown_escalated: int = 0
    paths: dict[str, int] = field(default_factory=dict)

    @property
    def violations(self) -> list[str]:
        checks = [
            ("1. committed but not in Kafka", self.lost),
            ("1. in Kafka but never committed", self.phantom),
            ("2. per-key order differs from commit order", self.order_violations),
            ("3. more than one order at the supplier for a run", self.double_effects),
            ("3. order at the supplier for no decided run", self.undecided_orders),
            ("4. run not in a final state", self.stuck_runs),
            ("4. final run without evidence", self.without_evidence),
            ("4. done run whose evidence is not its supplier order", self.wrong_evidence),
            ("5. operation left open", self.open_operations),
        ]
        found = [f"{what}: {len(items)} ({', '.join(items[:5])})" for what, items in checks
                 if items]
        if self.blind_repeats:
            found.append(f"3. {self.blind_repeats} order POSTs repeated a key the supplier "
                         "already had (a blind retry)")
        return found

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "violations": self.violations}


def check(engine: Engine, *, bootstrap: str, topic: str, supplier: SupplierClient,
          run_ids: Sequence[uuid.UUID]) -> Findings:
    f = Findings()
    _messages(f, engine, bootstrap, topic, run_ids)
    runs = _runs(f, engine, run_ids)
    _supplier(f, supplier.record(), runs)
    _operations(f, engine, run_ids)
    return f


def _messages(f: Findings, engine: Engine, bootstrap: str, topic: str,
              run_ids: Sequence[uuid.UUID]) -> None:
    """Counts are for *run_ids*' messages; phantoms and per-key order for the whole topic."""
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT message_id::text, key, run_id = ANY(:ids) FROM outboxkit.outbox_messages "
            "WHERE topic = :t ORDER BY id"), {"t": topic, "ids": list(run_ids)}).all()
    committed_by_key: dict[bytes | None, list[str]] = defaultdict(list)
    for mid, key, _ in rows:
        committed_by_key[bytes(key) if key is not None else None].append(mid)
    deliveries = read_topic(bootstrap, topic)
    seen = Counter(d.message_id for d in deliveries)
    committed = {mid for mid, _, _ in rows}
    mine = {mid for mid, _, is_mine in rows if is_mine}
    f.committed, f.in_kafka = len(mine), len(mine & set(seen))
    f.duplicates_delivered = sum(seen[m] - 1 for m in mine if seen[m] > 1)
    f.lost = sorted(mine - set(seen))
    f.phantom = sorted(set(seen) - committed)
    kafka_by_key: dict[bytes | None, list[str]] = defaultdict(list)
    first: set[str] = set()
    for d in sorted(deliveries, key=lambda d: (d.partition, d.offset)):
        if d.message_id not in first:  # a duplicate's first copy is where it counts
            first.add(d.message_id)
            kafka_by_key[d.key].append(d.message_id)
    for key, expected in committed_by_key.items():
        got = [m for m in kafka_by_key.get(key, []) if m in committed]
        if got != [m for m in expected if m in first]:
            f.order_violations.append((key or b"").decode(errors="replace"))


def _runs(f: Findings, engine: Engine, run_ids: Sequence[uuid.UUID]) -> dict[str, Any]:
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT id::text, state, reason, last_evidence FROM outboxkit.agent_runs "
            "WHERE id = ANY(:ids)"), {"ids": list(run_ids)}).mappings().all()
    f.runs_by_state = dict(Counter(r["state"] for r in rows))
    missing = {str(r) for r in run_ids} - {r["id"] for r in rows}
    f.stuck_runs = sorted(missing) + sorted(r["id"] for r in rows if r["state"] not in FINAL)
    for r in rows:
        if r["state"] in FINAL and not r["last_evidence"]:
            f.without_evidence.append(r["id"])
        if r["state"] == "needs-human" and not r["reason"]:
            f.without_evidence.append(r["id"])
    return {r["id"]: r for r in rows}


def _supplier(f: Findings, record: dict[str, Any], runs: dict[str, Any]) -> None:
    orders_by_run: dict[str, list[str]] = defaultdict(list)
    for order in record["orders"]:
        orders_by_run[str(order["request"].get("run_id"))].append(order["order_id"])
    f.supplier_effects = sum(len(v) for k, v in orders_by_run.items() if k in runs)
    f.blind_repeats = sum(record.get("repeat_posts", {}).values())
    for run_id, orders in orders_by_run.items():
        run = runs.get(run_id)
        if run is None:
            continue  # another batch's run (the supplier outlives one check)
        if len(orders) > 1:
            f.double_effects.append(run_id)
        if run["state"] in ("queued", "running"):
            f.undecided_orders.append(run_id)
    for run_id, run in runs.items():
        if run["state"] == "done":
            # The operations ledger settles the run with the supplier's order id as reference.
            ref = (run["last_evidence"] or {}).get("reference")
            if orders_by_run.get(run_id) != [ref]:
                f.wrong_evidence.append(run_id)


def _operations(f: Findings, engine: Engine, run_ids: Sequence[uuid.UUID]) -> None:
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT o.id::text, o.status, array_agg(e.kind || ':' || e.outcome ORDER BY e.id) "
            "FROM outboxkit.operations o JOIN outboxkit.operation_events e "
            "ON e.operation_id = o.id WHERE o.run_id = ANY(:ids) GROUP BY o.id, o.status"),
            {"ids": list(run_ids)}).all()
    paths: Counter[str] = Counter()
    for op_id, status, events in rows:
        if status not in ("confirmed", "rejected", "needs-human"):
            f.open_operations.append(op_id)
        # Unknown: a call that timed out (or is pending), or no answer at all (the consumer
        # died during the call: intent, then the reconciler's status check).
        was_unknown = any((e.endswith((":unknown", ":pending")) and not e.startswith("intent"))
                          or e.startswith("check:") for e in events) or len(events) > 2
        if was_unknown and status == "confirmed":
            f.unknown_reconciled += 1
        if status == "needs-human":
            f.unknown_escalated += 1
        paths[path_of(events)] += 1
    f.paths = dict(paths)


def path_of(events: Sequence[str]) -> str:
    """A readable path: 'call:confirmed', 'call:unknown → check:confirmed', ..."""
    steps = [e for e in events if not e.startswith("intent")]
    compact: list[str] = []
    for s in steps:
        if compact and compact[-1].split(" x")[0] == s:
            n = int(compact[-1].split(" x")[1]) + 1 if " x" in compact[-1] else 2
            compact[-1] = f"{s} x{n}"
        else:
            compact.append(s)
    return " → ".join(compact) or "intent only"
