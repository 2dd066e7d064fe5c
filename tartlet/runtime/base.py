"""What the native and WASM runtimes share: the instance table, per-user
and per-instance limits, program lookup by name, and child launches.

A runtime subclass implements ``launch`` (and may override ``prepare``,
which does the slow part of a launch — a build, a compile — on the calling
thread). Two runtimes may share one instance table (the server's native and
sandboxed runtimes do), so ``max_instances_per_user`` counts both.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from ..host.api import HostApi
from ..host.session import Session
from ..sdk.errors import LimitError, ProgramError
from .instance import Instance, new_instance_id
from .instance_table import InstanceTable
from .program import BUNDLED_DIR, Program, find_in, list_programs

if TYPE_CHECKING:
    from ..host.state import HostState


#: a child's session sends kept for its parent: at most this many messages ...
CHILD_OUTPUT_MESSAGES = 10_000
#: ... and this many characters in all (later ones are dropped)
CHILD_OUTPUT_BYTES = 4 * 2**20


class RuntimeOptions(TypedDict, total=False):
    """Keyword arguments of :class:`BaseRuntime` that two runtimes built from
    one config share (as ``**options``; see its Args)."""

    time_limit_s: float | None
    max_pages: int | None
    max_instances_per_user: int | None
    program_dirs: list[Path] | None


class BaseRuntime:
    """Instances and limits common to every runtime.

    Args:
        state: the host's engines and registries.
        time_limit_s: default wall-time limit per instance, seconds (None: none).
        max_pages: distinct KV pages one instance's contexts may hold on
            one model, checked at every allocation (None: no limit).
        max_instances_per_user: running instances per owner, counted over
            ``instances`` (None: no limit).
        program_dirs: folders searched (before the bundled one) for
            inferlets launched by name (children, the server's installed ones).
        instances: an instance table to share with another runtime (default:
            a new one).
    """

    #: what :attr:`Instance.runtime` says of its instances
    kind = "native"

    def __init__(
        self,
        state: HostState,
        time_limit_s: float | None = None,
        max_pages: int | None = None,
        max_instances_per_user: int | None = None,
        program_dirs: list[Path] | None = None,
        instances: InstanceTable | None = None,
    ) -> None:
        self.state = state
        self.time_limit_s = time_limit_s
        self.max_pages = max_pages
        self.max_instances_per_user = max_instances_per_user
        self.program_dirs = list(program_dirs or [])
        self.instances: InstanceTable = instances if instances is not None else InstanceTable()
        #: the event loop instances run on (set by the first launch)
        self.loop: asyncio.AbstractEventLoop | None = None

    def running(self, owner: str | None = None) -> list[Instance]:
        """Running instances (of ``owner`` when given)."""
        return self.instances.running(owner)

    def finished(self, inst: Instance) -> None:
        """``inst`` ended (its status, result and error set, its resources
        freed): stamp ``finished_at``, wake its waiters, and move it to the
        table's ended instances (:class:`~.instance_table.InstanceTable`)."""
        inst.finished_at = time.time()
        inst.done.set()
        self.instances.ended(inst)

    def check_user_cap(self, owner: str) -> None:
        """Raises LimitError when ``owner`` already runs ``max_instances_per_user``."""
        cap = self.max_instances_per_user
        if cap is not None and len(self.running(owner)) >= cap:
            raise LimitError(f"user {owner or '(local)'!r} already runs {cap} instances, the limit (max_instances_per_user)")

    def new_instance(self, program: Program, args: dict[str, Any], session: Session, owner: str) -> Instance:
        """A new (not yet started) instance of ``program`` with its host API,
        built with everything it needs: the instance's id, its owner, this
        runtime (for children) and the page limit."""
        iid = new_instance_id()
        api = HostApi(self.state, session, instance_id=iid, owner=owner, runtime=self, max_pages=self.max_pages)
        return Instance(program, args, session, api, owner=owner, runtime=self.kind, id=iid)

    def find_program(self, name: str) -> Program:
        """A program by *name* only (no paths): ``program_dirs`` first, then
        the bundled inferlets.

        Raises:
            ProgramError: a name that is not plain (see
                :func:`~.program.check_name`: too long, a path separator),
                unknown, or unreadable; the message names no server path.
        """
        found = find_in(name, self.program_dirs + [BUNDLED_DIR])
        if found is not None:
            return found
        known = ", ".join(sorted(list_programs(self.program_dirs))) or "none"
        raise ProgramError(f"unknown inferlet {name!r:.80} (known: {known})")

    def prepare(self, program: Program) -> Program:
        """Do the slow, blocking part of launching ``program`` (here: check
        it imports). Call off the event loop when it may take long."""
        program.load_main()
        return program

    def launch(self, program: Program, args: dict[str, Any] | None = None, session: Session | None = None,
               owner: str = "", time_limit_s: float | None = None) -> Instance:  # fmt: skip
        raise NotImplementedError

    def launch_child(self, parent: HostApi, name: str, args: dict[str, Any]) -> Instance:
        """Launch ``name`` for ``parent``'s owner, in this runtime; its session
        sends are kept in ``child.output`` (up to ``CHILD_OUTPUT_MESSAGES``
        messages and ``CHILD_OUTPUT_BYTES`` characters), and it gets no client messages.
        Callable from the event loop or from an instance's own thread (a
        WASM parent: the build runs on that thread, the launch on the loop).

        Raises:
            ProgramError: unknown name; LimitError: too many instances, or
                the owner goes past ``[limits] max_launches_per_s`` (a rate).
        """
        program = self.find_program(name)
        rates = getattr(self.state, "rates", None)
        if rates is not None:
            rates.take(parent.owner, "launch")
        on_loop = self.loop is None or _on_loop(self.loop)
        if not on_loop:
            program = self.prepare(program)
        session = Session()
        output: list[str] = []
        kept = [0]  # bytes kept so far

        def keep(m: object) -> None:
            if isinstance(m, str) and len(output) < CHILD_OUTPUT_MESSAGES and kept[0] + len(m) <= CHILD_OUTPUT_BYTES:
                output.append(m)
                kept[0] += len(m)

        session.listen(keep)
        session.close()

        def start() -> Instance:
            child = self.launch(program, args, session, owner=parent.owner)
            child.output = output
            child.parent = parent.instance_id
            return child

        if on_loop:
            return start()

        async def start_async() -> Instance:
            return start()

        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(start_async(), self.loop).result()


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False

