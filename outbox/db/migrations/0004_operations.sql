-- outboxkit 0004: the ledger of operations on outside systems (dedup/operations.py).
--
-- An outside call whose outcome we did not see (timeout, dropped connection, crash after
-- sending) may still have been applied. The intent row is committed before the call, so
-- the fact that we may have sent it survives any crash; the outcome is reconciled by asking
-- the outside system (dedup/reconcile.py), never by calling blindly again.
-- outbox/tables.py describes the same tables (section "operations (migration 0004)").

CREATE TABLE {schema}.operations (
    id                 uuid        NOT NULL,
    idempotency_key    text        NOT NULL,   -- sent with every call; stable across retries
    system             text        NOT NULL,   -- the outside system, e.g. 'supplier-acme'
    operation          text        NOT NULL,   -- what we asked it to do, e.g. 'place-order'
    message_id         text,                   -- the message the key was derived from
    run_id             uuid        REFERENCES {schema}.agent_runs (id),
    request_digest     text        NOT NULL,   -- sha256 of the canonical request
    request            jsonb,                  -- the request itself, to retry with the same key
    status             text        NOT NULL DEFAULT 'pending',
    calls              integer     NOT NULL DEFAULT 0,   -- calls sent (or maybe sent)
    checks             integer     NOT NULL DEFAULT 0,   -- status queries made
    version            bigint      NOT NULL DEFAULT 0,   -- grows on every write; fences checkers
    reference          text,                   -- the outside system's id for the effect
    response_digest    text,
    evidence           jsonb,
    last_error         text,
    next_check_at      timestamptz,            -- when a reconciler may look at it next
    resolved_by        text,
    resolution_reason  text,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    resolved_at        timestamptz,
    PRIMARY KEY (id),
    CONSTRAINT operations_status_check CHECK (status IN
        ('pending', 'unknown', 'not-applied', 'confirmed', 'rejected', 'needs-human')),
    UNIQUE (idempotency_key)
);
-- The reconciler scans only open operations that are due; partial, so it follows the backlog.
CREATE INDEX operations_due_idx ON {schema}.operations (next_check_at)
    WHERE status IN ('pending', 'unknown', 'not-applied');
CREATE INDEX operations_status_idx ON {schema}.operations (status, created_at);
CREATE INDEX operations_run_idx ON {schema}.operations (run_id) WHERE run_id IS NOT NULL;

-- Everything that happened to an operation: each call and its outcome, each status query
-- and its answer, retries, escalation and human resolutions (who and why). The evidence a
-- human needs when the outcome could not be established.
CREATE TABLE {schema}.operation_events (
    id            bigserial   NOT NULL,
    operation_id  uuid        NOT NULL REFERENCES {schema}.operations (id),
    kind          text        NOT NULL,
    outcome       text        NOT NULL,
    detail        jsonb,
    actor         text,
    at            timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (id),
    CONSTRAINT operation_events_kind_check CHECK (kind IN
        ('intent', 'call', 'check', 'retry', 'escalation', 'resolution', 'late-outcome'))
);
CREATE INDEX operation_events_operation_idx ON {schema}.operation_events (operation_id, id);
