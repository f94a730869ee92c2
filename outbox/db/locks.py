"""Advisory lock keys shared by the write side and the relay (a module of their own, so that
the relay does not import the write side's modules to know one)."""

# Writes that decide a key's state in outbox_failures take turns on this transaction lock:
# the relay's record of refused and set-aside rows, and an operator's retry. A row the relay
# set aside as held while an operator retried its key would otherwise be held for good, with
# nothing before it to retry. Any constant works, the same for every process of a database.
FAILURES_LOCK = 0x6F75746661696C  # "outfail"
