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

from .. import _binding
from ..host.api import HostApi
from ..host.session import Session
from ..host.state import HostState
from .instance import Instance, Status
from .program import Program

log = logging.getLogger(__name__)


class NativeRuntime:
    """Launches programs in-process.

    Args:
        state: the host's engines and registries.
        time_limit_s: default wall-time limit per instance (None: none).
    """

    def __init__(self, state: HostState, time_limit_s: float | None = None) -> None:
        self.state = state
        self.time_limit_s = time_limit_s
        self.instances: dict[str, Instance] = {}

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
        main = program.load_main()
        session = session or Session()
        inst = Instance(program, args, session, HostApi(self.state, session), owner=owner)
        inst.api.instance_id = inst.id
        limit = time_limit_s if time_limit_s is not None else self.time_limit_s
        inst.task = asyncio.get_running_loop().create_task(self._run(inst, main, limit), name=f"inferlet-{inst.id}")
        self.instances[inst.id] = inst
        return inst

    async def _run(self, inst: Instance, main: Any, limit: float | None) -> None:
        _binding.bind(inst.api)
        try:
            coro = main(inst.args)
            inst.result = await (asyncio.wait_for(coro, limit) if limit else coro)
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
            inst.api.close()
            inst.session.close()
            inst.finished_at = time.time()
            inst.done.set()
