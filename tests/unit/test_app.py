"""outbox.App: what a step function's annotation means, and the errors for what it cannot be."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import BaseModel
from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12

from outbox import App, CheckpointInvalid, ClaimedRun, ConfigurationError, RunError
from outbox.aio import AsyncClaimedRun


class Order(BaseModel):
    item: str
    qty: int


@dataclasses.dataclass
class Point:
    x: int


class Shape(TypedDict):
    sides: int


class TestRegistration:
    def test_the_annotation_gives_the_checkpoint_type_and_sync_or_async(self) -> None:
        app = App()

        @app.workflow("a", version="1")
        def a(job: ClaimedRun[Order]) -> None: ...

        @app.workflow("b", version="1")
        async def b(job: AsyncClaimedRun[Point]) -> None: ...

        @app.workflow("c", version="1")
        def c(job: ClaimedRun) -> None: ...  # type: ignore[type-arg]

        steps = {"a": app.step(a), "b": app.step(b), "c": app.step(c)}
        assert (steps["a"].checkpoint_type, steps["a"].is_async) == (Order, False)
        assert (steps["b"].checkpoint_type, steps["b"].is_async) == (Point, True)
        assert steps["c"].checkpoint_type is Any

    def test_a_step_function_without_an_annotation_is_refused_by_name(self) -> None:
        app = App()
        with pytest.raises(ConfigurationError, match=r"parameter 'job' has no annotation; "
                           r"annotate it ClaimedRun\[T\]"):
            @app.workflow("a", version="1")
            def decide(job) -> None: ...  # type: ignore[no-untyped-def]

    def test_an_async_function_annotated_with_the_sync_handle_is_refused(self) -> None:
        app = App()
        with pytest.raises(ConfigurationError, match="an async def gets AsyncClaimedRun"):
            @app.workflow("a", version="1")
            async def decide(job: ClaimedRun[Order]) -> None: ...

    def test_a_function_taking_something_else_is_refused(self) -> None:
        app = App()
        with pytest.raises(ConfigurationError, match=r"annotated Order; annotate it ClaimedRun"):
            @app.workflow("a", version="1")
            def decide(job: Order) -> None: ...
        with pytest.raises(ConfigurationError, match="a step function takes"):
            @app.workflow("b", version="1")
            def two(job: ClaimedRun[Order], other: int) -> None: ...

    def test_one_version_registered_twice_is_refused(self) -> None:
        app = App()

        @app.workflow("a", version="1")
        def one(job: ClaimedRun[Any]) -> None: ...

        with pytest.raises(ConfigurationError, match="version '1' is registered twice"):
            @app.workflow("a", version="1")
            def again(job: ClaimedRun[Any]) -> None: ...

    def test_the_newest_version_is_last_with_numbers_compared_as_numbers(self) -> None:
        app = App()

        for version in ("10", "9", "2"):
            def step(job: ClaimedRun[Any]) -> None: ...

            app.workflow("a", version=version)(step)
        assert [w.version for w in app.workflows] == ["2", "9", "10"]
        assert app.step("a").workflow.version == "10"

    def test_unknown_workflows_are_named(self) -> None:
        app = App()

        @app.workflow("known", version="1")
        def known(job: ClaimedRun[Any]) -> None: ...

        with pytest.raises(ConfigurationError, match=r"'other' is not registered in this app "
                           r"\(registered: known\)"):
            app.step("other")
        with pytest.raises(ConfigurationError, match="is not a registered workflow"):
            app.step(lambda job: None)


class TestCheckpoints:
    def test_a_checkpoint_is_validated_and_stored_as_json_for_each_kind_of_type(self) -> None:
        app = App()

        @app.workflow("m", version="1")
        def m(job: ClaimedRun[Order]) -> None: ...

        @app.workflow("d", version="1")
        def d(job: ClaimedRun[Point]) -> None: ...

        @app.workflow("t", version="1")
        def t(job: ClaimedRun[Shape]) -> None: ...

        assert app.step(m).dump(Order(item="x", qty=1)) == {"item": "x", "qty": 1}
        assert app.step(m).dump({"item": "x", "qty": "2"}) == {"item": "x", "qty": 2}
        assert app.step(d).dump(Point(x=3)) == {"x": 3}
        assert app.step(t).dump({"sides": 4}) == {"sides": 4}

    def test_a_checkpoint_that_does_not_fit_is_refused_naming_the_field(self) -> None:
        app = App()

        @app.workflow("m", version="1")
        def m(job: ClaimedRun[Order]) -> None: ...

        with pytest.raises(CheckpointInvalid, match=r"not a valid Order \(qty: Field required"):
            app.step(m).dump({"item": "x"})
        assert issubclass(CheckpointInvalid, RunError)  # final for every RetryPolicy


class TestReviewFixes:
    def test_workflow_takes_retired_and_retired_reason_like_workflow(self) -> None:
        app = App()

        @app.workflow("old", version="1", retired=True, retired_reason="replaced by new")
        def old(job: ClaimedRun[Any]) -> None: ...

        definition = app.step(old).workflow
        assert (definition.retired, definition.retired_reason) == (True, "replaced by new")

    def test_no_checkpoint_for_a_typed_step_is_refused_at_start_without_migrate_advice(
            self) -> None:
        """A run the worker would refuse is not queued: None is validated too."""
        app = App()

        @app.workflow("order", version="1")
        def decide(job: ClaimedRun[Order]) -> None: ...

        with pytest.raises(CheckpointInvalid, match="the checkpoint given for workflow "
                                                    "'order' is not a valid Order") as caught:
            app.step(decide).dump(None)
        assert "migrate" not in str(caught.value)

    def test_no_checkpoint_is_fine_for_a_type_that_accepts_none(self) -> None:
        app = App()

        @app.workflow("maybe", version="1")
        def maybe(job: ClaimedRun[Order | None]) -> None: ...

        assert app.step(maybe).dump(None) is None

    def test_the_worker_internals_are_private_one_public_spelling_each(self) -> None:
        app = App()
        assert not hasattr(app, "steps")
        assert not hasattr(app, "step_for")
        assert callable(app.step)
        assert app.workflows == []

    def test_a_run_runs_the_version_its_pins_match_prompt_and_tool_schema_too(self) -> None:
        """As the claim's version check: a run pinned to version 1 under another prompt is
        not version 1's (the claim applied the newest's policy), so the newest runs it."""
        import uuid  # noqa: PLC0415
        from datetime import UTC, datetime  # noqa: PLC0415

        from outbox.runs.lifecycle import Run  # noqa: PLC0415
        from outbox.runs.states import RunState  # noqa: PLC0415

        app = App()

        @app.workflow("wf", version="1", prompt_version="p1", on_version_change="continue")
        def one(job: ClaimedRun[Any]) -> None: ...

        @app.workflow("wf", version="2", prompt_version="p2", on_version_change="continue")
        def two(job: ClaimedRun[Any]) -> None: ...

        now = datetime.now(UTC)

        def run(version: str, prompt: str) -> Run:
            return Run(id=uuid.uuid4(), workflow="wf", workflow_version=version,
                       prompt_version=prompt, tool_schema_version=None,
                       state=RunState.RUNNING, step=None, checkpoint=None, last_evidence=None,
                       idempotency_key="k", attempts=0, not_before=None, reason=None,
                       created_at=now, updated_at=now, finished_at=None, purged_at=None)

        assert app._step_for(run("1", "p1")).fn is one
        assert app._step_for(run("1", "p-old")).fn is two
        assert app._step_for(run("2", "p2")).fn is two
