"""Outbox messages: the envelope, emit in the caller's transaction, lanes and the operator's
view of the backlog. The public names are in :mod:`outbox`."""
