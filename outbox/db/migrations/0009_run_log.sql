-- outboxkit 0009: a run's append-only log, written with the run's fenced checkpoint.
--
-- A durable agent (agents/) keeps its message history here, one entry per message, instead
-- of in the checkpoint: rewriting the whole history at every step made a step cost in
-- proportion to the conversation (a 64 KB checkpoint write took four times a 2 KB one) and
-- capped a conversation at max_checkpoint_bytes. A save adds the new entries (and may rewrite
-- the last one, a request the model had not been sent yet) in the statement that checks the
-- lease, so a stale worker adds nothing. The checkpoint says how many entries are the run's.
CREATE TABLE {schema}.run_log (
    run_id uuid    NOT NULL REFERENCES {schema}.agent_runs (id),
    seq    integer NOT NULL CHECK (seq >= 0),
    entry  jsonb   NOT NULL,
    PRIMARY KEY (run_id, seq)
);

-- Retention drops a purged run's log; archive=True keeps it here, as a JSON array.
ALTER TABLE {schema}.run_archive ADD COLUMN log jsonb;
