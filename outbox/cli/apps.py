"""How the daemons' commands find the user's app: ``module:attribute``, as uvicorn does.

``outbox consume MODULE:APP`` (a ``consumers.Consumer``) and ``outbox worker MODULE:APP`` (an
``outbox.App``) both name their app this way.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TypeVar

from outbox.errors import ConfigurationError

__all__ = ["import_app"]

T = TypeVar("T")


def import_app(path: str, kind: type[T], what: str) -> T:
    """Import ``module:attribute`` (the working directory first on ``sys.path``) and check it
    is a *kind* (*what* names it in the error: ``"a consumers.Consumer"``).

    Raises :class:`ConfigurationError` with one line saying what is wrong, which
    :func:`outbox.cli.daemon.run_daemon` prints, exiting with status 2.
    """
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigurationError(f"app must be module:attribute, got {path!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like uvicorn: apps in the working directory
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r}: {exc}") from exc
    app = getattr(module, attribute, None)
    if not isinstance(app, kind):
        raise ConfigurationError(f"{path!r} is not {what} (got {type(app).__name__})")
    return app
