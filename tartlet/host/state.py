"""What the host shares across inferlet instances: the loaded engines and
their snapshot registries."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.engine import Engine
from .messaging import MessageBus
from .snapshots import SnapshotRegistry


@dataclass
class ModelSlot:
    """One served model: its engine and its named snapshots."""

    engine: Engine
    snapshots: SnapshotRegistry = field(default_factory=SnapshotRegistry)


class HostState:
    """Engines by model name; the first one added is the default model.

    Raises (``model``):
        ValueError: an unknown model name, listing the served ones.
    """

    def __init__(self) -> None:
        self.models: dict[str, ModelSlot] = {}
        self.default_model: str | None = None
        self.bus = MessageBus()  # inferlet messaging (tartlet.host.messaging)
        self.store = None  # tartlet.host.store.Store; None: an in-memory one on first use
        self.http = None  # tartlet.host.http.HttpFetcher; None: HTTP from inferlets is off

    def add_engine(self, engine: Engine, name: str | None = None) -> None:
        name = name or engine.name
        self.models[name] = ModelSlot(engine)
        if self.default_model is None:
            self.default_model = name

    def model(self, name: str | None) -> ModelSlot:
        key = name or self.default_model
        try:
            return self.models[key]
        except KeyError:
            served = ", ".join(self.models) or "none"
            raise ValueError(f"model {name!r} is not served here (served: {served})") from None

    def close(self) -> None:
        for slot in self.models.values():
            slot.engine.close()
