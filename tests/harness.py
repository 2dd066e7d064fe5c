"""Helpers for tests that run inferlets on the real model."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from tartlet.host.session import Session
from tartlet.host.state import HostState
from tartlet.runtime.instance import Instance, Status
from tartlet.runtime.native import NativeRuntime
from tartlet.runtime.program import Program, find_program, load_program


def drain(state: HostState) -> None:
    """Wait until every engine has run all work queued so far, including
    work deferred behind its sequence's pass in flight (a context's free
    queued while a host ``generate`` step still runs): a no-op command
    touches no sequence, so it can run before such deferred work; repeat
    until nothing is queued."""
    for slot in state.models.values():
        sched = slot.engine.scheduler
        for _ in range(1000):
            sched.command(lambda: None).result(timeout=60)
            if not sched.queued():
                break
        else:
            raise AssertionError(f"{sched.queued()} items still queued after 1000 rounds")


def assert_no_leaks(state: HostState) -> None:
    """Every page is free, cached, or held by a named snapshot, and every
    user's page account holds just its snapshots' pages (call it once no
    instance runs)."""
    drain(state)
    for name, slot in state.models.items():
        pool = slot.engine.pool
        held = set()
        by_owner: dict[str, set[int]] = {}
        for snap in slot.snapshots.registry.all():
            pages = {p for p in (snap.seq.pages if snap.seq is not None else []) if p is not None}
            held |= pages
            by_owner.setdefault(snap.owner, set()).update(pages)
        st = pool.stats()
        assert st.used == len(held), f"{name}: {st.used} pages in use, snapshots hold {len(held)}: a page leaked"
        for owner, acc in slot.accounts._users.items():
            assert acc.pages == len(by_owner.get(owner, ())), f"{name}: {acc} after every instance ended"


def inline_program(tmp_path: Path, code: str, name: str = "inline") -> Program:
    """A program from source text (dedented), written under ``tmp_path``."""
    f = tmp_path / f"{name}.py"
    f.write_text(textwrap.dedent(code))
    return load_program(f)


async def run(runtime: NativeRuntime, program: Program | str, args: dict[str, Any] | None = None, **kw: Any) -> Instance:
    """Launch and wait; returns the ended instance (its output in ``inst.output``)."""
    if isinstance(program, str):
        program = find_program(program)
    session = Session()
    out: list[str | bytes] = []
    session.listen(out.append)
    inst = runtime.launch(program, args or {}, session, **kw)
    await inst.wait()
    inst.output = out  # type: ignore[attr-defined]
    return inst


async def run_ok(runtime: NativeRuntime, program: Program | str, args: dict[str, Any] | None = None, **kw: Any) -> Any:
    """Launch, wait, and require a normal finish; returns ``main``'s result."""
    inst = await run(runtime, program, args, **kw)
    assert inst.status is Status.FINISHED, f"{inst.status.value}: {inst.error}\n{inst.traceback or ''}"
    return inst.result
