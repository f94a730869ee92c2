"""outboxkit's `consumers` package (its contents land with its own issue)."""

__all__: list[str] = []
