-- The dedup package's hand-written SQL (the ledger, dedup/ledger/, is SQLAlchemy Core).
-- Each query follows its `-- name:` marker; the comment lines right after the marker describe
-- it (the loader, outbox.queries, keeps them out of the statement's text). {schema} is the
-- configured schema, quoted by outbox.queries.quote_identifier. All run as driver SQL
-- (`%(name)s`; `%(name)b` sends the value in binary) except where `:name` says text().

-- name: insert_marks
-- A batch's marks in one round trip; ON CONFLICT DO NOTHING also absorbs an id twice in the
-- batch, and RETURNING names the new ones (the others are duplicates). Each array is one
-- literal made by dedup.inbox.text_array (a list dumped by psycopg, even in binary, costs
-- Python work per element).
INSERT INTO {schema}.consumer_inbox
    (consumer_group, message_id, topic, kafka_partition, kafka_offset)
SELECT %(group)s, m.id, m.topic, m.part, m.off
FROM unnest(CAST(%(ids)s AS text[]), CAST(%(topics)s AS text[]),
            CAST(%(partitions)s AS integer[]), CAST(%(offsets)s AS bigint[]))
     AS m(id, topic, part, off)
ON CONFLICT (consumer_group, message_id) DO NOTHING
RETURNING message_id

-- name: insert_mark
-- One message's mark (per-message mode): insert_marks without arrays to build and unnest.
INSERT INTO {schema}.consumer_inbox
    (consumer_group, message_id, topic, kafka_partition, kafka_offset)
VALUES (%(group)s, %(id)s, %(topic)s, %(part)s, %(off)s)
ON CONFLICT (consumer_group, message_id) DO NOTHING
RETURNING 1

-- name: insert_new_marks
-- insert_marks without the conflict handling (dedup.inbox.insert_new: a batch expected new;
-- ON CONFLICT costs a speculative insertion per row).
INSERT INTO {schema}.consumer_inbox
    (consumer_group, message_id, topic, kafka_partition, kafka_offset)
SELECT %(group)s, m.id, m.topic, m.part, m.off
FROM unnest(CAST(%(ids)s AS text[]), CAST(%(topics)s AS text[]),
            CAST(%(partitions)s AS integer[]), CAST(%(offsets)s AS bigint[]))
     AS m(id, topic, part, off)

-- name: unmark
DELETE FROM {schema}.consumer_inbox
WHERE consumer_group = %(group)s AND message_id = %(id)s

-- name: is_marked
SELECT 1 FROM {schema}.consumer_inbox
WHERE consumer_group = %(group)s AND message_id = %(id)s

-- name: retention_lock
-- One process per (schema, group) purges at a time; the others skip (text(): `:k`).
SELECT pg_try_advisory_xact_lock(:k)

-- name: purge_marks
-- The group's oldest marks, a batch at a time; a mark someone is writing is left for later.
WITH doomed AS (
    SELECT consumer_group, message_id FROM {schema}.consumer_inbox
    WHERE consumer_group = %(group)s
      AND processed_at < now() - make_interval(secs => %(older)s)
    ORDER BY processed_at
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {schema}.consumer_inbox AS i USING doomed
WHERE i.consumer_group = doomed.consumer_group AND i.message_id = doomed.message_id
