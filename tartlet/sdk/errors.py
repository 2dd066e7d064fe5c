"""The errors a host call can raise into an inferlet, defined once.

The host (:mod:`tartlet.host`), the engine (:mod:`tartlet.engine`) and the
SDK all use these classes — the engine's ``KvCacheFullError`` is this module's
— so an inferlet catches the specific class in both runtimes::

    from tartlet.errors import SnapshotError
    try:
        ctx = Context.open(model, "cached-prefix")
    except SnapshotError:
        ...

Every class derives from ``ValueError`` (the call's arguments or the named
object are wrong; nothing changed) or ``RuntimeError`` (the call was fine but
could not be carried out now), so coarse ``except ValueError`` keeps working.

Across the WASM boundary an error travels as a WIT ``call-error`` record
(``code``: an ``error-code`` enum case, ``message``: the text). :data:`ERROR_CODES`
is that enum's table, read by both sides: the host sends the code of the
nearest class in the exception's MRO (:func:`error_code`), the guest raises
the class of the code it receives (:func:`error_from_code`).

SDK-side errors that never cross the boundary live with their module:
``tartlet.ContextClosedError``, ``tartlet.children.ChildError``,
``tartlet.mcp.McpError``, ``tartlet.tools.ToolSpecError``.

This module imports nothing: it sits at the bottom of the layers (the SDK),
and the engine, host and runtime import it from there.
"""

from __future__ import annotations


class HostError(RuntimeError):
    """Base class of the host's own errors (handles, snapshots, limits, HTTP)."""


class InvalidHandleError(HostError, ValueError):
    """A call named a context, decoder, future, subscription, child or grammar
    handle this instance does not own (destroyed, or never created)."""


class SnapshotError(HostError, ValueError):
    """A snapshot name that is invalid, already exists (save) or does not
    exist (open, take, delete), or a snapshot file that is corrupt."""


class LimitError(HostError):
    """An instance or user went past one of its limits (contexts, pages,
    instances, snapshots, messaging bytes, wall time)."""


class HttpError(HostError):
    """An HTTP fetch refused (host not allowed, bad URL, body too big) or
    failed (timeout, connection error, response too big)."""


class SamplingError(ValueError):
    """A sampler or probe cannot produce a result (bad parameters, or a logit
    mask that allows no token)."""


class ContextLengthError(ValueError):
    """A request would make a sequence longer than the model's context."""


class ChatTemplateError(ValueError):
    """A chat template failed to compile or raised an error while rendering."""


class KvCacheFullError(RuntimeError):
    """A sequence needs more KV pages than the pool can provide."""


class KvQuotaError(KvCacheFullError):
    """Taking more KV pages would pass a quota (per instance, per user, or the
    user's snapshots). Only the request or call that hit it fails."""


class SequenceFreedError(RuntimeError):
    """A request names a sequence (context) that was already freed."""


class GrammarError(ValueError):
    """A grammar spec that is invalid, unsupported or unsatisfiable, or a
    token the grammar does not allow. The message names the problem."""


class MessagingError(ValueError):
    """A bad topic or message, a full backlog, or an unknown subscription."""


class StoreError(ValueError):
    """A bad store key or value (the message says which limit), or a shared
    store database (``[store] url``) that cannot be reached."""


class AdapterError(ValueError):
    """A LoRA adapter that cannot be loaded or used: a bad or unsupported
    file (``modules_to_save``, DoRA, ...), one made for another base model
    (other layer count, other shapes), a module the model has no projection
    for, or an adapter name the model does not serve. The message names the
    file and the module."""


class ProgramError(ValueError):
    """An inferlet that cannot be found, read or loaded (e.g. an unknown name
    given to ``children.launch``)."""


#: WIT ``error-code`` case (kebab-case of the class name) -> exception class;
#: the order is the WIT enum's (tests/runtime/test_wit_contract.py checks both).
#: :func:`error_code` walks an exception's MRO, so the most specific class
#: wins; ``other`` (``Exception``) catches the rest.
ERROR_CODES: dict[str, type[Exception]] = {
    "host-error": HostError,
    "invalid-handle-error": InvalidHandleError,
    "snapshot-error": SnapshotError,
    "limit-error": LimitError,
    "http-error": HttpError,
    "sampling-error": SamplingError,
    "context-length-error": ContextLengthError,
    "chat-template-error": ChatTemplateError,
    "kv-cache-full-error": KvCacheFullError,
    "kv-quota-error": KvQuotaError,
    "sequence-freed-error": SequenceFreedError,
    "grammar-error": GrammarError,
    "messaging-error": MessagingError,
    "store-error": StoreError,
    "program-error": ProgramError,
    "adapter-error": AdapterError,
    "value-error": ValueError,
    "type-error": TypeError,
    "key-error": KeyError,
    "index-error": IndexError,
    "eof-error": EOFError,
    "timeout-error": TimeoutError,
    "permission-error": PermissionError,
    "os-error": OSError,
    "overflow-error": OverflowError,
    "not-implemented-error": NotImplementedError,
    "runtime-error": RuntimeError,
    "other": Exception,
}

_CODE_OF: dict[type, str] = {cls: code for code, cls in ERROR_CODES.items()}


def error_code(exc: BaseException) -> tuple[str, str]:
    """The WIT ``(code, message)`` of ``exc``: the code of the first class in
    its MRO that has one (``KvQuotaError`` -> ``kv-quota-error``, a
    ``ValueError`` subclass of no code here -> ``value-error``). When the class itself has no code,
    the message keeps its name (``"UnicodeDecodeError: ..."``) so nothing is lost.
    """
    cls = type(exc)
    # KeyError's str() quotes its argument: send the argument itself
    text = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
    for base in cls.__mro__:
        code = _CODE_OF.get(base)
        if code is not None:
            return code, text if base is cls else f"{cls.__name__}: {text}"
    return "other", f"{cls.__name__}: {text}"  # a BaseException that is not an Exception


def error_from_code(code: str, message: str) -> Exception:
    """The exception for a WIT ``(code, message)``; an unknown code (a newer
    host) gives a :class:`HostError` that names it."""
    cls = ERROR_CODES.get(code)
    if cls is None:
        return HostError(f"[{code}] {message}")
    return cls(message)


__all__ = [
    "ERROR_CODES",
    "AdapterError",
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
    "error_code",
    "error_from_code",
]
