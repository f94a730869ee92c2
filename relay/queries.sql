-- The relay's SQL. Each query follows its `-- name:` marker; the comment lines right after
-- the marker describe it (the loader, outbox.queries, keeps them out of the statement's
-- text). {schema} is the configured schema, quoted by outbox.queries.quote_identifier.
-- Parameters: `%(name)s` (psycopg's) for the daemon's queries, run on its own pool
-- (outbox.db.pool); `:name` for those the commands run as text() (status, rebase).

-- name: claim_messages
-- Per owned lane (fenced by the join on relay_lanes: a relay whose lane was taken over reads
-- nothing there), the first rows of the lane's difference in id order, up to %(more)s. They
-- come from two parts, each through an index, in id order and limited:
--   b. a range of (lane, id) from lo to hi, the smallest and largest id of the rows of
--      transactions that started after the cursor (xid >= its xmax), computed once per target
--      from (lane, xid) and then passed back by the relay; the filter is the whole difference
--      (visible in the target, not in the cursor), so it also takes the rows of transactions
--      that were running at the cursor when their ids fall in the range;
--   a. the rest of those: rows of the cursor's running transactions (its xip list, a probe
--      on (lane, xid) each) outside the range; they may have low ids (a late commit).
-- The two are merged by id here and limited again, so a lane's rows are always the smallest
-- ids of its difference: the outer LIMIT, which cuts the last lane read, only shortens that
-- prefix. (Merged by the relay instead, a part cut at its limit bounded the other, and a
-- lane could advance a few rows per claim.)
-- The relay's own cursors are used only while the server is the incarnation they were read
-- under (relay_server, relay/history.py); otherwise, and for a lane the relay knows
-- nothing about (first read, or its token changed), the cursor stored in relay_lanes is.
-- `behind`: relay_history names another cluster than this one, or the cursor or target
-- counts transaction ids the server has not issued yet: this database's ids are not the
-- history the cursors were taken in (a restore or a move into another cluster;
-- relay/history.py). There is no ORDER BY across lanes: the nested loop
-- over the lanes stops as soon as the limit's rows came out. Run as driver SQL on the
-- claim's own connection (relay.claims.CLAIM_PLANNER).
WITH s AS MATERIALIZED (
    SELECT (SELECT incarnation FROM {schema}.relay_server) AS incarnation,
           pg_current_snapshot() AS now,
           -- Another cluster's ids (a restore, a move): nothing is read until a rebase.
           coalesce((SELECT h.system_identifier <> c.system_identifier
                     FROM {schema}.relay_history AS h, pg_control_system() AS c), true) AS moved
),
o AS MATERIALIZED (
    SELECT o.*, o.known AND s.incarnation = CAST(%(incarnation)s AS uuid) AS ours
    FROM unnest(CAST(%(lanes)s AS int[]), CAST(%(tokens)s AS bigint[]),
                CAST(%(known)s AS bool[]), CAST(%(snaps)s AS text[]),
                CAST(%(targets)s AS text[]), CAST(%(pos)s AS bigint[]),
                CAST(%(floors)s AS bigint[]), CAST(%(ceils)s AS bigint[]))
         WITH ORDINALITY AS o(lane, token, known, snap, target, pos, floor, ceil, ord)
    CROSS JOIN s
),
c AS MATERIALIZED (
    SELECT o.ord, o.lane, o.token, s.incarnation,
           CASE WHEN o.ours THEN CAST(o.snap AS pg_snapshot) ELSE l.cursor_snapshot END AS snap,
           coalesce(CASE WHEN o.ours THEN CAST(o.target AS pg_snapshot) ELSE l.batch_snapshot END,
                    s.now) AS target,
           CASE WHEN o.ours THEN o.pos ELSE l.batch_pos END AS pos,
           CASE WHEN o.ours THEN o.floor END AS floor, CASE WHEN o.ours THEN o.ceil END AS ceil,
           s.now, s.moved
    FROM o CROSS JOIN s
    JOIN {schema}.relay_lanes AS l
      ON l.lane = o.lane AND l.token = o.token AND l.owner = %(relay_id)s
     AND l.expires_at > now()
),
b AS (
    SELECT c.*, coalesce(c.floor, r.lo, 0) AS lo, coalesce(c.ceil, r.hi, -1) AS hi,
           c.moved OR pg_snapshot_xmax(c.snap) > pg_snapshot_xmax(c.now)
               OR pg_snapshot_xmax(c.target) > pg_snapshot_xmax(c.now) AS behind
    FROM c
    LEFT JOIN LATERAL (
        -- "+ 0": an aggregate, not the planner's min/max shortcut, which would walk the lane's
        -- (lane, id) index from its oldest row instead of the (lane, xid) range.
        SELECT min(m.id + 0) AS lo, max(m.id + 0) AS hi FROM {schema}.outbox_messages AS m
        WHERE c.floor IS NULL AND m.lane = c.lane
          AND m.xid >= pg_snapshot_xmax(c.snap) AND m.xid < pg_snapshot_xmax(c.target)
          AND pg_visible_in_snapshot(m.xid, c.target)
    ) AS r ON true
)
-- First one row per lane with its cursor (id NULL), then the lanes' rows shaped for the
-- producer: no lane data repeated on every row (relay.claims._reads tells them apart by id).
SELECT b.ord, b.lane, CAST(b.snap AS text), CAST(b.target AS text), b.pos, b.lo, b.hi,
       b.incarnation, b.behind,
       -- Whether to read outbox_failures too (a blocked key, a retry): almost never.
       EXISTS (SELECT 1 FROM {schema}.outbox_failures AS f
               WHERE f.lane = ANY(CAST(%(lanes)s AS int[]))
                 AND (f.state <> 'failed' OR f.blocking)) AS failures,
       NULL::bigint, NULL::text, NULL::bytea, NULL::bytea, NULL::text, NULL::text,
       NULL::text, NULL::float8
FROM b
UNION ALL
SELECT NULL, b.lane, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       p.id, p.topic, p.key, p.payload, CAST(p.headers AS text), p.message_type,
       CAST(p.message_id AS text), date_part('epoch', p.created_at)
FROM b
JOIN LATERAL (
    SELECT q.* FROM (
        (SELECT m.id, m.message_id, m.topic, m.key, m.message_type, m.payload, m.headers,
                m.created_at
         FROM unnest(ARRAY(SELECT pg_snapshot_xip(b.snap))) AS x(xid)
         CROSS JOIN LATERAL (  -- a (lane, xid) probe per running transaction
             SELECT * FROM {schema}.outbox_messages AS r
             WHERE r.lane = b.lane AND r.xid = x.xid AND pg_visible_in_snapshot(r.xid, b.target)
             OFFSET 0  -- kept a subquery: a probe per transaction, never a scan of the lane
         ) AS m
         WHERE NOT b.behind AND (m.id < b.lo OR m.id > b.hi) AND m.id > b.pos
         ORDER BY m.id LIMIT %(more)s)
        UNION ALL
        (SELECT m.id, m.message_id, m.topic, m.key, m.message_type, m.payload, m.headers,
                m.created_at
         FROM {schema}.outbox_messages AS m
         -- Row comparisons (they pin the lane too): the (lane, id) index serves them in the
         -- order asked for, so the scan stops at the limit.
         WHERE b.lo <= b.hi AND NOT b.behind  -- no such rows: no scan at all
           AND (m.lane, m.id) >= (b.lane, greatest(b.pos + 1, b.lo))
           AND (m.lane, m.id) <= (b.lane, b.hi)
           AND pg_visible_in_snapshot(m.xid, b.target)
           AND NOT pg_visible_in_snapshot(m.xid, b.snap)
         ORDER BY m.lane, m.id LIMIT %(more)s)
    ) AS q
    ORDER BY q.id LIMIT %(more)s
) AS p ON true
LIMIT %(outer)s

-- name: ensure_incarnation
-- The server's incarnation, made when crash recovery or a promotion emptied the table (or on
-- the first claim after the migration). Unlogged: the commit writes no WAL for it.
INSERT INTO {schema}.relay_server DEFAULT VALUES ON CONFLICT (one) DO NOTHING

-- name: blocked_keys
-- The keys of a claim's rows (and of its retried rows) that something in outbox_failures
-- holds back (block mode): 'held' behind a refusal not retried yet, else 'retry' while an
-- operator's retry of the key is under way. One index probe per key, whatever the number of
-- failure rows of other keys.
SELECT k.lane, k.topic, k.key,
       CASE WHEN EXISTS (SELECT 1 FROM {schema}.outbox_failures AS f
                         WHERE f.lane = k.lane AND f.topic = k.topic AND f.key = k.key
                           AND (f.state = 'held' OR (f.state = 'failed' AND f.blocking)))
            THEN 'held' ELSE 'retry' END AS state
FROM unnest(CAST(%(lanes)s AS int[]), CAST(%(topics)s AS text[]), CAST(%(keys)s AS bytea[]))
     AS k(lane, topic, key)
-- Keyless rows have no order to keep: never held back (k.key IS NULL matches nothing).
WHERE EXISTS (SELECT 1 FROM {schema}.outbox_failures AS f
              WHERE f.lane = k.lane AND f.topic = k.topic AND f.key = k.key
                AND (f.state <> 'failed' OR f.blocking))

-- name: claim_retries
-- Rows an operator asked to retry, of the owned lanes, in id order, each only when no row of
-- its key before it is still held back or refused; with payloads, up to %(limit)s.
SELECT f.id, f.message_id, f.topic, f.key, f.message_type, f.payload, f.headers, f.created_at,
       f.run_id, f.lane
FROM {schema}.outbox_failures AS f
WHERE f.lane = ANY(CAST(%(lanes)s AS int[])) AND f.state = 'retry'
  AND NOT EXISTS (SELECT 1 FROM {schema}.outbox_failures AS h
                  WHERE h.lane = f.lane AND h.topic = f.topic AND h.key = f.key
                    AND h.id < f.id
                    AND (h.state = 'held' OR (h.state = 'failed' AND h.blocking)))
ORDER BY f.lane, f.id
LIMIT %(limit)s

-- name: record_batch
-- One statement records a clean batch: the proof per lane, and the lanes' cursors, fenced.
-- The proof comes grouped by the relay (relay.claims._proofs): one element per (lane, token),
-- its ids in order with their partitions and offsets as array literals, parsed here per row
-- (grouping and sorting a thousand unnested rows here cost PostgreSQL twice as much).
-- Run as driver SQL (relay.claims.record).
WITH proof AS (
    INSERT INTO {schema}.deliveries
        (lane, relay_id, token, first_id, last_id, ids, partitions, offsets)
    SELECT p.lane, %(relay_id)s, p.token, p.first_id, p.last_id, CAST(p.ids AS bigint[]),
           CAST(p.partitions AS int[]), CAST(p.offsets AS bigint[])
    FROM unnest(CAST(%(lanes)s AS int[]), CAST(%(tokens)s AS bigint[]),
                CAST(%(first_ids)s AS bigint[]), CAST(%(last_ids)s AS bigint[]),
                CAST(%(ids)s AS text[]), CAST(%(partitions)s AS text[]),
                CAST(%(offsets)s AS text[]))
         AS p(lane, token, first_id, last_id, ids, partitions, offsets)
    RETURNING lane
),
locked AS (  -- in lane order, as every statement writing several lanes (relay/lanes.py)
    SELECT lane FROM {schema}.relay_lanes
    WHERE lane = ANY(CAST(%(c_lanes)s AS int[])) AND owner = %(relay_id)s ORDER BY lane FOR UPDATE
),
moved AS (
    UPDATE {schema}.relay_lanes AS l
    SET cursor_snapshot = CAST(c.snap AS pg_snapshot),
        batch_snapshot = CAST(c.target AS pg_snapshot), batch_pos = c.pos,
        published_count = l.published_count + c.n, last_error = NULL, last_error_at = NULL
    FROM unnest(CAST(%(c_lanes)s AS int[]), CAST(%(c_tokens)s AS bigint[]), CAST(%(c_snaps)s AS text[]),
                CAST(%(c_targets)s AS text[]), CAST(%(c_pos)s AS bigint[]), CAST(%(c_n)s AS bigint[]))
         AS c(lane, token, snap, target, pos, n), locked AS k
    WHERE l.lane = c.lane AND k.lane = c.lane AND l.token = c.token AND l.owner = %(relay_id)s
      -- Only on the server the batch was read from (relay/history.py): a cursor from
      -- before a crash-restart or a promotion may count re-issued transaction ids as seen.
      AND EXISTS (SELECT 1 FROM {schema}.relay_server
                  WHERE incarnation = CAST(%(incarnation)s AS uuid))
    RETURNING l.lane
)
SELECT (SELECT count(*) FROM proof) AS proofs, (SELECT array_agg(lane) FROM moved) AS moved,
       -- A clean batch's record need not wait for the WAL flush (see the daemon): said in the
       -- statement itself, so that it can run alone, as its own transaction.
       set_config('synchronous_commit', CASE WHEN %(durable)s THEN 'on' ELSE 'off' END, true)
           AS synchronous_commit

-- name: lock_failures
-- Writes to outbox_failures that decide a key's state (the relay's record of refused and
-- set-aside rows, an operator's retry) take turns: a row set aside as held while an operator
-- retried its key would otherwise be held with nothing before it, for good.
SELECT pg_advisory_xact_lock(%(k)s)

-- name: record_failures
-- A refused row is copied whole: retention may delete the outbox row long before an operator
-- looks at it. A retried row refused again is updated in place. A row set aside ('aside':
-- its key was blocked when it was claimed) is 'held' if its key is still held back, by a row
-- before it in the table or in this batch, and 'retry' otherwise (an operator retried the key
-- meanwhile: it follows the retried rows). Fenced as the cursors are: only rows of lanes this
-- relay still holds with the batch's token, on the server the batch was read from.
INSERT INTO {schema}.outbox_failures
    (id, message_id, topic, key, lane, message_type, payload, headers, run_id, created_at,
     state, blocking, error, dlq_partition, dlq_offset)
SELECT r.id, r.message_id, r.topic, r.key, r.lane, r.message_type, r.payload,
       CAST(r.headers AS jsonb),
       -- A claimed row comes without its run (the claim returns only what a record needs):
       -- read here, from the row that is still there, for the few that fail.
       coalesce(r.run_id, (SELECT m.run_id FROM {schema}.outbox_messages AS m WHERE m.id = r.id)),
       r.created_at,
       CASE WHEN r.state <> 'aside' THEN r.state
            WHEN EXISTS (SELECT 1 FROM {schema}.outbox_failures AS f
                         WHERE f.lane = r.lane AND f.topic = r.topic AND f.key = r.key
                           AND f.id < r.id
                           AND (f.state = 'held' OR (f.state = 'failed' AND f.blocking)))
              OR EXISTS (SELECT 1 FROM unnest(CAST(%(lanes)s AS int[]), CAST(%(topics)s AS text[]),
                                              CAST(%(keys)s AS bytea[]), CAST(%(ids)s AS bigint[]),
                                              CAST(%(blocking)s AS bool[]))
                                       AS e(lane, topic, key, id, blocking)
                         WHERE e.blocking AND e.lane = r.lane AND e.topic = r.topic
                           AND e.key = r.key AND e.id < r.id)
            THEN 'held' ELSE 'retry' END,
       r.blocking, r.error, r.dlq_partition, r.dlq_offset
FROM unnest(CAST(%(ids)s AS bigint[]), CAST(%(message_ids)s AS uuid[]), CAST(%(topics)s AS text[]),
            CAST(%(keys)s AS bytea[]), CAST(%(lanes)s AS int[]), CAST(%(types)s AS text[]),
            CAST(%(payloads)s AS bytea[]), CAST(%(headers)s AS text[]), CAST(%(run_ids)s AS uuid[]),
            CAST(%(created)s AS timestamptz[]), CAST(%(states)s AS text[]), CAST(%(blocking)s AS bool[]),
            CAST(%(errors)s AS text[]), CAST(%(dlq_partitions)s AS int[]), CAST(%(dlq_offsets)s AS bigint[]),
            CAST(%(tokens)s AS bigint[]))
     AS r(id, message_id, topic, key, lane, message_type, payload, headers, run_id, created_at,
          state, blocking, error, dlq_partition, dlq_offset, token)
JOIN {schema}.relay_lanes AS l
  ON l.lane = r.lane AND l.token = r.token AND l.owner = %(relay_id)s
WHERE EXISTS (SELECT 1 FROM {schema}.relay_server WHERE incarnation = CAST(%(incarnation)s AS uuid))
ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state, blocking = EXCLUDED.blocking,
    error = coalesce(EXCLUDED.error, {schema}.outbox_failures.error), failed_at = now(),
    dlq_partition = EXCLUDED.dlq_partition, dlq_offset = EXCLUDED.dlq_offset

-- name: forget_failures
-- Retried rows that Kafka has now acknowledged leave the failures.
DELETE FROM {schema}.outbox_failures WHERE id = ANY(CAST(%(ids)s AS bigint[]))

-- name: note_error
-- Why the lanes' rows wait (a transient failure), for `outbox status`.
WITH locked AS (  -- in lane order, as every statement writing several lanes (relay/lanes.py)
    SELECT lane FROM {schema}.relay_lanes
    WHERE lane = ANY(CAST(%(lanes)s AS int[])) AND owner = %(relay_id)s ORDER BY lane FOR UPDATE
)
UPDATE {schema}.relay_lanes AS l SET last_error = %(error)s, last_error_at = now()
FROM locked WHERE l.lane = locked.lane AND l.owner = %(relay_id)s

-- name: ensure_lanes
-- Every lane has its row (the lanes are a fixed number, OutboxSettings.lanes).
INSERT INTO {schema}.relay_lanes (lane)
SELECT generate_series(0, %(lanes)s - 1)
ON CONFLICT (lane) DO NOTHING

-- name: upsert_relay
-- The relay's heartbeat row; returns how many relays are live, this one included.
INSERT INTO {schema}.relays (relay_id, host, pid, started_at, heartbeat_at, idle)
VALUES (%(relay_id)s, %(host)s, %(pid)s, now(), now(), false)
ON CONFLICT (relay_id) DO UPDATE SET heartbeat_at = now(), host = EXCLUDED.host,
    pid = EXCLUDED.pid
RETURNING (SELECT count(*) FROM {schema}.relays
           WHERE heartbeat_at > now() - make_interval(secs => %(lease)s)
             AND relay_id <> %(relay_id)s) + 1 AS live

-- name: renew_lanes
-- Every statement that writes several of a relay's lane rows locks them in lane order first
-- (the heartbeat here, the record of a batch on the marking thread, giving lanes back): two
-- such statements locking them in different orders deadlock, and PostgreSQL takes a second
-- (deadlock_timeout) to notice, a second in which nothing is published.
WITH locked AS (
    SELECT lane FROM {schema}.relay_lanes
    WHERE owner = %(relay_id)s AND expires_at > now() ORDER BY lane FOR UPDATE
)
UPDATE {schema}.relay_lanes AS l SET expires_at = now() + make_interval(secs => %(lease)s)
FROM locked WHERE l.lane = locked.lane AND l.owner = %(relay_id)s AND l.expires_at > now()
RETURNING l.lane, l.token

-- name: acquire_lanes
-- Free or expired lanes, up to the relay's fair share; each one taken bumps its token.
UPDATE {schema}.relay_lanes AS l
SET owner = %(relay_id)s, token = l.token + 1,
    expires_at = now() + make_interval(secs => %(lease)s)
FROM (SELECT lane FROM {schema}.relay_lanes
      WHERE lane < %(lanes)s AND (owner IS NULL OR expires_at <= now())
      ORDER BY lane LIMIT %(wanted)s FOR UPDATE SKIP LOCKED) AS free
WHERE l.lane = free.lane
RETURNING l.lane, l.token

-- name: others_expire
-- Seconds until the soonest lease of another relay runs out. A live relay renews every third
-- of a lease, so its leases always have more than two thirds to run: a sooner expiry means
-- its owner missed a renewal (dead, or stuck), and the lanes are free at that moment.
SELECT extract(epoch FROM min(expires_at) - now()) FROM {schema}.relay_lanes
WHERE lane < %(lanes)s AND owner IS NOT NULL AND owner <> %(relay_id)s AND expires_at > now()

-- name: release_lanes
-- Give lanes back (more than the fair share, or stopping), locked in lane order.
WITH locked AS (
    SELECT lane FROM {schema}.relay_lanes
    WHERE owner = %(relay_id)s AND lane = ANY(%(lanes)s) ORDER BY lane FOR UPDATE
)
UPDATE {schema}.relay_lanes AS l SET owner = NULL, expires_at = NULL
FROM locked WHERE l.lane = locked.lane AND l.owner = %(relay_id)s

-- name: leave
-- A relay stopping cleanly leaves the list of relays.
DELETE FROM {schema}.relays WHERE relay_id = %(relay_id)s

-- name: forget_dead_relays
-- A dead relay stays listed (as dead, in `outbox status`) a few leases, then goes.
DELETE FROM {schema}.relays WHERE heartbeat_at < now() - make_interval(secs => %(horizon)s)

-- name: set_idle
-- The relay declares itself idle (emits then NOTIFY) or busy (relay/wakeup.py).
UPDATE {schema}.relays SET idle = %(idle)s WHERE relay_id = %(relay_id)s

-- name: commit_without_flush
-- A hint, not state (the idle flag): its commit need not wait for the WAL flush.
SET LOCAL synchronous_commit TO off

-- name: status_counts
-- One pass over the outbox (a command run by hand, not a metric): each row is published when
-- its lane's cursor passed it and it is not among the failures; refused rows are counted
-- from outbox_failures (held and retried ones are still pending).
SELECT count(*) FILTER (WHERE (NOT s.passed AND s.state IS NULL)
                             OR s.state IN ('held', 'retry')) AS pending,
       (SELECT count(*) FROM {schema}.outbox_failures WHERE state = 'failed') AS failed,
       count(*) FILTER (WHERE s.passed AND s.state IS NULL) AS published,
       greatest(0, coalesce(extract(epoch FROM clock_timestamp() - min(s.created_at)
                                    FILTER (WHERE NOT s.passed AND s.state IS NULL)), 0))
           AS oldest_age
FROM (
    SELECT m.created_at, f.state,
           {schema}.outbox_passed(m.xid, m.id, l.cursor_snapshot, l.batch_snapshot,
                                  l.batch_pos) AS passed
    FROM {schema}.outbox_messages AS m
    LEFT JOIN {schema}.relay_lanes AS l ON l.lane = m.lane
    LEFT JOIN {schema}.outbox_failures AS f ON f.id = m.id
) AS s

-- name: status_relays
-- now() would be when this transaction began: a heartbeat committed since then is "in the
-- future" (a negative age). clock_timestamp() is read as the statement runs.
SELECT r.relay_id, r.idle,
       greatest(0, extract(epoch FROM clock_timestamp() - r.heartbeat_at)) AS heartbeat_age,
       coalesce(array_agg(l.lane ORDER BY l.lane) FILTER (WHERE l.lane IS NOT NULL), '{}')
           AS lanes
FROM {schema}.relays AS r
LEFT JOIN {schema}.relay_lanes AS l
  ON l.owner = r.relay_id AND l.expires_at > clock_timestamp()
GROUP BY r.relay_id, r.idle, r.heartbeat_at
ORDER BY r.relay_id

-- name: unowned_lanes
-- Lanes no live relay holds.
SELECT lane FROM {schema}.relay_lanes
WHERE owner IS NULL OR expires_at IS NULL OR expires_at <= clock_timestamp() ORDER BY lane

-- name: oldest_message
-- Where retention starts.
SELECT min(id) FROM {schema}.outbox_messages

-- name: retention_lock
-- Only one relay of a database deletes at a time (relay.retention.RETENTION_LOCK).
SELECT pg_try_advisory_xact_lock(%(k)s)

-- name: purge_range
-- One range of ids; old rows that are not passed yet (a lane behind, a late commit) stay.
WITH gone AS (
    DELETE FROM {schema}.outbox_messages AS m
    USING {schema}.relay_lanes AS l
    WHERE m.id >= %(lo)s AND m.id < %(hi)s AND l.lane = m.lane
      AND m.created_at < now() - make_interval(secs => %(older_than)s)
      AND {schema}.outbox_passed(m.xid, m.id, l.cursor_snapshot, l.batch_snapshot, l.batch_pos)
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS deleted, n.id AS next_id,
       n.created_at < now() - make_interval(secs => %(older_than)s) AS next_old
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (SELECT m.id, m.created_at FROM {schema}.outbox_messages AS m
                   WHERE m.id >= %(hi)s ORDER BY m.id LIMIT 1) AS n ON true

-- name: purge_deliveries
-- The broker's proof goes by the same age as the rows.
DELETE FROM {schema}.deliveries
WHERE id < coalesce((SELECT min(id) FROM {schema}.deliveries
                     WHERE published_at >= now() - make_interval(secs => %(older_than)s)),
                    (SELECT max(id) + 1 FROM {schema}.deliveries))

-- name: backlog
-- The outbox rows no lane's cursor has passed, by lane and topic: the relay's gauges and the
-- console's overview. Per lane, the rows of transactions running at its cursor (a probe each)
-- and at most %(cap)s rows after it, its (lane, xid) index walked in order (the earliest
-- transactions first): the backlog only, never the history, and a read that costs the same
-- whatever the backlog (counting every row cost about a microsecond each, every refresh:
-- most of a core through a catch-up of millions). Past the cap, the lane's rest is one more
-- row without a topic (`estimated`): the id range after the last row read, up to the lane's
-- largest id, times the density of the ids read (a lane's ids are spread evenly: keys hash
-- to lanes). Its topics are not known: the rows read are the oldest, not a sample.
-- Run with relay.metrics.read_backlog's planner settings.
WITH q AS (
    SELECT l.lane, s.id, s.topic, s.created_at, s.sampled
    FROM {schema}.relay_lanes AS l
    CROSS JOIN LATERAL (
        (SELECT m.id, m.topic, m.created_at, false AS sampled
         FROM unnest(ARRAY(SELECT pg_snapshot_xip(l.cursor_snapshot))) AS x(xid)
         CROSS JOIN LATERAL (  -- a (lane, xid) probe per running transaction, whatever the plan
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
         ORDER BY m.lane, m.xid  -- as the index: walked in order, it stops at the cap
         LIMIT %(cap)s)
    ) AS s
    WHERE l.lane < %(lanes)s
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
WHERE e.lane_read >= %(cap)s
ORDER BY 1, 2 NULLS LAST

-- name: backlog_planner
-- The backlog read's planner, for the rest of the transaction: the capped read walks each
-- lane's index in order (expecting a few hundred rows a lane, the planner would rather visit
-- them all from a bitmap and sort them), and no JIT (with a day of published rows kept, it
-- costs the read high enough to compile it: 200-330 ms of CPU for a read of ~2 ms). Returns
-- what they were, and the refused rows' count (for the same gauges).
SELECT current_setting('jit') AS jit, current_setting('enable_bitmapscan') AS bitmapscan,
       set_config('jit', 'off', true) AS jit_now,
       set_config('enable_bitmapscan', 'off', true) AS bitmapscan_now,
       (SELECT count(*) FROM {schema}.outbox_failures WHERE state = 'failed') AS failed

-- name: planner_back
-- The transaction's planner settings back as backlog_planner found them.
SELECT set_config('jit', %(jit)s, true) AS jit,
       set_config('enable_bitmapscan', %(bitmapscan)s, true) AS bitmapscan

-- name: unsettled_operations
-- Operations whose outcome nobody has established (the ledger of dedup.ledger.Ledger.perform), for an
-- alert: the status index makes this cheap. Its own statement, since a least-privileged relay
-- role may not read the table (then the gauge is simply not exported).
SELECT count(*) FILTER (WHERE status = 'unknown') AS unknown,
       count(*) FILTER (WHERE status = 'needs-human') AS needs_human
FROM {schema}.operations WHERE status IN ('unknown', 'needs-human')

-- name: relay_role_grants
-- The least privilege of a relay's role ({role}: relay.roles.relay_grants). A script, not
-- a statement: several GRANTs, run as they are.
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT, DELETE ON {schema}.outbox_messages TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.relays, {schema}.relay_lanes,
    {schema}.outbox_failures TO {role};
GRANT SELECT, INSERT, DELETE ON {schema}.deliveries TO {role};
GRANT SELECT, INSERT ON {schema}.relay_server TO {role};
GRANT SELECT ON {schema}.relay_history TO {role};
GRANT USAGE ON SEQUENCE {schema}.deliveries_id_seq TO {role};

-- name: history_check
-- Signs that the outbox's transaction ids are not this server's history (relay/history.py):
-- relay_history names another cluster; lanes whose stored cursor counts ids not issued yet,
-- and lanes holding rows written by such ids (a probe on (lane, xid) each). None of them
-- happens within one history.
SELECT coalesce((SELECT h.system_identifier <> c.system_identifier
                  FROM {schema}.relay_history AS h, pg_control_system() AS c), true)
           AS cluster_moved,
       coalesce(array_agg(l.lane ORDER BY l.lane) FILTER (
           WHERE pg_snapshot_xmax(l.cursor_snapshot) > pg_snapshot_xmax(pg_current_snapshot())
              OR pg_snapshot_xmax(l.batch_snapshot) > pg_snapshot_xmax(pg_current_snapshot())),
           '{}') AS cursors_ahead,
       coalesce(array_agg(l.lane ORDER BY l.lane) FILTER (WHERE f.future), '{}') AS rows_ahead
FROM {schema}.relay_lanes AS l
CROSS JOIN LATERAL (
    SELECT EXISTS (SELECT 1 FROM {schema}.outbox_messages AS m
                   WHERE m.lane = l.lane AND m.xid >= pg_snapshot_xmax(pg_current_snapshot()))
        AS future
) AS f

-- name: rebase_live_lanes
-- Lanes a relay still holds: a rebase waits until no relay runs.
SELECT coalesce(array_agg(lane ORDER BY lane), '{}') FROM {schema}.relay_lanes
WHERE owner IS NOT NULL AND expires_at > now()

-- name: rebase_rows
-- Gives the outbox this server's transaction ids (relay/rebase.py). A row is seen (xid 2,
-- FrozenTransactionId, visible in every snapshot) when the lane's stored cursor passed it
-- *and* its outcome is on record: the broker's proof in deliveries, or its copy in
-- outbox_failures. Every other row gets this transaction's id: pending, published in id
-- order once the rebase commits. A row emitted on this server since the move may look passed
-- by the old cursor (its id below that cursor's horizon only because the counters differ);
-- having no proof, it is sent. Worst case: a row whose proof retention already deleted is
-- sent twice; none is skipped.
WITH changed AS (
    UPDATE {schema}.outbox_messages AS m
    SET xid = CASE WHEN EXISTS (SELECT 1 FROM {schema}.relay_lanes AS l
                                WHERE l.lane = m.lane
                                  AND {schema}.outbox_passed(m.xid, m.id, l.cursor_snapshot,
                                                             l.batch_snapshot, l.batch_pos))
                        AND (EXISTS (SELECT 1 FROM {schema}.outbox_failures AS f
                                     WHERE f.id = m.id)
                             OR EXISTS (SELECT 1 FROM {schema}.deliveries AS d
                                        WHERE int8range(d.first_id, d.last_id, '[]') @> m.id
                                          AND d.lane = m.lane AND m.id = ANY(d.ids)))
                   THEN CAST('2' AS xid8) ELSE pg_current_xact_id() END
    RETURNING m.xid
)
SELECT count(*) FILTER (WHERE xid = CAST('2' AS xid8)) AS seen,
       count(*) FILTER (WHERE xid <> CAST('2' AS xid8)) AS pending
FROM changed

-- name: rebase_cluster
-- The outbox is this cluster's from now on.
INSERT INTO {schema}.relay_history (system_identifier)
SELECT system_identifier FROM pg_control_system()
ON CONFLICT (one) DO UPDATE SET system_identifier = EXCLUDED.system_identifier, since = now()

-- name: rebase_lanes
-- Every lane starts over from the empty cursor ('3:3:' sees only frozen rows: xid 2), its
-- token bumped so that nothing read before the rebase can be recorded after it.
UPDATE {schema}.relay_lanes
SET cursor_snapshot = '3:3:', batch_snapshot = NULL, batch_pos = 0, token = token + 1,
    owner = NULL, expires_at = NULL, last_error = NULL, last_error_at = NULL

-- name: rebase_incarnation
-- A restore may have copied the old server's incarnation: relays read the stored cursors.
DELETE FROM {schema}.relay_server
