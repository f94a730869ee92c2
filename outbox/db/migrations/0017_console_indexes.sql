-- outboxkit 0017: the operator console's lists, newest first, page after page (console/).
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
