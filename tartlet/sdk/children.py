"""Child inferlets: ``runtime.launch(name, args)`` of the SDK.

``child = children.launch("text-completion", {"prompt": "Hi"})`` starts a
bundled or installed inferlet next to this one (same user, same limits) and
returns a :class:`Child`; ``await child.wait()`` gives its result,
``child.cancel()`` aborts it. Children still running when their parent ends
are aborted. (The module is not called ``runtime`` because
``tartlet.runtime`` is the host-side runtime package; ``tartlet.children``
holds it.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import _binding


class ChildError(RuntimeError):
    """A child inferlet failed or was aborted (``.status``, ``.error``)."""

    def __init__(self, status: str, error: str | None) -> None:
        super().__init__(f"child inferlet {status}: {error}")
        self.status, self.error = status, error


@dataclass
class ChildResult:
    """How a child ended: ``status`` (finished/failed/aborted), ``result``,
    ``error``, ``output`` (its session sends)."""

    id: str
    status: str
    result: Any
    error: str | None
    output: list[str] = field(default_factory=list)


class Child:
    """Handle to a running child inferlet."""

    def __init__(self, name: str, args: dict[str, Any]) -> None:
        self.name = name
        self._h = _binding.host().child_launch(name, args)
        self.id: str = _binding.host().child_id(self._h)

    async def join(self) -> ChildResult:
        """Wait for the end, however it ends."""
        r = await _binding.wait(_binding.host().child_wait(self._h))
        return ChildResult(**r)

    async def wait(self) -> Any:
        """Wait for the end; the child's return value.

        Raises:
            ChildError: it failed or was aborted.
        """
        r = await self.join()
        if r.status != "finished":
            raise ChildError(r.status, r.error)
        return r.result

    def cancel(self) -> None:
        """Abort the child (its pages are freed as it unwinds)."""
        _binding.host().child_abort(self._h)


def launch(name: str, args: dict[str, Any] | None = None) -> Child:
    """Start inferlet ``name`` with JSON ``args``.

    Raises:
        ValueError: unknown inferlet name.
        tartlet.errors.LimitError: the user runs too many instances.
    """
    if args is not None and not isinstance(args, dict):
        raise TypeError(f"child args must be a dict, got {type(args).__name__}")
    return Child(name, args or {})
