-- outboxkit 0013: child runs and their join (outbox/runs/children.py).
--
-- A step starts child runs (parent_id) and waits for them: awaits_children is how many must
-- be finished (done or failed) to wake it. A child's move to a finished state wakes its
-- parent through this trigger, in the child's transaction, whatever made the move (its
-- worker, a confirmation, an operator): no path can forget it.
ALTER TABLE {schema}.agent_runs ADD COLUMN parent_id uuid REFERENCES {schema}.agent_runs (id);
ALTER TABLE {schema}.agent_runs ADD COLUMN awaits_children integer;
CREATE INDEX agent_runs_parent_idx ON {schema}.agent_runs (parent_id)
    WHERE parent_id IS NOT NULL;

CREATE FUNCTION {schema}.wake_parent() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    parent_state text;
    needed integer;
    workflow_name text;
    finished integer;
BEGIN
    -- The parent's row first: children finishing at once take turns here, and each statement
    -- below reads a fresh snapshot, so the last of them counts all the others.
    SELECT state, awaits_children, workflow INTO parent_state, needed, workflow_name
      FROM {schema}.agent_runs WHERE id = NEW.parent_id FOR UPDATE;
    IF parent_state IS DISTINCT FROM 'waiting' OR needed IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT count(*) INTO finished FROM {schema}.agent_runs
     WHERE parent_id = NEW.parent_id AND state IN ('done', 'failed');
    IF finished >= needed THEN
        UPDATE {schema}.agent_runs
           SET not_before = now(), awaits_children = NULL, updated_at = now()
         WHERE id = NEW.parent_id;
        -- As outbox/runs/wakeups.py: NOTIFY only while a worker waits for one.
        IF EXISTS (SELECT 1 FROM {schema}.run_workers WHERE idle_until > now()) THEN
            PERFORM pg_notify({runs_channel}, workflow_name);
        END IF;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER agent_runs_wake_parent
    AFTER UPDATE OF state ON {schema}.agent_runs
    FOR EACH ROW
    WHEN (NEW.parent_id IS NOT NULL AND NEW.state IN ('done', 'failed')
          AND OLD.state NOT IN ('done', 'failed'))
    EXECUTE FUNCTION {schema}.wake_parent();
