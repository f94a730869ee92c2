"""outboxkit's `dedup` package: the consumers' dedup marks.

The ledger of outside operations is :mod:`dedup.ledger` (its :class:`~dedup.ledger.Ledger`).
"""

from dedup.inbox import Mark, is_marked, mark_many, purge_marks
from dedup.window import check_window

__all__ = [
    "Mark",
    "check_window",
    "is_marked",
    "mark_many",
    "purge_marks",
]
