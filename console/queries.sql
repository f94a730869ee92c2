-- The console's SQL that is not a library call. ``{schema}`` is the configured schema.

-- name: console_role_grants
-- The least privilege of the console's database role ({role}: console.roles.console_grants).
-- A script, not a statement: several GRANTs, run as they are. It reads what its pages show
-- and writes only what an operator's action writes (a run's move and its history, an
-- operation's resolution and its event, an approval, a refused row's retry); it deletes
-- nothing, and cannot touch the relays' leases and proofs or the consumers' dedup marks.
-- A run's events are written by migration 0019's triggers with their owner's rights: the
-- role only reads them.
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT ON {schema}.agent_runs, {schema}.run_transitions, {schema}.run_log,
    {schema}.approvals, {schema}.operations, {schema}.operation_events,
    {schema}.outbox_messages, {schema}.outbox_failures, {schema}.deliveries,
    {schema}.message_status, {schema}.relays, {schema}.relay_lanes, {schema}.run_workers,
    {schema}.run_effects, {schema}.workflows, {schema}.consumer_failures,
    {schema}.confirmations, {schema}.run_events TO {role};
GRANT UPDATE ON {schema}.agent_runs, {schema}.operations,
    {schema}.outbox_failures, {schema}.run_effects, {schema}.consumer_failures TO {role};
-- A grant and a revoke only: never the digest, nor what spending an approval writes.
GRANT UPDATE (granted_by, granted_at, grant_reason, revoked_by, revoked_at, reason)
    ON {schema}.approvals TO {role};
GRANT INSERT ON {schema}.run_transitions, {schema}.operation_events,
    {schema}.confirmations TO {role};
GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schema} TO {role};

-- name: console_role_replay_grants
-- What replaying dead letters adds (console.roles.console_grants(..., replay=True)): the
-- replayed message's dedup mark removed (or put back if Kafka refused).
GRANT SELECT, INSERT, DELETE ON {schema}.consumer_inbox TO {role};
