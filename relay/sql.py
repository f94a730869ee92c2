"""The relay's SQL, readable as SQL: each statement names its tables ``{schema}.table``.

The schema name was validated as a plain identifier by the settings, so formatting it in
is safe; values always travel as bound parameters.
"""

from __future__ import annotations

from functools import cache

from sqlalchemy import TextClause, text


@cache
def sql(template: str, schema: str) -> TextClause:
    return text(template.replace("{schema}", f'"{schema}"'))
