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
import traceback
from typing import Any

from ..host.session import Session
from ..sdk import _binding
from . import stdio
from .base import BaseRuntime
from .instance import Instance, Status
from .program import Program

log = logging.getLogger(__name__)


class NativeRuntime(BaseRuntime):
    """Launches programs in-process (arguments: :class:`~.base.BaseRuntime`).

    Set :attr:`capture_stdio` (the server does) to route what each instance
    prints to its :attr:`Instance.stdio` (:mod:`tartlet.runtime.stdio`);
    otherwise ``print`` writes to the process's stdout (``tartlet run``).
    """

    #: route instances' print() to their stdio (server mode)
    capture_stdio = False

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
            LimitError: ``owner`` already runs ``max_instances_per_user``.
            TypeError: ``args`` is not a dict.
        """
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise TypeError(f"inferlet args must be a JSON object, got {type(args).__name__}")
        self.check_user_cap(owner)
        main = program.load_main()
        session = session or Session()
        inst = self.new_instance(program, args, session, owner)
        limit = time_limit_s if time_limit_s is not None else self.time_limit_s
        self.loop = asyncio.get_running_loop()
        inst.task = self.loop.create_task(self._run(inst, main, limit), name=f"inferlet-{inst.id}")
        inst.task.add_done_callback(lambda _t: self._ended_before_start(inst))
        self.instances[inst.id] = inst
        return inst

    def _ended_before_start(self, inst: Instance) -> None:
        """An instance aborted before its task ever ran skips ``_run``'s
        cleanup: do it here."""
        if inst.done.is_set():
            return
        inst.status = Status.ABORTED
        inst.error = inst.error or "aborted"
        inst.api.close_io()
        inst.api.close()
        inst.session.close()
        self.finished(inst)

    async def _run(self, inst: Instance, main: Any, limit: float | None) -> None:
        _binding.bind(inst.api)
        if self.capture_stdio:
            stdio.install()  # print() of this task (and the tasks it starts) goes to inst.stdio
            stdio.bind(inst.stdio)
        try:
            # in this task, not one of wait_for's: a cancel unwinds the inferlet before the finally below frees its resources
            async with asyncio.timeout(limit or None):
                inst.result = await main(inst.args)
            inst.status = Status.FINISHED
        except asyncio.CancelledError:
            inst.status = Status.ABORTED
            inst.error = inst.error or "aborted"
        except TimeoutError:
            inst.status = Status.FAILED
            inst.error = f"time limit of {limit:g} s exceeded"
        except Exception as e:
            inst.status = Status.FAILED
            inst.error = f"{type(e).__name__}: {e}"
            inst.traceback = traceback.format_exc()
            log.debug("inferlet %s failed", inst.id, exc_info=True)
        finally:
            inst.stdio.flush()
            inst.api.close_io()
            inst.api.close()
            inst.session.close()
            self.finished(inst)
