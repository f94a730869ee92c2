-- outboxkit 0017: what the operator console reads (console/), by index at any size.
--
-- The runs list is read by keyset (created_at, id) < (last shown), never OFFSET, so a page
-- deep in a million runs costs what the first one does: one index range, with or without a
-- state filter.
CREATE INDEX agent_runs_newest_idx ON {schema}.agent_runs (created_at, id);
CREATE INDEX agent_runs_state_newest_idx ON {schema}.agent_runs (state, created_at, id);
-- The approvals still waiting on a person, soonest to expire first (the inbox; the overview
-- counts them): few rows, however many approvals history keeps.
CREATE INDEX approvals_pending_idx ON {schema}.approvals (expires_at)
    WHERE granted_at IS NULL AND revoked_at IS NULL;
-- A run's messages (its page in the console, `outbox runs show`): without it, a read of
-- every retained outbox row (67 ms with 1,000,000 kept). Only rows emitted by a run.
CREATE INDEX outbox_messages_run_idx ON {schema}.outbox_messages (run_id)
    WHERE run_id IS NOT NULL;
-- A dead letter an operator decided never to handle (the console, `outbox dlq discard`): the
-- row stays, saying who and why; its dedup mark stays too, so a redelivery is dropped.
ALTER TABLE {schema}.consumer_failures DROP CONSTRAINT consumer_failures_status_check;
ALTER TABLE {schema}.consumer_failures ADD CONSTRAINT consumer_failures_status_check
    CHECK (status IN ('retrying', 'recovered', 'dead-lettered', 'replayed', 'discarded'));
ALTER TABLE {schema}.consumer_failures ADD COLUMN discarded_by text;
ALTER TABLE {schema}.consumer_failures ADD COLUMN discard_reason text;
-- Who replayed a dead letter (the console's operator, `outbox dlq replay --actor`).
ALTER TABLE {schema}.consumer_failures ADD COLUMN replayed_by text;
