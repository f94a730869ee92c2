-- outboxkit 0006: the outbox becomes an append-only log for the relay (PgQ's design, on xid8).
--
-- Before: the relay claimed rows by status and UPDATEd each one (published, partition,
-- offset), and retention DELETEd them one by one: a new tuple, three index entries and WAL
-- per message, and vacuum after every thousand. Now a row is written once, by emit, and the
-- relay only reads it:
--
-- * every row carries the id of the transaction that wrote it (xid8, pg_current_xact_id());
-- * each lane has a cursor, a snapshot (pg_snapshot): every row of the lane whose transaction
--   is visible in it has been published. The next batch is the lane's rows visible in a later
--   snapshot and not in the cursor, in id order; after Kafka acknowledged them the cursor
--   moves, in the transaction that records the evidence, fenced by the lane's token;
-- * the broker's proof goes to `deliveries`, one row per lane per batch (arrays);
-- * a refused message is copied to `outbox_failures` (the rare row: dead-lettered, blocking
--   its key, or held back behind one);
-- * retention deletes whole id ranges of rows every cursor has passed.
--
-- A transaction that commits late with a lower id than rows already published is still found:
-- its xid was in the cursor's list of running transactions, and it is visible in the next
-- snapshot. Nothing waits on a gap or on the oldest running transaction. docs/relay.md tells
-- the whole argument. outbox/tables.py describes the same tables; a test proves they agree.

-- Rows written before this migration: published or failed ones get xid 2 (FrozenTransactionId,
-- visible in every snapshot, so already passed); pending ones get this migration's xid, which
-- no cursor has seen yet, so the relay publishes them, in id order, once.
ALTER TABLE {schema}.outbox_messages ADD COLUMN xid xid8 NOT NULL DEFAULT '2';
UPDATE {schema}.outbox_messages SET xid = pg_current_xact_id() WHERE status = 'pending';
ALTER TABLE {schema}.outbox_messages ALTER COLUMN xid SET DEFAULT pg_current_xact_id();

-- The relay's cursors. '3:3:' sees only frozen rows: a lane's first batch is all of its rows.
ALTER TABLE {schema}.relay_lanes
    ADD COLUMN cursor_snapshot pg_snapshot NOT NULL DEFAULT '3:3:',
    -- A batch larger than the relay's batch size is published in several steps: the target
    -- snapshot and the last id done within it.
    ADD COLUMN batch_snapshot  pg_snapshot,
    ADD COLUMN batch_pos       bigint      NOT NULL DEFAULT 0,
    ADD COLUMN published_count bigint      NOT NULL DEFAULT 0,
    -- The last transient error (broker down, ...) while publishing this lane: its rows wait.
    ADD COLUMN last_error      text,
    ADD COLUMN last_error_at   timestamptz;

-- The broker's proof: the ids a relay published in one batch of one lane, with the partition
-- and offset of each (arrays in id order). The view published_messages unnests them.
CREATE TABLE {schema}.deliveries (
    id            bigserial   NOT NULL,
    lane          integer     NOT NULL,
    relay_id      text        NOT NULL,
    token         bigint      NOT NULL,
    first_id      bigint      NOT NULL,
    last_id       bigint      NOT NULL,
    ids           bigint[]    NOT NULL,
    partitions    integer[]   NOT NULL,
    offsets       bigint[]    NOT NULL,
    published_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (id)
);
-- Finding the delivery of one message: the batches whose id range contains it.
CREATE INDEX deliveries_range_idx ON {schema}.deliveries
    USING gist (int8range(first_id, last_id, '[]'));

-- Refused messages, copied whole (retention may delete the outbox row): the dead-lettered ones
-- (with where their copy landed), the one blocking its key, and the ones held back behind it.
-- An operator's retry sets state 'retry'; the relay publishes those first and deletes them.
CREATE TABLE {schema}.outbox_failures (
    id               bigint      NOT NULL,   -- the outbox row's id
    message_id       uuid        NOT NULL,
    topic            text        NOT NULL,
    key              bytea,
    lane             integer     NOT NULL,
    message_type     text        NOT NULL,
    payload          bytea       NOT NULL,
    headers          jsonb       NOT NULL DEFAULT '{}'::jsonb,
    run_id           uuid,
    created_at       timestamptz NOT NULL,
    state            text        NOT NULL,
    blocking         boolean     NOT NULL DEFAULT false,
    error            text,
    failed_at        timestamptz NOT NULL DEFAULT now(),
    dlq_partition    integer,
    dlq_offset       bigint,
    PRIMARY KEY (id),
    CONSTRAINT outbox_failures_state_check CHECK (state IN ('failed', 'held', 'retry'))
);
CREATE INDEX outbox_failures_lane_idx ON {schema}.outbox_failures (lane, topic, key, id);

-- What the old columns said, moved: failed rows to outbox_failures, published rows' proof to
-- deliveries (one row per thousand).
INSERT INTO {schema}.outbox_failures
    (id, message_id, topic, key, lane, message_type, payload, headers, run_id, created_at,
     state, blocking, error, failed_at, dlq_partition, dlq_offset)
SELECT id, message_id, topic, key, lane, message_type, payload, headers, run_id, created_at,
       'failed', blocking, last_error, coalesce(failed_at, now()), kafka_partition, kafka_offset
FROM {schema}.outbox_messages WHERE status = 'failed';

INSERT INTO {schema}.deliveries
    (lane, relay_id, token, first_id, last_id, ids, partitions, offsets, published_at)
SELECT lane, 'migration-0006', 0, min(id), max(id), array_agg(id ORDER BY id),
       array_agg(kafka_partition ORDER BY id), array_agg(kafka_offset ORDER BY id),
       max(published_at)
FROM {schema}.outbox_messages
WHERE status = 'published' AND kafka_partition IS NOT NULL AND kafka_offset IS NOT NULL
GROUP BY lane, id / 1000;

DROP INDEX {schema}.outbox_messages_pending_idx;
DROP INDEX {schema}.outbox_messages_failed_idx;
DROP INDEX {schema}.outbox_messages_published_idx;
ALTER TABLE {schema}.outbox_messages
    DROP CONSTRAINT outbox_messages_status_check,
    DROP COLUMN status,
    DROP COLUMN attempts,
    DROP COLUMN last_error,
    DROP COLUMN published_at,
    DROP COLUMN kafka_partition,
    DROP COLUMN kafka_offset,
    DROP COLUMN blocking,
    DROP COLUMN failed_at;

-- The relay reads a lane's rows in id order (B-tree on lane, id) and a snapshot difference by
-- transaction id (lane, xid). Insert-only: no tuple is ever updated, so no dead tuples and no
-- vacuum for the relay's sake (retention's range deletes are the only ones).
CREATE INDEX outbox_messages_lane_id_idx ON {schema}.outbox_messages (lane, id);
-- id is carried in the (lane, xid) index: the smallest and largest id of a difference come
-- from an index-only scan once vacuum has marked the pages all-visible.
CREATE INDEX outbox_messages_lane_xid_idx ON {schema}.outbox_messages (lane, xid) INCLUDE (id);
ALTER TABLE {schema}.outbox_messages RESET (
    autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,
    autovacuum_vacuum_insert_scale_factor, autovacuum_vacuum_insert_threshold,
    autovacuum_analyze_scale_factor, autovacuum_analyze_threshold, autovacuum_vacuum_cost_delay);

-- Whether a row has been passed by its lane's cursor (published, or refused and recorded).
CREATE FUNCTION {schema}.outbox_passed(
    row_xid xid8, row_id bigint, cursor_snapshot pg_snapshot, batch_snapshot pg_snapshot,
    batch_pos bigint
) RETURNS boolean LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT pg_visible_in_snapshot(row_xid, coalesce(cursor_snapshot, '3:3:'))
        OR (batch_snapshot IS NOT NULL AND row_id <= batch_pos
            AND pg_visible_in_snapshot(row_xid, batch_snapshot))
$$;

-- The published messages, one row each, with the broker's proof.
CREATE VIEW {schema}.published_messages AS
SELECT u.id, d.lane, u.kafka_partition, u.kafka_offset, d.published_at, d.relay_id,
       d.id AS delivery_id
FROM {schema}.deliveries AS d
CROSS JOIN LATERAL unnest(d.ids, d.partitions, d.offsets) AS u(id, kafka_partition, kafka_offset);

-- Every outbox row as an operator sees it (what the dropped columns used to say). Computed:
-- cheap for a few rows (each finds its delivery through the range index), slow for all.
CREATE VIEW {schema}.message_status AS
SELECT m.id, m.message_id, m.topic, m.key, m.lane, m.message_type, m.run_id, m.created_at,
       CASE WHEN f.state = 'failed' THEN 'failed'
            WHEN f.state IS NOT NULL THEN 'pending'
            WHEN {schema}.outbox_passed(m.xid, m.id, l.cursor_snapshot, l.batch_snapshot,
                                        l.batch_pos) THEN 'published'
            ELSE 'pending' END AS status,
       e.published_at, e.kafka_partition, e.kafka_offset,
       coalesce(f.error, CASE WHEN f.state IS NULL THEN l.last_error END) AS last_error,
       f.failed_at, coalesce(f.blocking, false) AS blocking, f.state AS failure_state,
       f.dlq_partition, f.dlq_offset
FROM {schema}.outbox_messages AS m
LEFT JOIN {schema}.relay_lanes AS l ON l.lane = m.lane
LEFT JOIN {schema}.outbox_failures AS f ON f.id = m.id
LEFT JOIN LATERAL (
    SELECT d.published_at, u.kafka_partition, u.kafka_offset
    FROM {schema}.deliveries AS d
    CROSS JOIN LATERAL unnest(d.ids, d.partitions, d.offsets) AS u(id, kafka_partition, kafka_offset)
    WHERE int8range(d.first_id, d.last_id, '[]') @> m.id AND d.lane = m.lane AND u.id = m.id
    ORDER BY d.id DESC LIMIT 1
) AS e ON true;
