-- outboxkit 0012: named signals to runs (outbox/runs/signals.py).
--
-- A signal is kept here, once per (run, signal_id), until the run takes it
-- (received_at). A run that waits for signals names them in awaits_signals; a signal of one
-- of those names wakes it (not_before = now()). A claim clears awaits_signals: only the
-- wait that set it counts.
ALTER TABLE {schema}.agent_runs ADD COLUMN awaits_signals text[];

CREATE TABLE {schema}.run_signals (
    run_id      uuid        NOT NULL REFERENCES {schema}.agent_runs (id),
    signal_id   text        NOT NULL,
    name        text        NOT NULL,
    payload     jsonb,
    sender      text        NOT NULL,
    sent_at     timestamptz NOT NULL DEFAULT now(),
    received_at timestamptz,
    PRIMARY KEY (run_id, signal_id)
);
-- What a run has not taken yet, by name, oldest first.
CREATE INDEX run_signals_pending_idx ON {schema}.run_signals (run_id, name, sent_at)
    WHERE received_at IS NULL;
