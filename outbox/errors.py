"""The one error tree of outboxkit.

Every exception outboxkit raises on purpose derives from :class:`OutboxError`, and its
message says what to do. Driver errors (psycopg, SQLAlchemy, kafka-python) are translated
once, at the boundary that called the driver, with ``raise ... from exc`` so the cause
stays attached::

    OutboxError
    ├── ConfigurationError        a setting or argument is invalid; nothing was started
    ├── ServiceError              a local PostgreSQL / Kafka service could not be run
    │   └── MissingToolError      a required program (java, mvn, initdb) is not installed
    ├── SchemaError               the database schema is missing or at another version
    ├── InvalidMessage            an envelope failed validation; nothing was written
    ├── RunError                  agent-run state machine errors
    │   ├── RunNotFound
    │   ├── IllegalTransition     the move is not allowed from the run's current state
    │   ├── LeaseLost             another worker holds the run now; stop writing for it
    │   ├── EvidenceRequired      ``done`` needs evidence
    │   ├── CheckpointTooLarge    the checkpoint exceeds the configured bound
    │   ├── ApprovalInvalid       an approval expired, was revoked or is out of scope
    │   └── WorkflowRetired       the run's workflow no longer accepts work
    └── (more branches are added by relay, consumers and dedup)

Handler control flow (retry later, dead-letter, skip) deliberately lives outside this
tree, so that ``except OutboxError`` never swallows it.
"""

from __future__ import annotations


class OutboxError(Exception):
    """Base of every error outboxkit raises on purpose."""


class ConfigurationError(OutboxError):
    """A setting or argument is invalid; fix it and start again."""


class ServiceError(OutboxError):
    """A local PostgreSQL or Kafka service could not be started, reached or stopped."""


class MissingToolError(ServiceError):
    """A program the local services need is not installed; the message says how to get it."""

    def __init__(self, tool: str, how_to_install: str) -> None:
        super().__init__(f"{tool} was not found. {how_to_install}")
        self.tool = tool
        self.how_to_install = how_to_install


class SchemaError(OutboxError):
    """The outboxkit schema is missing or at another version: run `outbox migrate`."""
