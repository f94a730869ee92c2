-- outboxkit 0015: a bounded fan-out (app.start_children(concurrency=N), outbox/runs/children.py).
--
-- Children beyond the bound are started held: queued with not_before in the year 9000
-- (outbox/runs/children.py's HELD: finite, as drivers refuse 'infinity'), which no claim
-- takes. Each child that finishes releases the parent's oldest held child, in the same
-- deferred trigger that wakes the parent (0013), so the bound holds whatever made the move.
-- The held children of a parent, oldest first: the release below reads only these.
CREATE INDEX agent_runs_held_idx ON {schema}.agent_runs (parent_id, created_at, idempotency_key)
    WHERE state = 'queued' AND not_before = '9000-01-01 00:00:00+00';

CREATE OR REPLACE FUNCTION {schema}.wake_parent() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    parent_state text;
    needed integer;
    since timestamptz;
    workflow_name text;
    finished integer;
    released text;
BEGIN
    -- The parent's row first: children finishing at once take turns here, and each statement
    -- below reads a fresh snapshot, so the last of them counts all the others. NO KEY UPDATE:
    -- the key-share locks of children being inserted by the parent's step do not block it.
    SELECT state, awaits_children, children_since, workflow
      INTO parent_state, needed, since, workflow_name
      FROM {schema}.agent_runs WHERE id = NEW.parent_id FOR NO KEY UPDATE;
    -- A finished child frees its place: the oldest held sibling may go.
    UPDATE {schema}.agent_runs
       SET not_before = NULL, updated_at = now()
     WHERE id = (SELECT id FROM {schema}.agent_runs
                  WHERE parent_id = NEW.parent_id AND state = 'queued'
                    AND not_before = '9000-01-01 00:00:00+00'
                  ORDER BY created_at, idempotency_key
                  LIMIT 1 FOR UPDATE SKIP LOCKED)
    RETURNING workflow INTO released;
    IF released IS NOT NULL
       AND EXISTS (SELECT 1 FROM {schema}.run_workers WHERE idle_until > now()) THEN
        PERFORM pg_notify({runs_channel}, released);
    END IF;
    IF parent_state IS DISTINCT FROM 'waiting' OR needed IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT count(*) INTO finished FROM {schema}.agent_runs
     WHERE parent_id = NEW.parent_id AND state IN ('done', 'failed')
       AND (since IS NULL OR created_at > since);
    IF finished >= needed THEN
        UPDATE {schema}.agent_runs
           SET not_before = now(), awaits_children = NULL, children_since = now(),
               updated_at = now()
         WHERE id = NEW.parent_id;
        -- As outbox/runs/wakeups.py: NOTIFY only while a worker waits for one.
        IF EXISTS (SELECT 1 FROM {schema}.run_workers WHERE idle_until > now()) THEN
            PERFORM pg_notify({runs_channel}, workflow_name);
        END IF;
    END IF;
    RETURN NULL;
END
$$;
