"""The ``outbox`` command line: ``main`` is the entry point; each concern adds its group."""
