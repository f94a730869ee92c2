-- outboxkit 0013: child runs and their join (outbox/runs/children.py).
--
-- A step starts child runs (parent_id) and waits for them: awaits_children is how many of the
-- children started since its previous join (children_since) must be finished (done or
-- failed) to wake it. A child's move to a finished state wakes its parent through this
-- trigger, whatever made the move (its worker, a confirmation, an operator): no path can
-- forget it.
ALTER TABLE {schema}.agent_runs ADD COLUMN parent_id uuid REFERENCES {schema}.agent_runs (id);
ALTER TABLE {schema}.agent_runs ADD COLUMN awaits_children integer;
ALTER TABLE {schema}.agent_runs ADD COLUMN children_since timestamptz;
CREATE INDEX agent_runs_parent_idx ON {schema}.agent_runs (parent_id, created_at)
    WHERE parent_id IS NOT NULL;

CREATE FUNCTION {schema}.wake_parent() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    parent_state text;
    needed integer;
    since timestamptz;
    workflow_name text;
    finished integer;
BEGIN
    -- The parent's row first: children finishing at once take turns here, and each statement
    -- below reads a fresh snapshot, so the last of them counts all the others. NO KEY UPDATE:
    -- the key-share locks of children being inserted by the parent's step do not block it.
    SELECT state, awaits_children, children_since, workflow
      INTO parent_state, needed, since, workflow_name
      FROM {schema}.agent_runs WHERE id = NEW.parent_id FOR NO KEY UPDATE;
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

-- Deferred to the commit: a transaction that finishes several children (or a child and
-- other rows) locks their parent once, after all its own row locks, so two such
-- transactions cannot wait for each other's children and parent crosswise.
CREATE CONSTRAINT TRIGGER agent_runs_wake_parent
    AFTER UPDATE OF state ON {schema}.agent_runs
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.parent_id IS NOT NULL AND NEW.state IN ('done', 'failed')
          AND OLD.state NOT IN ('done', 'failed'))
    EXECUTE FUNCTION {schema}.wake_parent();
