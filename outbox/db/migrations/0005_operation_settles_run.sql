-- outboxkit 0005: what settling an operation does to the agent run that waits on it.
--
-- Whatever settles a run-linked operation (the call's own answer, a reconciler's status
-- query, a person's resolution) settles its run in the same transaction (dedup/operations.py).
-- 'finish': confirmed -> the run is done, rejected -> failed, with the outside system's
-- evidence (the default: resuming a worker that does not check its checkpoint could repeat
-- the effect). 'resume': the run goes back to running, so its worker's next claim carries on
-- with the evidence in last_evidence (agents with more steps after the call).
-- outbox/tables.py describes the same column (section "operations (migration 0004)").

ALTER TABLE {schema}.operations
    ADD COLUMN on_settle text NOT NULL DEFAULT 'finish',
    ADD CONSTRAINT operations_on_settle_check CHECK (on_settle IN ('finish', 'resume'));
