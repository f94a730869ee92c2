"""Bounding evidence: huge values are clipped with their size and sha256, long histories are
summarised, and nothing is left out without a count and a digest to prove what it was."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from dedup.ledger import Evidence, ReconcilePolicy
from dedup.ledger.outcomes import (
    DEFAULT_MAX_VALUE_BYTES,
    bound_events,
    canonical_digest,
    clip,
    clip_detail,
)
from outbox.errors import ConfigurationError

MB = "x" * 1_000_000


def size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode("utf-8"))


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class TestClip:
    def test_values_that_fit_are_returned_unchanged(self) -> None:
        fits = "y" * 300
        assert clip(fits, 300) is fits
        assert clip({"a": [1, 2]}, 300) == {"a": [1, 2]}
        for scalar in (None, True, 12, 3.5):
            assert clip(scalar, 256) == scalar

    def test_a_long_string_keeps_its_head_its_size_and_the_sha256_of_all_of_it(self) -> None:
        body = "HTTP 503: " + MB
        clipped = clip(body, 4096)
        assert len(clipped.encode("utf-8")) <= 4096
        assert clipped.startswith("HTTP 503: xxx")
        assert f"truncated: {len(body)} bytes in all, sha256:{sha256(body)}]" in clipped
        assert clip(body + "!", 4096) != clipped  # one more byte: another digest

    def test_multibyte_text_is_cut_on_a_character_boundary(self) -> None:
        body = "é€😀" * 10_000
        clipped = clip(body, 300)
        assert len(clipped.encode("utf-8")) <= 300
        assert body.startswith(clipped.split("…")[0])
        assert f"{len(body.encode())} bytes in all" in clipped

    def test_a_large_object_becomes_its_clipped_canonical_json(self) -> None:
        huge = {"rows": [{"n": i} for i in range(10_000)]}
        clipped = clip(huge, 512)
        assert isinstance(clipped, str)
        assert len(clipped.encode()) <= 512
        assert clipped.startswith('{"rows":[{"n":0}')
        assert canonical_digest(huge) in clipped  # the digest callers already compute

    def test_a_limit_without_room_for_the_note_is_refused(self) -> None:
        with pytest.raises(ConfigurationError, match=">= 256"):
            clip("x", 100)

    def test_clip_detail_keeps_the_keys_and_clips_only_what_is_too_big(self) -> None:
        detail = {"http_status": 500, "body": MB, "error": "short"}
        clipped = clip_detail(detail, 1024)
        assert clipped["http_status"] == 500
        assert clipped["error"] == "short"
        assert len(clipped["body"].encode()) <= 1024
        assert clip_detail(MB, 1024) == clip(MB, 1024)  # not an object: clipped as a whole


def event(kind: str, outcome: str, n: int, detail: Any = None) -> dict[str, Any]:
    return {"kind": kind, "outcome": outcome, "detail": detail, "actor": "t",
            "at": f"2024-01-01T00:{n // 60:02d}:{n % 60:02d}+00:00"}


def history(checks: int, body: str = "down") -> list[dict[str, Any]]:
    return [event("intent", "pending", 0, {"request_digest": "sha256:r"}),
            event("call", "unknown", 1, {"reason": f"first call: {body}"}),
            *(event("check", "unclear", 2 + i, {"reason": body, "check": i + 1})
              for i in range(checks))]


class TestBoundEvents:
    def test_a_short_history_is_kept_whole(self) -> None:
        events = history(3)
        bounded = bound_events(events, keep_last=20)
        assert bounded == {"events_total": 5, "events_elided": 0, "events": events}

    def test_keeps_the_intent_the_first_call_and_the_last_k_and_summarises_the_rest(
        self
    ) -> None:
        events = history(200)
        bounded = bound_events(events, keep_last=5)
        assert (bounded["events_total"], bounded["events_elided"]) == (202, 195)
        intent, call, gap, *last = bounded["events"]
        assert (intent, call) == (events[0], events[1])
        assert last == events[-5:]
        assert gap == {"elided": 195, "kinds": {"check/unclear": 195},
                       "from": events[2]["at"], "to": events[196]["at"],
                       "digest": canonical_digest(events[2:197])}

    def test_the_digest_is_of_the_events_as_they_were_not_as_clipped(self) -> None:
        events = history(30, body=MB)
        gap = bound_events(events, keep_last=3, max_value_bytes=512)["events"][2]
        assert gap["digest"] == canonical_digest(events[2:29])

    def test_each_kept_events_values_are_clipped(self) -> None:
        events = history(2, body=MB)
        bounded = bound_events(events, keep_last=20, max_value_bytes=1024)
        first_call = bounded["events"][1]
        assert first_call["kind"] == "call"
        assert len(first_call["detail"]["reason"].encode()) <= 1024
        assert sha256(f"first call: {MB}") in first_call["detail"]["reason"]
        assert bounded["events"][-1]["detail"]["check"] == 2

    def test_a_first_call_after_some_checks_leaves_two_gaps_each_counted(self) -> None:
        # The process died during the call: the reconciler checked before any call event.
        events = [event("intent", "pending", 0),
                  *(event("check", "not-found", 1 + i) for i in range(4)),
                  event("retry", "pending", 5), event("call", "unknown", 6),
                  *(event("check", "unclear", 7 + i) for i in range(10))]
        bounded = bound_events(events, keep_last=2)
        shape = [e.get("kind") or f"gap of {e['elided']}" for e in bounded["events"]]
        assert shape == ["intent", "gap of 5", "call", "gap of 8", "check", "check"]
        assert bounded["events_elided"] == 13

    def test_the_size_stays_bounded_however_many_and_however_big_the_events(self) -> None:
        limit, keep = 4096, 20
        bounded = bound_events(history(1000, body=MB), keep_last=keep, max_value_bytes=limit)
        # intent + first call + the last `keep`, each at most a few clipped values, + 1 gap
        assert size(bounded) < (keep + 2) * (limit + 512) + 2048
        assert size(bounded) < 150_000  # against a history of ~1 GB

    def test_keep_last_must_be_at_least_one(self) -> None:
        with pytest.raises(ConfigurationError, match="keep_last"):
            bound_events(history(1), keep_last=0)


class TestPolicyLimits:
    def test_defaults(self) -> None:
        policy = ReconcilePolicy()
        assert policy.evidence_last_events == 20
        assert policy.evidence_max_value_bytes == DEFAULT_MAX_VALUE_BYTES == 4096

    @pytest.mark.parametrize(("field", "value"), [
        ("evidence_last_events", 0),
        ("evidence_max_value_bytes", 255),
    ])
    def test_invalid_limits_are_refused_naming_the_setting(self, field: str, value: int) -> None:
        with pytest.raises(ConfigurationError, match=field):
            ReconcilePolicy(**{field: value})


class TestEvidenceOfResponse:
    def test_keeps_the_digest_of_the_whole_response_and_clips_huge_detail_values(self) -> None:
        response = {"order_id": "PO-1", "log": MB}
        evidence = Evidence.of_response(response, reference="PO-1", http_status=200,
                                        error=MB)
        assert evidence.response_digest == canonical_digest(response)
        assert evidence.detail["http_status"] == 200
        assert len(evidence.detail["error"].encode()) <= DEFAULT_MAX_VALUE_BYTES
        assert sha256(MB) in evidence.detail["error"]
        assert size(evidence.as_json()) < DEFAULT_MAX_VALUE_BYTES + 512

    def test_small_details_are_untouched_and_the_limit_can_be_raised(self) -> None:
        assert Evidence.of_response({}, error="out of stock").detail == {"error": "out of stock"}
        wide = Evidence.of_response({}, max_detail_bytes=2_000_000, error=MB)
        assert wide.detail["error"] == MB
