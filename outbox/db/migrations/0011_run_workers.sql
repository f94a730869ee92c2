-- outboxkit 0011: which workers wait for runs, so that only then do the runs' wake-ups NOTIFY.
--
-- Starting a run, waking one, an operator's requeue, a confirmation that moves a run on and a
-- retry's requeue NOTIFY the runs channel so that an idle worker claims at once. A transaction
-- that NOTIFYs takes a database-wide lock at commit and cannot be prepared (two-phase commit):
-- so those statements NOTIFY only while some worker has declared here that it waits for one
-- (idle_until in the future; outbox/runs/wakeups.py). A worker declares itself idle when a
-- claim finds nothing (then claims once more: a commit in between is found), renews the
-- declaration while it idles, withdraws it while its every slot is busy and when it stops. A
-- worker that died stops counting at idle_until.
CREATE TABLE {schema}.run_workers (
    worker     text        NOT NULL,
    idle_until timestamptz NOT NULL,
    PRIMARY KEY (worker)
);
