"""Agent runs: the state machine, leases and fencing, checkpoints, steps, retries, approvals,
workflow versions, confirmations and retention. The public names are in :mod:`outbox`."""
