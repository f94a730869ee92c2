"""The allowed-moves table of a run, exactly as specified, and nothing more."""

from __future__ import annotations

import itertools

import pytest

from outbox.errors import IllegalTransition
from outbox.runs.states import ALLOWED, RunState, check, is_allowed, sources

SPECIFIED = {
    ("queued", "running"), ("queued", "failed"),
    ("running", "waiting"), ("running", "done"), ("running", "failed"),
    ("running", "needs-human"),
    ("waiting", "running"), ("waiting", "failed"), ("waiting", "needs-human"),
    ("failed", "queued"), ("failed", "needs-human"),
    ("needs-human", "queued"), ("needs-human", "waiting"), ("needs-human", "failed"),
}


def test_the_table_allows_exactly_the_specified_moves() -> None:
    table = {(a.value, b.value) for a, targets in ALLOWED.items() for b in targets}
    assert table == SPECIFIED


def test_every_state_has_an_entry_and_done_is_terminal() -> None:
    assert set(ALLOWED) == set(RunState)
    assert ALLOWED[RunState.DONE] == frozenset()


@pytest.mark.parametrize(("from_state", "to_state"), list(itertools.product(RunState, RunState)))
def test_check_raises_for_every_move_not_in_the_table(from_state: RunState,
                                                      to_state: RunState) -> None:
    if (from_state.value, to_state.value) in SPECIFIED:
        check(from_state, to_state)
        assert is_allowed(from_state, to_state)
    else:
        with pytest.raises(IllegalTransition) as caught:
            check(from_state, to_state)
        assert (caught.value.from_state, caught.value.to_state) == (from_state, to_state)


def test_sources_inverts_the_table() -> None:
    assert sources(RunState.QUEUED) == {RunState.FAILED, RunState.NEEDS_HUMAN}
    assert sources(RunState.RUNNING) == {RunState.QUEUED, RunState.WAITING}
    assert sources(RunState.WAITING) == {RunState.RUNNING, RunState.NEEDS_HUMAN}


def test_state_values_match_the_database_check_constraint() -> None:
    from outbox.db.tables import RUN_STATES  # noqa: PLC0415

    assert tuple(s.value for s in RunState) == RUN_STATES
