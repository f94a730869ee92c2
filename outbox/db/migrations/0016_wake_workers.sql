-- outboxkit 0016: no run is missed by a worker that just went idle (outbox/runs/wakeups.py).
--
-- A statement that makes a run claimable NOTIFYs only while some worker has declared itself
-- idle. Reading that in the statement's own snapshot left a gap: a statement that began
-- before a worker's declaration committed saw no idle worker (no NOTIFY), and if its
-- transaction committed after the worker's claim-once-more, the run waited for the fallback
-- poll (30 s by default). wake_workers closes it with a lock, then a fresh look:
--
-- * it takes a shared transaction-scoped advisory lock (a key of its own, two-int form, so
--   never emit's bigint keys) BEFORE it reads run_workers; a VOLATILE function reads in a
--   snapshot taken after that, so a declaration committed before the lock is seen (NOTIFY);
-- * a worker that has just declared itself idle claims once more only after it could take
--   the same key exclusively (pg_try_advisory_xact_lock in autocommit: it never queues, and
--   it is dropped with its statement): every transaction that looked before the declaration
--   has then ended, and that claim sees its run.
--
-- For READ COMMITTED transactions (the default); one at REPEATABLE READ or SERIALIZABLE reads
-- the declarations as of its start, and may still leave its run to the fallback poll.
--
-- The shared lock costs a commit a lock-table entry, none of NOTIFY's database-wide lock.
-- wake_parent (0015) now wakes workers through it too.
CREATE OR REPLACE FUNCTION {schema}.wake_workers(workflow text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(1869313906, hashtext({runs_channel}));
    IF EXISTS (SELECT 1 FROM {schema}.run_workers WHERE idle_until > now()) THEN
        PERFORM pg_notify({runs_channel}, workflow);
        RETURN true;
    END IF;
    RETURN false;
END
$$;

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
        IF released IS NOT NULL THEN
            PERFORM {schema}.wake_workers(released);
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
        PERFORM {schema}.wake_workers(workflow_name);
    END IF;
    RETURN NULL;
END
$$;
