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

-- name: backlog_by_topic
-- The outbox rows no lane's cursor has passed, by lane and topic (the overview's backlog,
-- its total and its table in one read): the relay's own backlog read (relay/queries.sql,
-- backlog), counted up to :cap rows a lane, kept apart per topic.
SELECT l.lane, q.topic, count(*) AS n, min(q.created_at) AS oldest,
       greatest(0, extract(epoch FROM clock_timestamp() - min(q.created_at))) AS age
FROM {schema}.relay_lanes AS l
CROSS JOIN LATERAL (
    SELECT m.topic, m.created_at FROM {schema}.outbox_messages AS m
    WHERE m.lane = l.lane
      AND (m.xid >= pg_snapshot_xmax(l.cursor_snapshot)
           OR m.xid = ANY(ARRAY(SELECT pg_snapshot_xip(l.cursor_snapshot))))
      AND NOT {schema}.outbox_passed(m.xid, m.id, l.cursor_snapshot, l.batch_snapshot,
                                     l.batch_pos)
    LIMIT :cap
) AS q
WHERE l.lane < :lanes
GROUP BY l.lane, q.topic
ORDER BY l.lane, q.topic
