-- outboxkit 0015: a bounded fan-out and a fail-fast join (outbox/runs/children.py).
--
-- app.start_children(..., concurrency=N) keeps the bound on the parent (children_limit) and
-- starts the children beyond it held: queued with not_before in the year 9000 or later
-- (children.py's HELD_AT: finite, as drivers refuse 'infinity'; the microseconds past it keep
-- the items' order), which no claim takes. When a child finishes, the trigger that wakes the
-- parent (0013) releases held siblings while fewer than the bound are unfinished and not
-- held, whatever made the move, as long as the parent is unfinished and not compensating.
-- awaits_failure: a join that ends at the first failed child (wait_for_children(...,
-- fail_fast=True)). on_child_failure: what a failed child does to its parent, as its join
-- declared (on_failure=): the worker fails or compensates the parent, and cancels the other
-- children, before any of the parent's code runs; failed_child: the child whose failure
-- woke the parent (set only then, so the worker acts on that failure and no other). Any
-- move of the parent clears both.
ALTER TABLE {schema}.agent_runs ADD COLUMN children_limit integer;
ALTER TABLE {schema}.agent_runs ADD COLUMN awaits_failure boolean;
ALTER TABLE {schema}.agent_runs ADD COLUMN on_child_failure text
    CONSTRAINT agent_runs_on_child_failure_check CHECK (on_child_failure IN ('fail', 'compensate'));
ALTER TABLE {schema}.agent_runs ADD COLUMN failed_child uuid;

-- The held children of a parent, in release order.
CREATE INDEX agent_runs_held_idx ON {schema}.agent_runs (parent_id, not_before)
    WHERE state = 'queued' AND not_before >= '9000-01-01 00:00:00+00';

CREATE OR REPLACE FUNCTION {schema}.wake_parent() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    parent_state text;
    needed integer;
    since timestamptz;
    workflow_name text;
    fail_fast boolean;
    bound integer;
    undoing boolean;
    finished integer;
    live integer;
    released text;
    policy text;
    pending uuid;
    ends_by_failure boolean;
BEGIN
    -- The parent's row first: children finishing at once take turns here, and each statement
    -- below reads a fresh snapshot, so the last of them counts all the others. NO KEY UPDATE:
    -- the key-share locks of children being inserted by the parent's step do not block it.
    SELECT state, awaits_children, children_since, workflow, coalesce(awaits_failure, false),
           children_limit, compensating_since IS NOT NULL, on_child_failure, failed_child
      INTO parent_state, needed, since, workflow_name, fail_fast, bound, undoing, policy,
           pending
      FROM {schema}.agent_runs WHERE id = NEW.parent_id FOR NO KEY UPDATE;
    -- This child's failure ends its parent's fail-fast join (it is of the wave joined).
    ends_by_failure := parent_state = 'waiting' AND needed IS NOT NULL AND fail_fast
                       AND NEW.state = 'failed' AND (since IS NULL OR NEW.created_at > since);
    -- A finished child frees its place: held siblings go while fewer than the bound run.
    -- None while the parent is finished or compensating, nor once a failure its join has a
    -- policy for woke it (pending) or wakes it now: the worker is about to cancel the rest.
    IF bound IS NOT NULL AND parent_state NOT IN ('done', 'failed') AND NOT undoing
       AND pending IS NULL AND NOT (ends_by_failure AND policy IS NOT NULL) THEN
        SELECT count(*) INTO live FROM {schema}.agent_runs
         WHERE parent_id = NEW.parent_id AND state NOT IN ('done', 'failed')
           AND (not_before IS NULL OR not_before < '9000-01-01 00:00:00+00');
        WITH go AS (
            UPDATE {schema}.agent_runs SET not_before = NULL, updated_at = now()
             WHERE id IN (SELECT id FROM {schema}.agent_runs
                           WHERE parent_id = NEW.parent_id AND state = 'queued'
                             AND not_before >= '9000-01-01 00:00:00+00'
                           ORDER BY not_before
                           LIMIT greatest(bound - live, 0)
                           FOR NO KEY UPDATE SKIP LOCKED)
            RETURNING workflow)
        SELECT min(workflow) INTO released FROM go;
        IF released IS NOT NULL
           AND EXISTS (SELECT 1 FROM {schema}.run_workers WHERE idle_until > now()) THEN
            PERFORM pg_notify({runs_channel}, released);
        END IF;
    END IF;
    IF parent_state IS DISTINCT FROM 'waiting' OR needed IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT count(*) INTO finished FROM {schema}.agent_runs
     WHERE parent_id = NEW.parent_id AND state IN ('done', 'failed')
       AND (since IS NULL OR created_at > since);
    -- A child of this wave that failed ends a fail-fast join at once, and names itself for
    -- the join's policy, if it has one (the worker acts on that failure only).
    IF finished >= needed OR ends_by_failure THEN
        UPDATE {schema}.agent_runs
           SET not_before = now(), awaits_children = NULL, awaits_failure = NULL,
               children_since = now(), updated_at = now(),
               failed_child = CASE WHEN ends_by_failure AND policy IS NOT NULL
                                   THEN NEW.id END
         WHERE id = NEW.parent_id;
        -- As outbox/runs/wakeups.py: NOTIFY only while a worker waits for one.
        IF EXISTS (SELECT 1 FROM {schema}.run_workers WHERE idle_until > now()) THEN
            PERFORM pg_notify({runs_channel}, workflow_name);
        END IF;
    END IF;
    RETURN NULL;
END
$$;
