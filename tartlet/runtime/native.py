"""The native runtime: trusted Python inferlets as asyncio tasks.

Each instance runs ``main(args)`` in its own task with its
:class:`~tartlet.host.api.HostApi` bound (a context variable, inherited by
tasks it spawns), so many inferlets share one event loop and their forward
passes meet in the scheduler's batches. Whatever way an instance ends
(return, exception, time limit, abort), the host frees its contexts.

Native inferlets are trusted: a synchronous infinite loop blocks the event
loop. Untrusted code runs in the WASM runtime instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from typing import Any

from pathlib import Path

from .. import _binding
from ..host.api import HostApi
from ..host.errors import LimitError
from ..host.session import Session
from ..host.state import HostState
from .instance import Instance, Status
from .program import Program, ProgramError, load_program

log = logging.getLogger(__name__)


class LimitedHostApi(HostApi):
    """A host API that checks the instance's page limit before each forward pass."""

    def forward(self, handle: int, tokens: list[int], *args: Any, **kw: Any) -> Any:
        if isinstance(tokens, list):
            self.check_page_limit(handle, len(tokens))
        return super().forward(handle, tokens, *args, **kw)


class NativeRuntime:
    """Launches programs in-process.

    Args:
        state: the host's engines and registries.
        time_limit_s: default wall-time limit per instance (None: none).
        max_pages: KV pages one instance's contexts may span (None: no limit).
        max_instances_per_user: running instances per owner (None: no limit).
        program_dirs: folders searched (before the bundled one) for child
            inferlets launched by name.
    """

    def __init__(
        self,
        state: HostState,
        time_limit_s: float | None = None,
        max_pages: int | None = None,
        max_instances_per_user: int | None = None,
        program_dirs: list[Path] | None = None,
    ) -> None:
        self.state = state
        self.time_limit_s = time_limit_s
        self.max_pages = max_pages
        self.max_instances_per_user = max_instances_per_user
        self.program_dirs = list(program_dirs or [])
        self.instances: dict[str, Instance] = {}

    def running(self, owner: str | None = None) -> list[Instance]:
        """Running instances (of ``owner`` when given)."""
        return [i for i in self.instances.values() if i.status is Status.RUNNING and (owner is None or i.owner == owner)]

    def launch(
        self,
        program: Program,
        args: dict[str, Any] | None = None,
        session: Session | None = None,
        owner: str = "",
        time_limit_s: float | None = None,
    ) -> Instance:
        """Start ``program`` with ``args`` on the running event loop.

        Raises:
            tartlet.runtime.program.ProgramError: the program fails to load.
            TypeError: ``args`` is not a dict.
        """
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise TypeError(f"inferlet args must be a JSON object, got {type(args).__name__}")
        cap = self.max_instances_per_user
        if cap is not None and len(self.running(owner)) >= cap:
            raise LimitError(f"user {owner or '(local)'!r} already runs {cap} instances, the limit (max_instances_per_user)")
        main = program.load_main()
        session = session or Session()
        api_cls = LimitedHostApi if self.max_pages is not None else HostApi
        inst = Instance(program, args, session, api_cls(self.state, session), owner=owner)
        inst.api.instance_id = inst.id
        inst.api.owner, inst.api.runtime, inst.api.max_pages = owner, self, self.max_pages
        inst.api.on_limit = lambda msg, inst=inst: self._kill_for_limit(inst, msg)
        limit = time_limit_s if time_limit_s is not None else self.time_limit_s
        inst.task = asyncio.get_running_loop().create_task(self._run(inst, main, limit), name=f"inferlet-{inst.id}")
        inst.task.add_done_callback(lambda _t, inst=inst: self._ended_before_start(inst))
        self.instances[inst.id] = inst
        return inst

    @staticmethod
    def _ended_before_start(inst: Instance) -> None:
        """An instance aborted before its task ever ran skips ``_run``'s
        cleanup: do it here."""
        if inst.done.is_set():
            return
        inst.status = Status.ABORTED
        inst.error = inst.error or "aborted"
        inst.api.close_io()
        inst.api.close()
        inst.session.close()
        inst.finished_at = time.time()
        inst.done.set()

    def _kill_for_limit(self, inst: Instance, msg: str) -> None:
        inst.limit_error = msg  # type: ignore[attr-defined]
        inst.abort(msg)

    def find_program(self, name: str) -> Program:
        """A program by *name* only (no paths): ``program_dirs`` first, then
        the bundled inferlets.

        Raises:
            ProgramError: a name with a path separator, or unknown.
        """
        from .program import BUNDLED_DIR, list_programs

        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith("."):
            raise ProgramError(f"an inferlet name is a plain name like 'text-completion', got {name!r}")
        for d in self.program_dirs + [BUNDLED_DIR]:
            cand = Path(d) / name
            if cand.is_dir():
                return load_program(cand)
            if cand.with_suffix(".py").is_file():
                return load_program(cand.with_suffix(".py"))
        known = ", ".join(sorted(list_programs(self.program_dirs))) or "none"
        raise ProgramError(f"unknown inferlet {name!r} (known: {known})")

    def launch_child(self, parent: HostApi, name: str, args: dict[str, Any]) -> Instance:
        """Launch ``name`` for ``parent``'s owner; its session sends are kept
        in ``child.output``, and it gets no client messages."""
        program = self.find_program(name)
        session = Session()
        output: list[str] = []
        session.listen(lambda m: output.append(m) if isinstance(m, str) and len(output) < 10_000 else None)
        session.close()
        child = self.launch(program, args, session, owner=parent.owner)
        child.output = output  # type: ignore[attr-defined]
        child.parent = parent.instance_id  # type: ignore[attr-defined]
        return child

    async def _run(self, inst: Instance, main: Any, limit: float | None) -> None:
        _binding.bind(inst.api)
        try:
            coro = main(inst.args)
            inst.result = await (asyncio.wait_for(coro, limit) if limit else coro)
            inst.status = Status.FINISHED
        except asyncio.CancelledError:
            limit_error = getattr(inst, "limit_error", None)
            inst.status = Status.FAILED if limit_error else Status.ABORTED
            inst.error = limit_error or inst.error or "aborted"
        except TimeoutError:
            inst.status = Status.FAILED
            inst.error = f"time limit of {limit:g} s exceeded"
        except Exception as e:
            inst.status = Status.FAILED
            inst.error = f"{type(e).__name__}: {e}"
            inst.traceback = traceback.format_exc()
            log.debug("inferlet %s failed", inst.id, exc_info=True)
        finally:
            inst.api.close_io()
            inst.api.close()
            inst.session.close()
            inst.finished_at = time.time()
            inst.done.set()
