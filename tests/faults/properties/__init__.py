"""Property-based fault suites (issue #6): bad input against the real PostgreSQL and Kafka."""
