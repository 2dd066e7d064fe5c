"""Tartlet inferlet SDK.

An inferlet is a Python file or package with ``async def main(args: dict)``.
It drives generation itself through this SDK: :class:`Model`,
:class:`Context` (fill, forward, generate, fork, truncate, snapshots, masks),
:class:`Sampler`, stop conditions, and the client :mod:`~tartlet.session`.

The SDK imports nothing heavy (no torch, no numpy): it is bundled into WASM
builds. It reaches the host only through :mod:`tartlet._binding`.

The errors a host call raises (``KvCacheFullError``, ``SnapshotError``, ...)
are the classes of :mod:`tartlet.errors`, exported here too; native and
sandboxed inferlets see the same ones.
"""

# modules used as namespaces: tartlet.children, .http, .mcp, .messaging, .store (I/O), .session, .forward, .brle, .errors
from . import brle, children, errors, forward, http, mcp, messaging, session, store
from .adapter import Adapter, AdapterModule
from .constraint import AnyJson, Constraint, Grammar, JsonSchema, Regex  # constrained decoding
from .context import ChatNotAdoptedError, Context, ContextClosedError
from .drafter import AdaptiveDrafter, NgramDrafter
from .errors import (  # what host calls raise (tartlet.errors)
    AdapterError,
    ChatTemplateError,
    ContextLengthError,
    GrammarError,
    HostError,
    HttpError,
    InvalidHandleError,
    KvCacheFullError,
    KvQuotaError,
    LimitError,
    MessagingError,
    ProgramError,
    SamplingError,
    SequenceFreedError,
    SnapshotError,
    StoreError,
)
from .generator import Drafter, Generator, Step
from .model import Model
from .sampler import Sampler
from .stop import EosTokens, MaxTokens, StopCondition, StopStrings

__all__ = [
    "AdaptiveDrafter",
    "Adapter",
    "AdapterError",
    "AdapterModule",
    "AnyJson",
    "Constraint",
    "Grammar",
    "JsonSchema",
    "Regex",
    "Context",
    "ChatNotAdoptedError",
    "ContextClosedError",
    "Drafter",
    "EosTokens",
    "Generator",
    "MaxTokens",
    "NgramDrafter",
    "Model",
    "Sampler",
    "Step",
    "StopCondition",
    "StopStrings",
    "ChatTemplateError",
    "ContextLengthError",
    "GrammarError",
    "HostError",
    "HttpError",
    "InvalidHandleError",
    "KvCacheFullError",
    "KvQuotaError",
    "LimitError",
    "MessagingError",
    "ProgramError",
    "SamplingError",
    "SequenceFreedError",
    "SnapshotError",
    "StoreError",
    "errors",
    "brle",
    "children",
    "http",
    "mcp",
    "messaging",
    "store",
    "forward",
    "session",
]


