"""The parking lot agrees with the Kafka consumer's pauses and assignment after a rebalance.

The consumer here is a stand-in that keeps kafka-python's bookkeeping only (assignment,
paused flags, positions); the e2e tests run the lot against the real broker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kafka import TopicPartition

from consumers.parking import Parked, ParkingLot

P0, P1 = TopicPartition("t", 0), TopicPartition("t", 1)


@dataclass
class Bookkeeping:
    assigned: set[TopicPartition] = field(default_factory=lambda: {P0, P1})
    paused_: set[TopicPartition] = field(default_factory=set)
    positions: dict[TopicPartition, int] = field(default_factory=dict)

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def paused(self) -> set[TopicPartition]:
        return set(self.paused_)

    def pause(self, *tps: TopicPartition) -> None:
        self.paused_.update(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.paused_.difference_update(tps)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.positions[tp] = offset


@dataclass
class Rec:
    topic: str
    partition: int
    offset: int


def test_a_partition_kept_by_a_rebalance_stays_parked_and_is_woken_when_due() -> None:
    consumer, lot = Bookkeeping(), ParkingLot()
    lot.park(consumer, Parked("t", 0, 5, due=100.0))
    assert consumer.paused() == {P0}
    assert consumer.positions[P0] == 5
    lot.sync(consumer)  # a rebalance that kept both partitions (kafka-python keeps the pause)
    assert len(lot) == 1
    assert lot.without_parked([Rec("t", 0, 6), Rec("t", 1, 0)]) == [Rec("t", 1, 0)]
    lot.wake_due(consumer, now=100.0)
    assert consumer.paused() == set()
    assert lot.retries_in([Rec("t", 0, 5), Rec("t", 0, 6)]) == {("t", 0, 5)}
    lot.handled({("t", 0, 5)})
    assert len(lot) == 0


def test_a_partition_assigned_anew_is_forgotten_and_read_as_it_comes() -> None:
    consumer, lot = Bookkeeping(), ParkingLot()
    lot.park(consumer, Parked("t", 0, 5, due=100.0))
    consumer.paused_.clear()  # lost and assigned again: fresh state, not paused
    lot.sync(consumer)
    assert len(lot) == 0
    assert lot.without_parked([Rec("t", 0, 3)]) == [Rec("t", 0, 3)]  # not dropped unseen


def test_a_partition_taken_away_is_forgotten() -> None:
    consumer, lot = Bookkeeping(), ParkingLot()
    lot.park(consumer, Parked("t", 0, 5, due=0.0))
    lot.wake_due(consumer, now=1.0)  # resumed, its retry not read yet
    consumer.assigned = {P1}
    lot.sync(consumer)
    assert len(lot) == 0


def test_a_pause_the_lot_no_longer_holds_is_undone() -> None:
    consumer, lot = Bookkeeping(), ParkingLot()
    consumer.pause(P1)  # e.g. left by a probe, or by a lot that forgot the partition
    lot.sync(consumer)
    assert consumer.paused() == set()


def test_parking_a_partition_no_longer_assigned_does_nothing() -> None:
    consumer, lot = Bookkeeping(assigned={P1}), ParkingLot()
    lot.park(consumer, Parked("t", 0, 5, due=100.0))
    assert len(lot) == 0
    assert consumer.paused() == set()
