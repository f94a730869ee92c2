"""The outbox-side names outbox exports (the run side pins its own in test_runs_public_api)."""

from __future__ import annotations

import importlib
import inspect

import outbox
from outbox import aio
from outbox.runs import confirm

# outbox.emit is the function once the package re-exports it; the module is in sys.modules.
emit = importlib.import_module("outbox.messages.emit")

OUTBOX_API = {
    "Envelope",
    "InvalidMessage",
    "LeaseLost",
    "SchemaError",
    "Confirmation",
    "apply_confirmation",
    "check_schema",
    "confirmations",
    "emit",
    "emit_many",
    "migrate",
    "pending_sql",
}


def test_outbox_exports_the_outbox_api_sorted_and_importable() -> None:
    assert set(outbox.__all__) >= OUTBOX_API
    assert outbox.__all__ == sorted(outbox.__all__)
    assert all(hasattr(outbox, name) for name in OUTBOX_API)


def test_outbox_all_is_exactly_the_pinned_surface() -> None:
    from tests.unit.test_runs_public_api import RUN_API  # noqa: PLC0415

    base_errors = {"ConfigurationError", "MissingToolError", "OutboxError", "ServiceError"}
    assert set(outbox.__all__) == OUTBOX_API | RUN_API | base_errors


def test_write_side_functions_say_they_never_commit() -> None:
    for function in (
        emit.emit,
        aio.emit,
        emit.emit_many,
        aio.emit_many,
        confirm.apply_confirmation,
        aio.apply_confirmation,
    ):
        assert function.__doc__ is not None
        assert "never commits" in function.__doc__.lower(), function.__name__


def test_one_async_convention_the_twin_of_outbox_x_is_outbox_aio_x() -> None:
    """No public name spells async: each asyncio twin is ``outbox.aio`` + the sync name."""
    spelled = [name for module in (outbox, aio) for name in module.__all__ if "async" in name]
    assert spelled == []
    for name in ("emit", "emit_many", "apply_confirmation", "purge", "purge_batch",
                 "purgeable", "claim", "transition"):
        assert name in aio.__all__, name


def test_every_public_function_binds_settings_the_same_way() -> None:
    """``settings=``: keyword-only, optional (``None`` reads the environment), one type; the
    run handles carry it instead (docs/configuration.md, "Shared settings")."""
    functions = [getattr(module, name) for module in (outbox, aio) for name in module.__all__
                 if inspect.isfunction(getattr(module, name))]
    assert len(functions) > 50
    for function in functions:
        parameter = inspect.signature(function).parameters["settings"]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, function.__qualname__
        assert parameter.default is None, function.__qualname__
        assert parameter.annotation == "OutboxSettings | None", function.__qualname__
    for handle in (outbox.ClaimedRun, aio.AsyncClaimedRun):
        for name, method in inspect.getmembers(handle, inspect.isfunction):
            if name == "__init__":  # the constructor is where the handle gets it
                continue
            assert "settings" not in inspect.signature(method).parameters, name
