-- outboxkit 0019: a run's events, numbered in commit order (outbox/runs/events.py).
--
-- A web page follows a run as a stream of events (its moves, its log entries, the effects it
-- sent and the confirmations of them, its approvals) and, after a disconnect, asks for the
-- events after the last number it saw. For that, the number must be given in commit order:
-- "after N" must never miss an event that committed after N was read. The source tables'
-- own ids cannot say it: a bigserial is drawn when the row is inserted, and the writers of
-- one run (its worker, a consumer's confirmation, an operator's cancel, a person's grant)
-- commit in any order, so id 7 can commit after a reader saw id 8. Nor can their times.
--
-- So every source row of a run queues an event, and the events of a transaction are
-- numbered at its COMMIT, by constraint triggers deferred to the commit:
--
-- * each takes the next number of its run from run_event_heads (one row per run, upserted),
--   whose row lock it holds until the transaction has committed. The next writer of the run
--   waits for that lock, then adds one to the head as that commit left it (an upsert updates
--   the latest committed row, not its snapshot's): per run, the numbers go up in commit
--   order, gap-free (a transaction that fails after it took numbers gives them back with the
--   head row's change). A reader of "seq > N" sees, at any moment, every number up to the
--   highest it sees, and no later commit can add one below it;
-- * a transaction that rolls back never numbers anything: its deferred triggers never run,
--   so an event that did not commit does not exist, even for a moment;
-- * the events hold references to their source rows (ref, ref_key), joined when read, not
--   copies of payloads: one small row per event.
--
-- Why deferred, and why a table of its own for the counter, not a column of agent_runs: a
-- lock taken at COMMIT, after every statement of the transaction, is the last lock it takes;
-- whoever holds a head waits for nothing more. Taken earlier, it would join lock orders that
-- exist today in opposite directions: a revoke locks the approval then (here) the run, while
-- the worker spending that approval holds the run's row, then locks the approval. With the
-- counter in agent_runs, both would also wait on the run's row itself, and a fenced emit's
-- FOR SHARE would have to be upgraded by two holders at once. The head rows are locked by
-- nothing else, and nothing references them (a foreign key would take a key-share lock on
-- agent_runs at commit, which a claim's FOR UPDATE blocks). One ordering remains: a
-- transaction that writes events of several runs takes their heads in the order it wrote the
-- rows, so two transactions writing the same two runs in opposite orders can wait for each
-- other at commit (PostgreSQL then aborts one, as for emit's keys): write several runs'
-- events in one order. For READ COMMITTED transactions (the default): at REPEATABLE READ or
-- SERIALIZABLE, a head another transaction moved since the snapshot fails the commit with a
-- serialization error, to be retried as any other. A transaction that runs SET CONSTRAINTS
-- ALL IMMEDIATE numbers its events at once instead: still in commit order, holding the head
-- longer. A prepared transaction (two-phase commit) holds its heads until COMMIT PREPARED.
--
-- SECURITY DEFINER: the trigger writes the events with the rights of the migration's role,
-- so a role that writes the source tables (the console's, a consumer's) needs no grant on
-- these two tables, and no role writes events directly. search_path pinned, as such a
-- function must (every name in it is qualified anyway).
--
-- The cost (bench/run_events_bench.py, on 2 busy cores; docs/workflows.md): each event adds
-- about 23 us inside the server (a head upsert and a row), about 65 us to a writer's
-- transaction as its client sees it: a checkpoint save with one log entry 291 -> 357 us, with
-- four 359 -> 495 us, an emit of a run's message 457 -> 548 us. An emit without a run adds
-- nothing measurable (the WHEN clause: no event is queued, no function runs), nor does a save
-- without log entries.
CREATE TABLE {schema}.run_event_heads (
    run_id  uuid   NOT NULL,
    seq     bigint NOT NULL,   -- the run's last event number
    PRIMARY KEY (run_id)
);

CREATE TABLE {schema}.run_events (
    run_id   uuid        NOT NULL,
    seq      bigint      NOT NULL,   -- 1, 2, 3... per run, in commit order
    kind     text        NOT NULL,
    -- The source row: run_transitions.id (state), run_log.seq (log), outbox_messages.id
    -- (effect_sent) in ref; confirmations.confirmation_id, approvals.id, and the message's
    -- message_id (kept when retention drops the outbox row) in ref_key.
    ref      bigint,
    ref_key  text,
    at       timestamptz NOT NULL DEFAULT now(),   -- the writing transaction's time
    PRIMARY KEY (run_id, seq),
    CONSTRAINT run_events_kind_check CHECK (kind IN (
        'state', 'log', 'effect_sent', 'effect_confirmed', 'approval_requested',
        'approval_granted', 'approval_revoked', 'approval_spent'))
);

CREATE FUNCTION {schema}.record_run_event() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    kinds text[];
    event_kind text;
    ref_id bigint;
    key text;
    next_seq bigint;
BEGIN
    -- Compiled once per table the trigger is on: each branch reads only its table's columns.
    CASE TG_TABLE_NAME
    WHEN 'run_transitions' THEN
        kinds := ARRAY['state']; ref_id := NEW.id;
    WHEN 'run_log' THEN
        kinds := ARRAY['log']; ref_id := NEW.seq;
    WHEN 'outbox_messages' THEN
        kinds := ARRAY['effect_sent']; ref_id := NEW.id; key := NEW.message_id;
    WHEN 'confirmations' THEN
        kinds := ARRAY['effect_confirmed']; key := NEW.confirmation_id;
    ELSE  -- approvals
        key := NEW.id;
        IF TG_OP = 'INSERT' THEN
            kinds := ARRAY['approval_requested'];
        ELSE
            kinds := ARRAY[]::text[];
            IF OLD.granted_at IS NULL AND NEW.granted_at IS NOT NULL THEN
                kinds := kinds || 'approval_granted'::text;
            END IF;
            IF OLD.revoked_at IS NULL AND NEW.revoked_at IS NOT NULL THEN
                kinds := kinds || 'approval_revoked'::text;
            END IF;
            IF OLD.spent_at IS NULL AND NEW.spent_at IS NOT NULL THEN  -- migration 0018
                kinds := kinds || 'approval_spent'::text;
            END IF;
        END IF;
    END CASE;
    FOREACH event_kind IN ARRAY kinds LOOP
        INSERT INTO {schema}.run_event_heads AS h (run_id, seq) VALUES (NEW.run_id, 1)
        ON CONFLICT (run_id) DO UPDATE SET seq = h.seq + 1
        RETURNING h.seq INTO next_seq;
        INSERT INTO {schema}.run_events (run_id, seq, kind, ref, ref_key)
        VALUES (NEW.run_id, next_seq, event_kind, ref_id, key);
    END LOOP;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER run_transitions_event AFTER INSERT ON {schema}.run_transitions
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    EXECUTE FUNCTION {schema}.record_run_event();
CREATE CONSTRAINT TRIGGER run_log_event AFTER INSERT ON {schema}.run_log
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    EXECUTE FUNCTION {schema}.record_run_event();
-- A save may write an entry again (the last one, completed): an event when it changed.
CREATE CONSTRAINT TRIGGER run_log_rewritten_event AFTER UPDATE ON {schema}.run_log
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (OLD.entry IS DISTINCT FROM NEW.entry)
    EXECUTE FUNCTION {schema}.record_run_event();
-- Only a run's messages: an emit without a run queues nothing.
CREATE CONSTRAINT TRIGGER outbox_messages_event AFTER INSERT ON {schema}.outbox_messages
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (NEW.run_id IS NOT NULL)
    EXECUTE FUNCTION {schema}.record_run_event();
CREATE CONSTRAINT TRIGGER confirmations_event AFTER INSERT ON {schema}.confirmations
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    EXECUTE FUNCTION {schema}.record_run_event();
CREATE CONSTRAINT TRIGGER approvals_requested_event AFTER INSERT ON {schema}.approvals
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    EXECUTE FUNCTION {schema}.record_run_event();
CREATE CONSTRAINT TRIGGER approvals_event AFTER UPDATE ON {schema}.approvals
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (OLD.granted_at IS DISTINCT FROM NEW.granted_at
          OR OLD.revoked_at IS DISTINCT FROM NEW.revoked_at
          OR OLD.spent_at IS DISTINCT FROM NEW.spent_at)
    EXECUTE FUNCTION {schema}.record_run_event();

-- The triggers above were created by the migration's role; PostgreSQL checks EXECUTE only when
-- a trigger is created, so they keep firing. Nobody else may attach this SECURITY DEFINER
-- function to a table of their own (a TEMP one) and write events with its rights.
REVOKE EXECUTE ON FUNCTION {schema}.record_run_event() FROM PUBLIC;
