-- outboxkit 0001: the initial schema.
--
-- {schema} is replaced by the validated schema name (OutboxSettings.schema_name) before this
-- file runs; outbox.migrate runs it in one transaction together with its schema_versions row.
-- outbox/tables.py describes the same tables; tests/integration/test_migrate.py
-- (TestMigrationsMatchMetadata) proves the two agree, so change both together.

CREATE SCHEMA IF NOT EXISTS {schema};

CREATE TABLE {schema}.schema_versions (
    version     integer     NOT NULL,   -- the number of the migration file
    name        text        NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (version)
);

-- Workflow definitions and whether they still accept work.
CREATE TABLE {schema}.workflows (
    name            text        NOT NULL,
    version         text        NOT NULL,
    retired_at      timestamptz,
    retired_reason  text,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name)
);

-- One row per agent run: its state, checkpoint and the lease that fences its writers.
CREATE TABLE {schema}.agent_runs (
    id                   uuid        NOT NULL,
    workflow             text        NOT NULL,
    workflow_version     text        NOT NULL,
    prompt_version       text,
    tool_schema_version  text,
    state                text        NOT NULL,
    step                 text,
    checkpoint           jsonb,
    last_evidence        jsonb,
    idempotency_key      text        NOT NULL,
    attempts             integer     NOT NULL DEFAULT 0,
    not_before           timestamptz,
    lease_owner          text,
    lease_token          bigint      NOT NULL DEFAULT 0,   -- grows on every claim
    lease_expires_at     timestamptz,
    version              bigint      NOT NULL DEFAULT 0,   -- grows on every write
    reason               text,
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now(),
    finished_at          timestamptz,
    purged_at            timestamptz,
    PRIMARY KEY (id),
    CONSTRAINT agent_runs_state_check
        CHECK (state IN ('queued', 'running', 'waiting', 'done', 'failed', 'needs-human')),
    UNIQUE (idempotency_key)
);
-- Claiming scans only runnable rows (waiting ones wake when not_before passes); partial, so
-- its size follows the backlog, not history.
CREATE INDEX agent_runs_runnable_idx ON {schema}.agent_runs (state, not_before)
    WHERE state IN ('queued', 'running', 'waiting');
CREATE INDEX agent_runs_finished_idx ON {schema}.agent_runs (finished_at)
    WHERE purged_at IS NULL;

-- Every state change of a run, with who made it and the evidence for it.
CREATE TABLE {schema}.run_transitions (
    id           bigserial   NOT NULL,
    run_id       uuid        NOT NULL REFERENCES {schema}.agent_runs (id),
    from_state   text,
    to_state     text        NOT NULL,
    step         text,
    reason       text,
    evidence     jsonb,
    actor        text,
    lease_token  bigint,
    at           timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (id)
);
CREATE INDEX run_transitions_run_idx ON {schema}.run_transitions (run_id, id);

-- Results of completed steps, so a resumed run does not repeat them.
CREATE TABLE {schema}.step_results (
    run_id       uuid        NOT NULL REFERENCES {schema}.agent_runs (id),
    step_key     text        NOT NULL,
    result       jsonb,
    recorded_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, step_key)
);

-- Content-addressed blobs too large for a checkpoint.
CREATE TABLE {schema}.artifacts (
    digest      text        NOT NULL,
    media_type  text        NOT NULL,
    size        bigint      NOT NULL,
    content     bytea       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (digest)
);

-- What retention removed from a run, when it was asked to keep a copy.
CREATE TABLE {schema}.run_archive (
    run_id        uuid        NOT NULL REFERENCES {schema}.agent_runs (id),
    checkpoint    jsonb,
    step_results  jsonb,
    archived_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id)
);

-- Human approvals that a run waits on; they expire and can be revoked.
CREATE TABLE {schema}.approvals (
    id            uuid        NOT NULL,
    run_id        uuid        NOT NULL REFERENCES {schema}.agent_runs (id),
    scope         jsonb       NOT NULL,
    requested_at  timestamptz NOT NULL DEFAULT now(),
    expires_at    timestamptz NOT NULL,
    granted_by    text,
    granted_at    timestamptz,
    revoked_by    text,
    revoked_at    timestamptz,
    reason        text,
    PRIMARY KEY (id)
);
CREATE INDEX approvals_run_idx ON {schema}.approvals (run_id);

-- The transactional outbox: rows committed with the state change that decided them.
CREATE TABLE {schema}.outbox_messages (
    id               bigserial   NOT NULL,   -- claim order within a lane, never a high-water mark
    message_id       uuid        NOT NULL,   -- the consumers' dedup key
    topic            text        NOT NULL,
    key              bytea,
    lane             integer     NOT NULL,   -- hash(key) mod lanes: one key, one lane, in order
    message_type     text        NOT NULL,
    -- bytes, not jsonb: jsonb reorders keys and rejects NUL; Kafka gets exactly these bytes.
    payload          bytea       NOT NULL,
    headers          jsonb       NOT NULL DEFAULT '{}'::jsonb,
    run_id           uuid,
    status           text        NOT NULL DEFAULT 'pending',
    attempts         integer     NOT NULL DEFAULT 0,
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    published_at     timestamptz,
    kafka_partition  integer,
    kafka_offset     bigint,
    PRIMARY KEY (id),
    CONSTRAINT outbox_messages_status_check CHECK (status IN ('pending', 'published', 'failed')),
    UNIQUE (message_id)
)
-- The table churns (insert, mark published, delete). Vacuum after a fixed number of dead
-- rows rather than a fraction of the table, unthrottled: dead entries at the head of the
-- pending index otherwise pile up and every claim pays for them.
WITH (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 10000,
    autovacuum_vacuum_cost_delay = 0
);
-- The relay claims pending rows per lane in id order; the index holds only the backlog.
CREATE INDEX outbox_messages_pending_idx ON {schema}.outbox_messages (lane, id)
    WHERE status = 'pending';

-- Running relays. emit reads `idle` in its INSERT statement: only while a relay is idle and
-- LISTENing does a transaction pay for NOTIFY (which serialises commits database-wide).
CREATE TABLE {schema}.relays (
    relay_id      text        NOT NULL,
    host          text,
    pid           integer,
    idle          boolean     NOT NULL DEFAULT false,
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (relay_id)
);

-- Confirmations a consumer applied to a waiting run; the key makes a redelivery a no-op.
CREATE TABLE {schema}.confirmations (
    run_id           uuid        NOT NULL REFERENCES {schema}.agent_runs (id),
    confirmation_id  text        NOT NULL,
    outcome          text        NOT NULL,
    actor            text        NOT NULL,
    applied_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, confirmation_id),
    CONSTRAINT confirmations_outcome_check CHECK (outcome IN ('running', 'done', 'failed'))
);
