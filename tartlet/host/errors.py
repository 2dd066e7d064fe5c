"""Errors the host raises back into an inferlet.

They are ``ValueError``/``RuntimeError`` subclasses so inferlet code can catch
them by meaning; in a WASM build they cross the boundary as ``result`` error
strings that start with the class name.
"""

from __future__ import annotations


class HostError(RuntimeError):
    """Base class of errors raised by host calls."""


class InvalidHandleError(HostError, ValueError):
    """A call named a context, future or stream handle this instance does not own."""


class SnapshotError(HostError, ValueError):
    """A snapshot name that already exists (save) or does not exist (open, take, delete)."""


class LimitError(HostError):
    """An instance went past one of its limits (pages, wall time, instances)."""
