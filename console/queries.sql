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
-- its total and its table in one read), read as the relay's gauge reads them
-- (relay/queries.sql, backlog): the rows of transactions running at the cursor, and at most
-- :cap rows after it a lane, its (lane, xid) index in order. Past the cap, the lane's rest is
-- one more row without a topic (`estimated`), its count estimated from the spread of the ids
-- read; its topics are unknown (the rows read are the oldest, not a sample: a bulk insert
-- of one topic after another would show only the first). A refresh reads at most :cap rows
-- a lane whatever the backlog: an open page reads it every few seconds, in an incident
-- when the backlog is largest.
WITH q AS (
    SELECT l.lane, s.id, s.topic, s.created_at, s.sampled
    FROM {schema}.relay_lanes AS l
    CROSS JOIN LATERAL (
        (SELECT m.id, m.topic, m.created_at, false AS sampled
         FROM unnest(ARRAY(SELECT pg_snapshot_xip(l.cursor_snapshot))) AS x(xid)
         CROSS JOIN LATERAL (  -- a (lane, xid) probe per running transaction
             SELECT * FROM {schema}.outbox_messages AS r WHERE r.lane = l.lane AND r.xid = x.xid
             OFFSET 0
         ) AS m
         WHERE NOT {schema}.outbox_passed(m.xid, m.id, l.cursor_snapshot, l.batch_snapshot,
                                          l.batch_pos))
        UNION ALL
        (SELECT m.id, m.topic, m.created_at, true
         FROM {schema}.outbox_messages AS m
         WHERE m.lane = l.lane AND m.xid >= pg_snapshot_xmax(l.cursor_snapshot)
           AND NOT {schema}.outbox_passed(m.xid, m.id, l.cursor_snapshot, l.batch_snapshot,
                                          l.batch_pos)
         ORDER BY m.lane, m.xid
         LIMIT :cap)
    ) AS s
    WHERE l.lane < :lanes
),
t AS (
    SELECT lane, topic, count(*) AS n, min(created_at) AS oldest,
           sum(count(*) FILTER (WHERE sampled)) OVER w AS lane_read,
           min(min(id) FILTER (WHERE sampled)) OVER w AS lo,
           max(max(id) FILTER (WHERE sampled)) OVER w AS top
    FROM q GROUP BY lane, topic
    WINDOW w AS (PARTITION BY lane)
)
SELECT t.lane, t.topic, t.oldest,
       greatest(0, extract(epoch FROM clock_timestamp() - t.oldest)) AS age,
       false AS estimated, t.n
FROM t
UNION ALL
SELECT e.lane, NULL, NULL, NULL, true,
       floor(greatest(0, (SELECT max(m.id) FROM {schema}.outbox_messages AS m
                          WHERE m.lane = e.lane) - e.top)
             * (e.lane_read - 1) / greatest(e.top - e.lo, 1))::bigint
FROM (SELECT DISTINCT lane, lane_read, lo, top FROM t) AS e
WHERE e.lane_read >= :cap
ORDER BY 1, 2 NULLS LAST
