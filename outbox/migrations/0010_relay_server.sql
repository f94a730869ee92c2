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
