"""Failpoints: the syntax, the triggers, and that every documented one exists in the code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from outbox.runtime.failpoints import FAILPOINTS, parse

ROOT = Path(__file__).resolve().parents[2]


def test_every_failpoint_is_documented_and_every_documented_one_is_in_the_code() -> None:
    doc = (ROOT / "docs" / "failpoints.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_.]+)` \|", doc, re.M))
    assert documented == set(FAILPOINTS)
    packages = ("outbox", "relay", "consumers", "dedup", "outbox_agents")
    sources = "\n".join(p.read_text() for pkg in packages for p in (ROOT / pkg).rglob("*.py"))
    in_code = set(re.findall(r'failpoint\("([a-z_.]+)"\)', sources))
    assert in_code == set(FAILPOINTS)


def test_parse_reads_actions_triggers_and_seed() -> None:
    points, seed = parse("relay.after_ack=kill@37; relay.after_send=raise%0.25;"
                         "outbox.before_emit=sleep(150);seed=9")
    assert seed == 9
    assert (points["relay.after_ack"].action, points["relay.after_ack"].nth) == ("kill", 37)
    assert points["relay.after_send"].probability == 0.25
    assert (points["outbox.before_emit"].action, points["outbox.before_emit"].sleep_ms) == (
        "sleep", 150)


@pytest.mark.parametrize("spec", ["relay.after_ack=explode", "no.such.point=kill",
                                  "relay.after_ack=kill@x"])
def test_bad_specs_are_refused_with_the_reason(spec: str) -> None:
    with pytest.raises(ValueError, match="failpoint"):
        parse(spec)


def _run(spec: str, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={"OUTBOXKIT_FAILPOINTS": spec, "PATH": ""},
                          check=False)


def test_kill_on_the_nth_hit_kills_the_process_there() -> None:
    code = ("from outbox.runtime.failpoints import failpoint\n"
            "for i in range(1, 6):\n    print(i, flush=True)\n    failpoint('relay.after_ack')\n")
    result = _run("relay.after_ack=kill@3", code)
    assert result.returncode == -9
    assert result.stdout.split() == ["1", "2", "3"]


def test_raise_with_a_probability_is_repeatable_with_a_seed() -> None:
    code = ("from outbox.runtime.failpoints import failpoint, FailpointTriggered\nhits = []\n"
            "for i in range(200):\n    try:\n        failpoint('relay.after_send')\n"
            "    except FailpointTriggered:\n        hits.append(i)\nprint(hits)\n")
    first = _run("relay.after_send=raise%0.1;seed=4", code)
    second = _run("relay.after_send=raise%0.1;seed=4", code)
    assert first.stdout == second.stdout
    assert 5 < len(eval(first.stdout)) < 40  # noqa: S307 - our own printed list


def test_off_by_default_a_failpoint_does_nothing() -> None:
    result = _run("", "from outbox.runtime.failpoints import failpoint\n"
                      "failpoint('relay.after_ack')\nprint('ok')")
    assert result.stdout.strip() == "ok"
