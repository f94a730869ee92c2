-- outboxkit 0014: compensation (outbox/runs/compensation.py).
--
-- An effect a step emits may declare the effect that undoes it (its compensation). run_effects
-- keeps one row per such effect, written in the step's transaction with the message itself.
-- When the run fails, is cancelled, or a step decides to undo, compensating_since is set and
-- the worker runs the compensation instead of the workflow's steps: the last confirmed effect
-- first, each compensation emitted once (its message id derived from the original's) and
-- settled like any effect before the next one is emitted.
-- outbox/db/tables.py describes the same table and column.
ALTER TABLE {schema}.agent_runs ADD COLUMN compensating_since timestamptz;

CREATE TABLE {schema}.run_effects (
    run_id                 uuid        NOT NULL REFERENCES {schema}.agent_runs (id),
    seq                    bigserial   NOT NULL,   -- emit order
    message_id             uuid        NOT NULL,   -- the effect's outbox message
    type                   text        NOT NULL,   -- its envelope's type
    compensation           jsonb       NOT NULL,   -- the envelope that undoes it
    state                  text        NOT NULL DEFAULT 'open',
    evidence               jsonb,                  -- how the effect's outcome was learnt
    compensation_id        uuid,                   -- the compensation's message, once emitted
    compensation_evidence  jsonb,                  -- how the compensation's outcome was learnt
    created_at             timestamptz NOT NULL DEFAULT now(),
    decided_at             timestamptz,
    PRIMARY KEY (seq),
    UNIQUE (message_id),
    CONSTRAINT run_effects_state_check CHECK (state IN
        ('open', 'compensating', 'compensated', 'not-applied', 'refused', 'kept'))
);
CREATE INDEX run_effects_run_idx ON {schema}.run_effects (run_id, seq);
-- A compensation learns an effect's outcome from the operations of its message (whatever
-- run_id, if any, the consumer recorded them with).
CREATE INDEX operations_message_idx ON {schema}.operations (message_id)
    WHERE message_id IS NOT NULL;
