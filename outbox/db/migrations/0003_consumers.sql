-- outboxkit 0003: the consumers' dedup (inbox) and failures tables.
--
-- A consumer marks (group, message id) in consumer_inbox in the same transaction as the
-- handler's writes, and commits the Kafka offset only after that commit: a redelivery finds
-- the mark and is dropped. The rows are the dedup window: purging them earlier than the
-- topic's retention plus the worst consumer lag lets duplicates back in (consumers/window).
-- outbox/tables.py describes the same tables (section "consumers + dedup (migration 0003)").

CREATE TABLE {schema}.consumer_inbox (
    consumer_group   text        NOT NULL,
    message_id       text        NOT NULL,   -- the `message-id` header
    topic            text        NOT NULL,
    kafka_partition  integer     NOT NULL,
    kafka_offset     bigint      NOT NULL,
    processed_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, message_id)
);
-- Retention deletes one group's oldest marks first without scanning the table.
CREATE INDEX consumer_inbox_processed_idx
    ON {schema}.consumer_inbox (consumer_group, processed_at);

-- Messages a consumer could not handle: attempts counted across crashes and restarts, then
-- the copy sent to the dead-letter topic, and what an operator did about it.
CREATE TABLE {schema}.consumer_failures (
    id               bigserial   NOT NULL,
    consumer_group   text        NOT NULL,
    topic            text        NOT NULL,
    kafka_partition  integer     NOT NULL,
    kafka_offset     bigint      NOT NULL,
    message_id       text,                   -- NULL when the header was missing
    key              bytea,
    payload          bytea,                  -- the exact bytes received, for replay
    headers          jsonb       NOT NULL DEFAULT '{}'::jsonb,
    attempts         integer     NOT NULL DEFAULT 0,
    last_error       text,
    status           text        NOT NULL DEFAULT 'retrying',
    first_failed_at  timestamptz NOT NULL DEFAULT now(),
    last_failed_at   timestamptz NOT NULL DEFAULT now(),
    dead_lettered_at timestamptz,
    dlq_topic        text,
    dlq_partition    integer,
    dlq_offset       bigint,
    replayed_at      timestamptz,
    PRIMARY KEY (id),
    CONSTRAINT consumer_failures_status_check
        CHECK (status IN ('retrying', 'recovered', 'dead-lettered', 'replayed')),
    CONSTRAINT consumer_failures_position_key
        UNIQUE (consumer_group, topic, kafka_partition, kafka_offset)
);
CREATE INDEX consumer_failures_status_idx
    ON {schema}.consumer_failures (consumer_group, status, id);
