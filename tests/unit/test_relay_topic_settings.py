"""The replication the relay gives the topics it creates."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from outbox.cli.flags import explain
from relay.publisher import under_replicated
from relay.settings import RelaySettings


def test_created_topics_take_the_brokers_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 (the old default) left a topic created on a 3-broker cluster with one replica.
    monkeypatch.delenv("OUTBOXKIT_RELAY_TOPIC_REPLICATION", raising=False)
    assert RelaySettings().topic_replication == -1


@pytest.mark.parametrize("value", [1, 3])
def test_a_chosen_replication_is_kept(value: int) -> None:
    assert RelaySettings(topic_replication=value).topic_replication == value


@pytest.mark.parametrize("value", [0, -2])
def test_a_replication_that_cannot_be_is_refused_by_name(value: int) -> None:
    with pytest.raises(ValidationError) as caught:
        RelaySettings(topic_replication=value)
    text = explain(caught.value, "OUTBOXKIT_RELAY_")
    assert "TOPIC_REPLICATION" in text.upper()


@pytest.mark.parametrize(
    ("replicas", "brokers", "warned"),
    [
        (1, 1, False),  # a single broker: nothing better to be had
        (1, 2, True),
        (2, 2, False),
        (1, 3, True),
        (2, 3, True),
        (3, 3, False),
        (3, 5, False),  # 3 is what is recommended, not every broker
        (0, 3, False),  # unknown topic: nothing to say
    ],
)
def test_a_created_topic_is_under_replicated_below_what_the_cluster_allows(
    replicas: int, brokers: int, warned: bool
) -> None:
    assert under_replicated(replicas, brokers) is warned
