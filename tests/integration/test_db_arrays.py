"""Array literals (outbox.db.arrays) read back by PostgreSQL as the lists they were made from."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, text

from outbox.db.arrays import bool_array, int_array, text_array

TEXTS = [
    ["a", "b"],
    ["12:20:13,15", None, "", "NULL", 'a "quoted" \\ one', "{braces}", " spaced "],
    [None],
    [],
]


@pytest.mark.parametrize("values", TEXTS)
def test_text(engine: Engine, values: list[str | None]) -> None:
    with engine.connect() as conn:
        back = conn.execute(text("SELECT CAST(:v AS text[])"), {"v": text_array(values)})
        assert back.scalar_one() == values


@pytest.mark.parametrize("values", [[1, -2, 3], [None, 5, None], [], [2**62]])
def test_integers(engine: Engine, values: list[int | None]) -> None:
    with engine.connect() as conn:
        back = conn.execute(text("SELECT CAST(:v AS bigint[])"), {"v": int_array(values)})
        assert back.scalar_one() == values


def test_booleans(engine: Engine) -> None:
    with engine.connect() as conn:
        back = conn.execute(text("SELECT CAST(:v AS bool[])"),
                            {"v": bool_array([True, False, True])})
        assert back.scalar_one() == [True, False, True]
