-- outboxkit 0010: the relay knows which server its in-memory cursors came from.
--
-- A lane's cursor is a snapshot of transaction ids, and transaction ids mean something only
-- in the history of the server that issued them. Crash recovery hands out again the ids
-- whose WAL never reached disk (rolled-back transactions, commits with synchronous_commit
-- off), and a promoted standby those of whatever its old primary did after its last record:
-- a cursor a relay took before either counts a new transaction with a re-issued id as seen.
--
-- An UNLOGGED table is emptied by crash recovery and by a standby's promotion (and is empty
-- on a standby), and nothing else empties it. Its one row names the server's incarnation:
-- the first relay to find the table empty fills it with a new one. The claim and the record
-- compare it, inside their own statements, with the incarnation the relay's in-memory cursors
-- were read under (a connection-level check could be fooled by a transaction-pooling proxy):
-- on a mismatch the claim reads the cursors stored in relay_lanes (safe: the record that
-- stored one committed, so its xid and every xid the cursor counts as seen survived), and the
-- record moves no cursor. relay/history.py tells the rest.
CREATE UNLOGGED TABLE {schema}.relay_server (
    one         boolean     NOT NULL DEFAULT true,
    incarnation uuid        NOT NULL DEFAULT gen_random_uuid(),
    since       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (one),
    CONSTRAINT relay_server_one_row CHECK (one)
);

-- Which cluster the outbox's transaction ids belong to: pg_control_system()'s identifier,
-- made by initdb and kept by streaming replication, base backups and their recovery. A
-- dump/restore or logical replication into another cluster copies this row, which then
-- names the old cluster: the claim compares it with the server's and returns nothing until
-- `outbox relay rebase` (relay/history.py). Logged, unlike relay_server, so that it moves
-- with the data.
CREATE TABLE {schema}.relay_history (
    one               boolean     NOT NULL DEFAULT true,
    system_identifier bigint      NOT NULL,
    since             timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (one),
    CONSTRAINT relay_history_one_row CHECK (one)
);
INSERT INTO {schema}.relay_history (system_identifier)
SELECT system_identifier FROM pg_control_system();

-- A relay role set up for an earlier version (relay.roles.relay_grants) keeps working: the
-- roles that may update the lanes may read both tables and make the incarnation.
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT DISTINCT CAST(CAST(a.grantee AS regrole) AS text) AS name
             FROM pg_class AS c, aclexplode(c.relacl) AS a
             WHERE c.oid = CAST('{schema}.relay_lanes' AS regclass)
               AND a.privilege_type = 'UPDATE' AND a.grantee <> 0 AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT SELECT, INSERT ON {schema}.relay_server TO %s', r.name);
        EXECUTE format('GRANT SELECT ON {schema}.relay_history TO %s', r.name);
    END LOOP;
END $$;
