"""A running inferlet: identity, status, result and its client session."""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..host.api import HostApi
from ..host.session import Session
from .program import Program
from .stdio import InstanceStdio


class Status(str, enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"


#: Prefix of new instance ids (``tartlet serve --replicas``: the replica's id
#: and a dash, so the gateway can tell which replica runs an instance).
INSTANCE_ID_PREFIX = ""


def set_instance_id_prefix(prefix: str) -> None:
    """Start every new instance id with ``prefix`` + ``-`` (a replica's id:
    letters and digits, no dash; empty: no prefix).

    Raises:
        ValueError: ``prefix`` holds a character other than ASCII letters and digits.
    """
    global INSTANCE_ID_PREFIX
    if prefix and not (prefix.isascii() and prefix.isalnum()):
        raise ValueError(f"an instance id prefix is ASCII letters and digits, got {prefix!r}")
    INSTANCE_ID_PREFIX = f"{prefix}-" if prefix else ""


def new_instance_id() -> str:
    """A fresh instance id: 12 hex digits, after :data:`INSTANCE_ID_PREFIX`."""
    return INSTANCE_ID_PREFIX + uuid.uuid4().hex[:12]


@dataclass
class Instance:
    """One launch of a program.

    Attributes:
        id: unique id (hex).
        program: what runs.
        args: the JSON arguments given to ``main``.
        session: messages to and from the client.
        api: the host API bound to this instance.
        status: running, finished, failed or aborted.
        result: ``main``'s return value once finished.
        error: why it failed or was aborted (None otherwise).
        owner: the user that launched it (server mode).
        runtime: ``"native"`` or ``"wasm"`` (sandboxed).
        parent: the launching instance's id, for a child inferlet (None
            otherwise).
        output: a child's session messages kept for its parent (strings,
            capped by ``CHILD_OUTPUT_MESSAGES``/``CHILD_OUTPUT_BYTES``).
    """

    program: Program
    args: dict[str, Any]
    session: Session
    api: HostApi
    owner: str = ""
    runtime: str = "native"
    id: str = field(default_factory=lambda: new_instance_id())
    status: Status = Status.RUNNING
    result: Any = None
    error: str | None = None
    traceback: str | None = None
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    task: asyncio.Task[None] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    parent: str | None = None
    output: list[str] = field(default_factory=list)
    #: what it prints (stdout/stderr): to the server log, and to ``stdio.sink`` when set
    stdio: InstanceStdio = field(init=False)

    def __post_init__(self) -> None:
        self.stdio = InstanceStdio(self.id, self.owner)

    def abort(self, reason: str = "aborted") -> None:
        """Cancel the inferlet; its pages are freed when it unwinds. Once:
        a later abort while it unwinds from the first changes nothing (a
        second cancel would interrupt its cleanup: its ``finally`` blocks
        and context managers), and the first reason stays."""
        if self.status is Status.RUNNING and self.task is not None and not self.task.cancelling():
            self.error = reason
            self.task.cancel()

    async def wait(self) -> Any:
        """Wait for the end; returns ``result`` (status tells how it ended)."""
        await self.done.wait()
        return self.result
