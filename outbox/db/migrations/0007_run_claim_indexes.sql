-- outboxkit 0007: the run claim follows indexes in claim order instead of sorting the backlog.
--
-- A claim takes the oldest claimable run (created_at order): queued and due, running with an
-- expired lease, or waiting with a passed timer. Before, one statement ORed the three, which
-- no index can answer in created_at order: every claim scanned and sorted every runnable run
-- (~12 ms with 10,000 queued runs, 155-195 ms with 200,000). Now the claim (outbox/runs.py,
-- _due_probes) merges one index probe per way of being due:
--
-- * queued runs with no not_before (the deep backlog): this first index, in created_at
--   order, so the oldest is its first entry however many there are;
-- * queued or waiting runs with a not_before that has passed: agent_runs_runnable_idx
--   (state, not_before) from 0001, up to now(), then sorted;
-- * running runs whose lease expired (or has none): the second index, by expiry up to now().
--
-- now() cannot be in an index predicate, hence the timed probes read by time: runs that are
-- not due yet (far timers, delayed retries) are never read, and a claim costs the number of
-- timed runs already due, not the size of the queue. outbox/tables.py describes the same
-- indexes; a test proves they agree.
CREATE INDEX agent_runs_claim_queued_idx ON {schema}.agent_runs (created_at)
    WHERE state = 'queued' AND not_before IS NULL AND purged_at IS NULL;
CREATE INDEX agent_runs_claim_expired_idx ON {schema}.agent_runs (lease_expires_at)
    WHERE state = 'running' AND purged_at IS NULL;
