-- The base package's hand-written SQL (everything else in outbox is SQLAlchemy Core on
-- outbox/tables.py; DDL is in outbox/migrations). Each query follows its `-- name:` marker;
-- the comment lines right after the marker describe it (the loader, outbox.queries, keeps
-- them out of the statement's text). {schema} is the configured schema, quoted by
-- outbox.queries.quote_identifier. Parameters: `%(name)s` for driver SQL, `:name` for text().

-- name: emit
-- outbox.emit's one statement (see outbox/emit.py's docstring): the lease's fence, the
-- per-key lock, the INSERT and the wake-up in one round trip. Without a lease fence_run_id
-- is NULL and the fence is never read (the OR stops first); with one, the run row must
-- still carry its token and version, and FOR SHARE holds it so until commit, so a takeover
-- waits for this transaction instead of racing it. notify false (a transaction that will be
-- prepared: PREPARE TRANSACTION is refused after NOTIFY): the WHERE stops before pg_notify.
-- Driver SQL (psycopg placeholders): it skips SQLAlchemy's statement compilation and result
-- adaptation, which cost more than the round trip itself.
WITH
fence AS MATERIALIZED (
    SELECT 1 FROM {schema}.agent_runs
    WHERE id = CAST(%(fence_run_id)s AS uuid)
      AND lease_token = CAST(%(lease_token)s AS bigint)
      AND version = CAST(%(lease_version)s AS bigint)
    FOR SHARE
),
ordered AS MATERIALIZED (
    -- NULL key: pg_advisory_xact_lock is strict, so no lock is taken.
    SELECT pg_advisory_xact_lock(CAST(%(lock_key)s AS bigint))
),
inserted AS (
    INSERT INTO {schema}.outbox_messages
        (message_id, topic, key, lane, message_type, payload, headers, run_id)
    SELECT CAST(%(message_id)s AS uuid), CAST(%(topic)s AS text), CAST(%(key)s AS bytea),
           CAST(%(lane)s AS integer), CAST(%(type)s AS text), CAST(%(payload)s AS bytea),
           CAST(%(headers)s AS jsonb), CAST(%(run_id)s AS uuid)
    FROM ordered  -- the lock is held before the row's id is drawn
    WHERE CAST(%(fence_run_id)s AS uuid) IS NULL OR EXISTS (SELECT 1 FROM fence)
    ON CONFLICT (message_id) DO NOTHING
    RETURNING id, lane
),
woken AS (
    SELECT pg_notify(CAST(%(channel)s AS text), CAST(inserted.lane AS text)) FROM inserted
    WHERE CAST(%(notify)s AS boolean) AND EXISTS (
        SELECT 1 FROM {schema}.relays
        WHERE idle AND heartbeat_at > now() - make_interval(secs => %(idle_seconds)s)
    )
)
SELECT CAST(%(fence_run_id)s AS uuid) IS NULL OR EXISTS (SELECT 1 FROM fence) AS fenced,
       (SELECT id FROM inserted) AS id,
       (SELECT count(*) FROM woken) AS woken

-- name: emit_many
-- outbox.emit_many's one statement: emit's promises for a whole batch (the reasons for each
-- part are in outbox.emit._batch's docstring). Arrays go in binary (%(x)b): psycopg's text
-- format escapes every bytea and JSON string, which cost more than the INSERT itself.
-- The lease's fence as in emit (NULL fence_run_id: no lease, the fence is never read).
WITH
fence AS MATERIALIZED (
    SELECT 1 FROM {schema}.agent_runs
    WHERE id = CAST(%(fence_run_id)s AS uuid)
      AND lease_token = CAST(%(lease_token)s AS bigint)
      AND version = CAST(%(lease_version)s AS bigint)
    FOR SHARE
),
locked AS MATERIALIZED (
    SELECT pg_advisory_xact_lock(l.lock_key)
    FROM unnest(CAST(%(locks)b AS bigint[])) WITH ORDINALITY AS l(lock_key, ord)
    ORDER BY l.ord
),
inserted AS (
    INSERT INTO {schema}.outbox_messages
        (message_id, topic, key, lane, message_type, payload, headers, run_id)
    SELECT m.message_id, m.topic, m.key, m.lane, m.message_type, m.payload,
           CAST(m.headers AS jsonb), m.run_id
    FROM unnest(
        CAST(%(message_ids)b AS uuid[]), CAST(%(topics)b AS text[]),
        CAST(%(keys)b AS bytea[]), CAST(%(lanes)b AS integer[]),
        CAST(%(types)b AS text[]), CAST(%(payloads)b AS bytea[]),
        CAST(%(headers)b AS text[]), CAST(%(run_ids)b AS uuid[])
    ) WITH ORDINALITY
        AS m(message_id, topic, key, lane, message_type, payload, headers, run_id, ord)
    WHERE (SELECT count(*) FROM locked) >= 0
      AND (CAST(%(fence_run_id)s AS uuid) IS NULL OR EXISTS (SELECT 1 FROM fence))
    ORDER BY m.ord
    ON CONFLICT (message_id) DO NOTHING
    RETURNING lane
),
woken AS (
    SELECT pg_notify(CAST(%(channel)s AS text), CAST(lanes.lane AS text))
    FROM (SELECT DISTINCT lane FROM inserted) AS lanes
    WHERE CAST(%(notify)s AS boolean) AND EXISTS (
        SELECT 1 FROM {schema}.relays
        WHERE idle AND heartbeat_at > now() - make_interval(secs => %(idle_seconds)s)
    )
)
SELECT CAST(%(fence_run_id)s AS uuid) IS NULL OR EXISTS (SELECT 1 FROM fence) AS fenced,
       (SELECT count(*) FROM inserted) AS inserted,
       (SELECT count(*) FROM woken) AS woken

-- name: save_checkpoint
-- The one statement of every checkpoint save (outbox.runs.runlog.save_statement: sync and
-- async send it as is), the durable agent's hot path: the fence of
-- outbox.runs.fencing.statement (this run, its lease token and version, running, not purged) in
-- the UPDATE itself, which locks the row as fencing's FOR UPDATE does, and the entries of
-- the run's log (outbox/runs/runlog.py; empty arrays: none), which go in only with a saved row.
-- It returns only what the next lease needs (RETURNING the row would send the checkpoint back
-- to be parsed); a NULL version is a miss, which outbox.runs.fencing.explain names. NULL step
-- keeps the step. Arrays in binary (%(x)b), as emit_many's: in text, psycopg's escaping cost
-- a save without entries ~0.3 ms of client CPU; in binary, 0.01 ms.
WITH saved AS (
    UPDATE {schema}.agent_runs
       SET checkpoint = CAST(%(checkpoint)s AS jsonb),
           step = COALESCE(CAST(%(step)s AS text), step),
           version = version + 1,
           updated_at = now()
     WHERE id = CAST(%(run_id)s AS uuid)
       AND lease_token = CAST(%(token)s AS bigint)
       AND version = CAST(%(version)s AS bigint)
       AND state = 'running'
       AND purged_at IS NULL
    RETURNING id, version, lease_expires_at
),
logged AS (
    INSERT INTO {schema}.run_log (run_id, seq, entry)
    SELECT saved.id, l.seq, CAST(l.entry AS jsonb)
    FROM saved,
         unnest(CAST(%(log_seqs)b AS integer[]), CAST(%(log_entries)b AS text[])) AS l(seq, entry)
    ON CONFLICT (run_id, seq) DO UPDATE SET entry = EXCLUDED.entry
    RETURNING 1
)
SELECT (SELECT version FROM saved) AS version,
       (SELECT lease_expires_at FROM saved) AS lease_expires_at,
       (SELECT count(*) FROM logged) AS logged

-- name: transition
-- The one statement of every move of a leased run (outbox.runs.moves.statement; sync and async
-- send it as is: lifecycle.transition, the handle's job.transition), the end of every step a
-- worker runs. The fence of save_checkpoint (this run, its lease token and version, running,
-- not purged) in the UPDATE, which locks the row; the lease ends (owner and expiry cleared, the
-- token stays: it only grows); the history row goes in only with a moved row, from running (the
-- fenced state). NULL step keeps the step, NULL evidence the last evidence; keep_checkpoint
-- keeps the checkpoint (else a NULL one clears it); waiting: not_before is wake_at, or now() +
-- wake_after, or NULL (only a wake() makes it claimable). The run's log entries (as in
-- save_checkpoint; empty arrays: none) go in with a moved row: a durable agent's last journal
-- entries commit with its move to done or waiting, in this one statement. Returns only the new
-- version: NULL is a miss, which outbox.runs.fencing.explain names.
WITH moved AS (
    UPDATE {schema}.agent_runs
       SET state = CAST(%(to_state)s AS text),
           step = COALESCE(CAST(%(step)s AS text), step),
           reason = CAST(%(reason)s AS text),
           last_evidence = COALESCE(CAST(%(evidence)s AS jsonb), last_evidence),
           checkpoint = CASE WHEN CAST(%(keep_checkpoint)s AS boolean) THEN checkpoint
                             ELSE CAST(%(checkpoint)s AS jsonb) END,
           not_before = CASE WHEN CAST(%(waiting)s AS boolean)
                             THEN COALESCE(CAST(%(wake_at)s AS timestamptz),
                                           now() + CAST(%(wake_after)s AS interval))
                             ELSE not_before END,
           finished_at = CASE WHEN CAST(%(finished)s AS boolean) THEN now() ELSE finished_at END,
           on_child_failure = NULL, failed_child = NULL,  -- the step handled its wake-up
           lease_owner = NULL,
           lease_expires_at = NULL,
           version = version + 1,
           updated_at = now()
     WHERE id = CAST(%(run_id)s AS uuid)
       AND lease_token = CAST(%(token)s AS bigint)
       AND version = CAST(%(version)s AS bigint)
       AND state = 'running'
       AND purged_at IS NULL
    RETURNING id, state, step, version, lease_token
),
logged AS (
    INSERT INTO {schema}.run_transitions
        (run_id, from_state, to_state, step, reason, evidence, actor, lease_token)
    SELECT id, 'running', state, step, CAST(%(reason)s AS text), CAST(%(evidence)s AS jsonb),
           CAST(%(actor)s AS text), lease_token
    FROM moved
),
journal AS (
    INSERT INTO {schema}.run_log (run_id, seq, entry)
    SELECT moved.id, l.seq, CAST(l.entry AS jsonb)
    FROM moved,
         unnest(CAST(%(log_seqs)b AS integer[]), CAST(%(log_entries)b AS text[])) AS l(seq, entry)
    ON CONFLICT (run_id, seq) DO UPDATE SET entry = EXCLUDED.entry
)
SELECT (SELECT version FROM moved) AS version

-- name: schema_versions_exists
-- Whether the schema has been migrated at all (:name is the qualified table name).
SELECT to_regclass(:name)

-- name: applied_versions
SELECT version FROM {schema}.schema_versions

-- name: migration_lock
-- Held until the migration's transaction ends, so a concurrent migrator re-reads after it.
SELECT pg_advisory_xact_lock(:key)

-- name: record_migration
INSERT INTO {schema}.schema_versions (version, name) VALUES (:version, :name)

-- name: claim_run
-- The claim of one run (outbox.runs.lifecycle.claim and the worker's claims; sync and async send
-- it as is), the first statement of every step a worker runs. The due probes: one partial index
-- each (migration 0007), each with its own ORDER BY so PostgreSQL merges them in created_at
-- order (Merge Append) instead of sorting every runnable run; runs not due yet are never read.
-- Each candidate is fetched by primary key (the LATERAL), checked again and locked there (a
-- run another worker claimed and committed since this statement's snapshot is re-read by the
-- lock and skipped): joined to the probes instead, the planner could pick a scan of the whole
-- table, reading the dead rows of every run claimed so far on each claim (worker steps/s
-- 650 -> 1,430 on 2 cores, bench/worker_bench.py's 4-process drain); retired
-- workflows are left out; the workflows filter (NULL: every workflow); the lease columns; the
-- history row saying how the run was taken. States and LIMIT are written in, not parameters: a
-- partial index is used only when the planner proves its predicate from constants, and psycopg
-- prepares a statement after five runs (a generic plan sees parameters, not values). Always one
-- row: all NULL when nothing was claimed. Short enough for psycopg's query cache (built with
-- Core it was over 4096 characters, parsed again and its parameters rendered on every claim).
WITH due AS (
    (SELECT id, created_at FROM {schema}.agent_runs
      WHERE state = 'queued' AND not_before IS NULL AND purged_at IS NULL
        AND (CAST(%(workflows)s AS text[]) IS NULL
             OR workflow = ANY(CAST(%(workflows)s AS text[])))
      ORDER BY created_at)
    UNION ALL
    (SELECT id, created_at FROM {schema}.agent_runs
      WHERE state IN ('queued', 'waiting') AND not_before <= now() AND purged_at IS NULL
        AND (CAST(%(workflows)s AS text[]) IS NULL
             OR workflow = ANY(CAST(%(workflows)s AS text[])))
      ORDER BY created_at)
    UNION ALL
    (SELECT id, created_at FROM {schema}.agent_runs
      WHERE state = 'running' AND lease_expires_at <= now() AND purged_at IS NULL
        AND (CAST(%(workflows)s AS text[]) IS NULL
             OR workflow = ANY(CAST(%(workflows)s AS text[])))
      ORDER BY created_at)
    UNION ALL
    (SELECT id, created_at FROM {schema}.agent_runs
      WHERE state = 'running' AND lease_expires_at IS NULL AND purged_at IS NULL
        AND (CAST(%(workflows)s AS text[]) IS NULL
             OR workflow = ANY(CAST(%(workflows)s AS text[])))
      ORDER BY created_at)
),
candidate AS (
    SELECT c.id, c.state, c.lease_expires_at
      FROM due CROSS JOIN LATERAL (
        SELECT r.id, r.state, r.lease_expires_at FROM {schema}.agent_runs r
         WHERE r.id = due.id
           AND (r.state = 'queued' AND coalesce(r.not_before, now()) <= now()
                OR r.state = 'running' AND coalesce(r.lease_expires_at, now()) <= now()
                OR r.state = 'waiting' AND r.not_before <= now())
           AND r.purged_at IS NULL
           AND (r.compensating_since IS NOT NULL  -- a retired workflow's runs still undo
                OR NOT EXISTS (SELECT 1 FROM {schema}.workflows w
                                WHERE w.name = r.workflow AND w.retired_at IS NOT NULL))
           AND (CAST(%(workflows)s AS text[]) IS NULL
                OR r.workflow = ANY(CAST(%(workflows)s AS text[])))
           FOR UPDATE OF r SKIP LOCKED) c
     ORDER BY due.created_at
     LIMIT 1
),
claimed AS (
    UPDATE {schema}.agent_runs r
       SET state = 'running', not_before = NULL, awaits_signals = NULL, awaits_children = NULL,
           awaits_failure = NULL,
           lease_owner = CAST(%(worker)s AS text),
           lease_token = r.lease_token + 1,
           lease_expires_at = now() + CAST(%(lease)s AS interval),
           version = r.version + 1, updated_at = now()
      FROM candidate
     WHERE r.id = candidate.id
    RETURNING r.id, r.workflow, r.workflow_version, r.prompt_version, r.tool_schema_version,
              r.parent_id, r.compensating_since, r.on_child_failure, r.failed_child,
              r.state, r.step, r.checkpoint, r.last_evidence, r.idempotency_key, r.attempts,
              r.not_before, r.lease_owner, r.lease_token, r.lease_expires_at, r.version,
              r.reason, r.created_at, r.updated_at, r.finished_at, r.purged_at,
              candidate.state AS from_state, candidate.lease_expires_at AS from_expiry
),
hist AS (
    INSERT INTO {schema}.run_transitions
        (run_id, from_state, to_state, step, reason, actor, lease_token)
    SELECT id, from_state, 'running', step,
           CASE WHEN from_state = 'running' AND from_expiry IS NULL
                THEN 'confirmed, resumed by ' || CAST(%(worker)s AS text)
                WHEN from_state = 'running'
                THEN 'lease expired, resumed by ' || CAST(%(worker)s AS text)
                WHEN from_state = 'waiting'
                THEN 'woken, resumed by ' || CAST(%(worker)s AS text)
                ELSE 'claimed by ' || CAST(%(worker)s AS text) END,
           CAST(%(worker)s AS text), lease_token
      FROM claimed
)
SELECT claimed.* FROM (SELECT 1) AS one LEFT JOIN claimed ON true
