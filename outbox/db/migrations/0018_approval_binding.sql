-- outboxkit 0018: an approval bound to the exact call it allows, spent once (outbox/runs/approvals.py).
--
-- A loose scope ({"tool": "pay", "max": 100}) says what kind of call a person allowed, not
-- which one: a retried step, a replayed history or a forged call with other arguments could
-- all use it again. A bound approval keeps the canonical digest of the tool and its
-- arguments (call_digest), and the run spends it in the transaction that inserts the
-- effect's outbox row: a second spend matches no row and is refused, so the approved call is
-- sent at most once. Approvals requested before this (and loose-scope ones) keep digest NULL:
-- they are revalidated as before and can never be spent.
ALTER TABLE {schema}.approvals ADD COLUMN digest text;            -- 'sha256:' + 64 hex digits
ALTER TABLE {schema}.approvals ADD COLUMN grant_reason text;      -- why the person granted it
ALTER TABLE {schema}.approvals ADD COLUMN spent_at timestamptz;
ALTER TABLE {schema}.approvals ADD COLUMN spent_message_id uuid;  -- the effect's outbox message
-- A spent approval was granted, bound and names its message: whatever writes the row, the
-- audit never shows a spend nobody approved.
ALTER TABLE {schema}.approvals ADD CONSTRAINT approvals_spent_check
    CHECK (spent_at IS NULL OR (granted_at IS NOT NULL AND digest IS NOT NULL
                                AND spent_message_id IS NOT NULL));
-- The audit (`outbox approvals audit`) lists the bound approvals newest first, by index
-- however many loose ones history keeps.
CREATE INDEX approvals_bound_newest_idx ON {schema}.approvals (requested_at)
    WHERE digest IS NOT NULL;
