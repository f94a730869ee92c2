"""The named-query loader (outbox.db.queries): its refusals, and its one quoting rule."""

from __future__ import annotations

import re

import pytest
from sqlalchemy import select

from outbox.db.queries import driver_sql, parse, queries, quote_identifier, sql
from outbox.db.schema import SCHEMA
from outbox.db.tables import DIALECT, agent_runs

SOURCE = """-- A file's header comment.

-- name: first
-- What the first query does (documentation: not sent).
SELECT 1 -- a comment inside the statement stays

-- name: second
SELECT 2
"""


class TestParse:
    def test_queries_by_name_without_their_description(self) -> None:
        assert parse(SOURCE, "f.sql") == {
            "first": "SELECT 1\n",  # comments inside the statement are not sent either
            "second": "SELECT 2\n",
        }

    def test_indentation_and_comments_are_left_out_but_not_from_string_literals(self) -> None:
        found = parse("-- name: q\nSELECT 'a -- b' AS x,  -- why\n    'it''s' -- too\n"
                      "    -- a line of its own\nFROM t\n", "f.sql")
        assert found == {"q": "SELECT 'a -- b' AS x,\n'it''s'\nFROM t\n"}

    @pytest.mark.parametrize("body", [
        "SELECT 'a\n  -- kept\n' AS x  -- a literal over lines\n",
        "SELECT $$ -- kept $$ AS x\n",
        "SELECT E'it\\'s -- kept' AS x\n",
    ])
    def test_a_statement_it_cannot_read_safely_is_sent_as_written(self, body: str) -> None:
        assert parse("-- name: q\n" + body, "f.sql") == {"q": body}

    def test_two_queries_of_one_name_are_refused(self) -> None:
        with pytest.raises(ValueError, match=r"f\.sql: two queries are named 'first'"):
            parse(SOURCE + "\n-- name: first\nSELECT 3\n", "f.sql")

    def test_sql_before_the_first_marker_is_refused(self) -> None:
        with pytest.raises(ValueError, match="before the first '-- name:' marker"):
            parse("SELECT 0\n" + SOURCE, "f.sql")

    def test_an_empty_query_is_refused(self) -> None:
        with pytest.raises(ValueError, match="query 'second' is empty"):
            parse("-- name: first\nSELECT 1\n-- name: second\n-- only words\n", "f.sql")

    def test_a_name_that_is_not_lower_case_with_underscores_is_refused(self) -> None:
        with pytest.raises(ValueError, match="'Claim-Lanes' is not lower_case"):
            parse("-- name: Claim-Lanes\nSELECT 1\n", "f.sql")


class TestLookup:
    def test_a_missing_name_is_refused_with_the_names_there_are(self) -> None:
        with pytest.raises(LookupError, match=r"no query named 'claim' in relay/queries\.sql"):
            driver_sql("relay", "claim", "outboxkit")

    def test_each_package_file_loads(self) -> None:
        for package in ("outbox.db", "relay", "dedup"):
            assert queries(package), package

    def test_the_schema_is_the_only_placeholder_a_query_keeps(self) -> None:
        """Any other {word} would reach PostgreSQL as written (relay_role_grants' {role} is
        filled by relay.roles)."""
        for package in ("outbox.db", "relay", "dedup"):
            for name in queries(package):
                rendered = driver_sql(package, name, "outboxkit")
                left = set(re.findall(r"\{[a-z_]+\}", rendered)) - {"{role}"}
                assert not left, (package, name, left)

    def test_a_rendering_is_cached_per_schema(self) -> None:
        assert sql("relay", "set_idle", "a") is sql("relay", "set_idle", "a")
        assert "a.relays" in driver_sql("relay", "set_idle", "a")
        assert "b.relays" in driver_sql("relay", "set_idle", "b")


class TestQuoting:
    @pytest.mark.parametrize(
        ("name", "quoted"),
        [
            ("outboxkit", "outboxkit"),
            ("Orders", '"Orders"'),  # unquoted, PostgreSQL would fold it to orders
            ("user", '"user"'),  # a reserved word
            ("my schema", '"my schema"'),
            ('a"b', '"a""b"'),
        ],
    )
    def test_a_schema_is_quoted_only_when_it_must_be(self, name: str, quoted: str) -> None:
        assert quote_identifier(name) == quoted
        assert driver_sql("relay", "set_idle", name).startswith(f"UPDATE {quoted}.relays ")

    @pytest.mark.parametrize("name", ["outboxkit", "tenant_7", "Orders", "user", "my schema"])
    def test_core_and_named_queries_name_a_schema_alike(self, name: str) -> None:
        # What an execution with schema_translate_map sends (rendered at compile time here).
        compiled = select(agent_runs.c.id).compile(
            dialect=DIALECT, schema_translate_map={SCHEMA: name}, render_schema_translate=True
        )
        assert f"FROM {quote_identifier(name)}.agent_runs" in str(compiled)
