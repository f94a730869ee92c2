"""outboxkit's write side: durable agent runs and the transactional outbox."""

from outbox.errors import ConfigurationError, MissingToolError, OutboxError, SchemaError, ServiceError

__all__ = ["ConfigurationError", "MissingToolError", "OutboxError", "SchemaError", "ServiceError"]
