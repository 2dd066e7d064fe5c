"""A LoRA adapter as an inferlet names it for a pass (docs/adapters.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import AdapterError

if TYPE_CHECKING:
    from .model import Model


class Adapter:
    """A LoRA adapter the host serves for a model (``Model.adapter(name)``):
    pass it as ``adapter=`` to :meth:`Context.forward`,
    :meth:`Context.generate` or :meth:`Context.flush` and those passes run
    with it. Adapters are attached per pass: one context may run some
    passes with an adapter and others without, and the engine batches rows
    of every adapter (and of none) into the same model call.

    Attributes:
        model: the model it adapts.
        name: its name on the host (the server config's ``adapters`` table).
    """

    def __init__(self, model: "Model", name: str) -> None:
        self.model = model
        self.name = name

    def __repr__(self) -> str:
        return f"Adapter({self.model.name!r}, {self.name!r})"


def adapter_name(model: "Model", adapter: "Adapter | str | None") -> str | None:
    """The host name of ``adapter`` for a pass on ``model`` (None: the base model).

    Raises:
        AdapterError: an :class:`Adapter` of another model.
        TypeError: neither an Adapter, a str nor None.
    """
    if adapter is None or isinstance(adapter, str):
        return adapter
    if isinstance(adapter, Adapter):
        if adapter.model.name != model.name:
            raise AdapterError(f"adapter {adapter.name!r} is for model {adapter.model.name!r}, the context is on {model.name!r}")
        return adapter.name
    raise TypeError(f"adapter is a tartlet.Adapter (Model.adapter(name)), a name or None, got {type(adapter).__name__}")
