"""The consumer watchdog's judgement, on a clock of the test's own (no broker needed: the
runner's questions to the brokers are the callables here; tests/e2e/test_consumer_watchdog.py
proves the whole with both Kafka clients)."""

from __future__ import annotations

from consumers.watchdog import GroupView, Watchdog
from outbox.kafka.api import group_state


class Brokers:
    """What the runner would learn from the admin client; None: they do not answer."""

    def __init__(self) -> None:
        self.view: GroupView | None = ("empty", False)  # left alone in its group
        self.behind: int | None = 0
        self.asked = 0

    def group(self) -> GroupView | None:
        self.asked += 1
        return self.view

    def behind_(self) -> int | None:
        self.asked += 1
        return self.behind


def make(after_s: float = 20.0, check_s: float = 5.0) -> tuple[Watchdog, Brokers, list[float]]:
    now = [0.0]
    brokers = Brokers()
    dog = Watchdog(after_s=after_s, check_every_s=check_s, group=brokers.group,
                   behind=brokers.behind_, clock=lambda: now[0])
    return dog, brokers, now


def run(dog: Watchdog, now: list[float], until: float, step: float = 1.0,
        **turn: int | bool) -> list[float]:
    """Turns of the loop every *step* s until *until*; the times a stall was declared."""
    stalls = []
    while now[0] <= until:
        if dog.observe(**turn).stalled:  # type: ignore[arg-type]
            stalls.append(now[0])
        now[0] += step
    return stalls


def test_assigned_with_records_waiting_and_nothing_read_is_a_stall_after_the_delay() -> None:
    dog, _, now = make()
    stalls = run(dog, now, 25, assigned=3, waiting=7, progressed=False)
    assert stalls[:1] == [20.0]


def test_reading_anything_resets_the_clock() -> None:
    dog, _, now = make()
    run(dog, now, 15, assigned=3, waiting=7, progressed=False)
    assert dog.observe(assigned=3, waiting=7, progressed=True).working
    assert dog.stalled_for == 0
    assert run(dog, now, 34, assigned=3, waiting=7, progressed=False) == []


def test_caught_up_is_idle_not_stalled_when_the_brokers_agree() -> None:
    dog, brokers, now = make()
    assert run(dog, now, 120, assigned=3, waiting=0, progressed=False) == []
    assert brokers.asked <= 120 / 5 + 1  # the brokers are asked once per check, no more


def test_a_client_that_stopped_fetching_is_caught_by_the_brokers_end_offsets() -> None:
    # Its own high watermarks are stale (they come with fetch responses): it says 0 wait.
    dog, brokers, now = make()
    brokers.behind = 12
    stalls = run(dog, now, 25, assigned=3, waiting=0, progressed=False)
    assert stalls[:1] == [20.0]


def test_unassigned_and_alone_in_an_empty_group_is_a_stall() -> None:
    dog, _, now = make()
    stalls = run(dog, now, 25, assigned=0, waiting=0, progressed=False)
    assert stalls[:1] == [20.0]


def test_unassigned_in_a_stable_group_that_does_not_count_it_is_a_stall() -> None:
    # Its peers took over after its session ran out; it never joined again (#5153).
    dog, brokers, now = make()
    brokers.view = ("stable", False)
    stalls = run(dog, now, 25, assigned=0, waiting=0, progressed=False)
    assert stalls[:1] == [20.0]


def test_unassigned_member_of_a_stable_group_is_idle_on_purpose() -> None:
    # More members than partitions: it waits its turn, whatever its peers' backlog.
    dog, brokers, now = make()
    brokers.view = ("stable", True)
    assert dog.observe(assigned=0, waiting=0, progressed=False).working
    assert run(dog, now, 120, assigned=0, waiting=0, progressed=False) == []


def test_unassigned_while_the_group_rebalances_is_joining() -> None:
    dog, brokers, now = make()
    brokers.view = ("rebalancing", False)
    assert run(dog, now, 120, assigned=0, waiting=0, progressed=False) == []
    # ... but joining proves no work: a stall reported before is not over yet (the
    # rebuilt client's /readyz stays not-ready until it reads or is idle in its group).
    assert not dog.observe(assigned=0, waiting=0, progressed=False).working


def test_brokers_that_do_not_answer_start_no_stall() -> None:
    # Nothing assigned because the brokers are away: rebuilding would not help.
    dog, brokers, now = make()
    brokers.view = None
    assert run(dog, now, 60, assigned=0, waiting=0, progressed=False) == []


def test_a_stall_goes_on_counting_when_the_brokers_stop_answering() -> None:
    dog, brokers, now = make()
    run(dog, now, 10, assigned=0, waiting=0, progressed=False)
    brokers.view = None
    stalls = run(dog, now, 25, assigned=0, waiting=0, progressed=False)
    assert stalls[:1] == [20.0]


def test_assigned_when_the_brokers_do_not_answer_is_not_called_caught_up() -> None:
    dog, brokers, _ = make()
    brokers.behind = None
    verdict = dog.observe(assigned=3, waiting=0, progressed=False)
    assert not verdict.working
    assert not verdict.stalled


def test_after_a_rebuild_the_new_client_gets_the_whole_delay() -> None:
    dog, _, now = make()
    assert run(dog, now, 20, assigned=0, waiting=0, progressed=False) == [20.0]
    dog.rebuilt()
    stalls = run(dog, now, 45, assigned=0, waiting=0, progressed=False)
    assert min(stalls, default=0) >= 41.0


def test_off_when_the_delay_is_zero() -> None:
    dog, brokers, now = make(after_s=0)
    assert run(dog, now, 100, assigned=3, waiting=9, progressed=False) == []
    assert brokers.asked == 0


def test_both_clients_spellings_of_a_group_state_are_one() -> None:
    assert [group_state(n) for n in ("Stable", "STABLE", "Empty", "EMPTY", "Dead", "DEAD")] == [
        "stable", "stable", "empty", "empty", "dead", "dead"]
    assert {group_state(n) for n in ("PreparingRebalance", "PREPARING_REBALANCING",
                                     "CompletingRebalance", "COMPLETING_REBALANCING")} == {
        "rebalancing"}
    assert group_state("UNKNOWN") == group_state("") == "unknown"
