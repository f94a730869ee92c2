-- outboxkit 0002: what several relays need to share the outbox.
--
-- Lanes: every message is hashed by key into a lane when emitted; each lane is published
-- by one relay at a time, under a lease fenced by a token (see relay/lanes.py).

CREATE TABLE {schema}.relay_lanes (
    lane        integer     NOT NULL,
    owner       text,                              -- relay_id, NULL when free
    token       bigint      NOT NULL DEFAULT 0,    -- grows on every acquisition
    expires_at  timestamptz,
    PRIMARY KEY (lane)
);

-- A refused message either went to the dead-letter topic or, when blocking, holds back the
-- later messages of its key until an operator retries it.
ALTER TABLE {schema}.outbox_messages
    ADD COLUMN blocking  boolean     NOT NULL DEFAULT false,
    ADD COLUMN failed_at timestamptz;

CREATE INDEX outbox_messages_failed_idx
    ON {schema}.outbox_messages (lane, topic, key) WHERE status = 'failed';

-- Retention deletes published rows oldest first without scanning the table.
CREATE INDEX outbox_messages_published_idx
    ON {schema}.outbox_messages (published_at) WHERE status = 'published';
