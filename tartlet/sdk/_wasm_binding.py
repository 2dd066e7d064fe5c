"""The SDK's single door to the host inside a WASM component.

``tartlet build`` bundles this file as ``tartlet/sdk/_binding.py`` in place of
the native binding, so the SDK calls the same two functions in both modes:

- :func:`host` returns an adapter whose methods have the names, arguments
  and return values of :class:`tartlet.host.api.HostApi` and call the
  component's WIT imports (``wit/tartlet.wit``: interfaces ``model``,
  ``context``, ``inference``, ``grammar``, ``io``, their types in ``types``).
  Calls that wait on the engine return a :class:`HostFuture` (a ``u64``
  handle) instead of a ``concurrent.futures.Future``.
- :func:`wait` awaits a :class:`HostFuture` on the guest's asyncio loop
  (:class:`HostLoop`), whose selector blocks in the host's ``wait-any``
  when no coroutine is ready, so several forward passes of one instance
  stay in flight together and batch in the scheduler.

Host errors arrive as ``result`` errors ``call-error { code, message }``
and are raised again as the class of that code
(:data:`tartlet.errors.ERROR_CODES`): the classes of :mod:`tartlet.errors`,
the same objects the native host raises, or builtins.

This module imports the componentize-py bindings (``wit_world``), so it
only imports inside a component build.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import traceback
from typing import Any

from componentize_py_types import Err
from wit_world.imports import context as _wit_context
from wit_world.imports import grammar as _wit_grammar
from wit_world.imports import inference as _wit_inference
from wit_world.imports import io as _wit_io
from wit_world.imports import model as _wit_model
from wit_world.imports import types as _wit_types

from .attention_probe import AttentionProbe, probe_record, scores_from_record
from .errors import ERROR_CODES, AdapterError, HostError, InvalidHandleError, SamplingError
from .forward import OUTPUT_KINDS, OutputSlot
from .sampler import slot_dry, validate_filters

# -- errors ---------------------------------------------------------------------
# WIT ``error-code`` case -> the SDK's class (tartlet/sdk/errors.py), the very one
# the native host raises; componentize-py spells enum cases in UPPER_SNAKE.
_CLASSES: dict[Any, type[Exception]] = {getattr(_wit_types.ErrorCode, c.upper().replace("-", "_")): cls for c, cls in ERROR_CODES.items()}


def _error(err: Any) -> Exception:
    """The exception for a WIT ``call-error`` (``code``, ``message``)."""
    cls = _CLASSES.get(err.code)
    if cls is None:  # pragma: no cover - the table covers the whole enum
        return HostError(f"[{err.code}] {err.message}")
    return cls(err.message)


def _call(fn: Any, *args: Any) -> Any:
    """Call a WIT import; a host error is raised as its exception class, and
    an argument the WIT types cannot carry (a negative handle, a huge int)
    as ``ValueError`` naming the call."""
    try:
        return fn(*args)
    except Err as e:
        raise _error(e.value) from None
    except (OverflowError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"host call {fn.__name__.replace('_', '-')}: invalid argument ({type(e).__name__}: {e})") from None


# -- argument checks ------------------------------------------------------------
# componentize-py aborts the whole component (a trap) when a value does not fit
# its WIT type, so every argument is checked here first and a misfit raises
# the same kind of error the native host raises.
_U32 = 1 << 32


def _adapter(v: Any) -> str | None:
    if v is not None and not isinstance(v, str):
        raise TypeError(f"adapter is an adapter name (str) or None, got {type(v).__name__}")
    return v


def _decode_args(call: str, handle: int, tokens: list[int], sampler: Any, grammar: int | None, first_step: int,
                 max_steps: int, stop_ids: list[int], adapter: str | None) -> tuple[Any, ...]:
    """``generate`` / ``generate_stream`` arguments checked and lowered to WIT values."""
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{call} needs a non-empty list of input tokens")
    _handle(handle)
    for name, v in (("first_step", first_step), ("max_steps", max_steps)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < _U32:
            raise ValueError(f"{name} must be an int in [0, 2**32), got {v!r}")
    params = _sampler_params(sampler)
    if sampler.grammar is not None:
        raise ValueError(f"a {call} sampler slot carries no grammar: pass the matcher handle as `grammar`")
    g = None if grammar is None else _handle(grammar, "grammar matcher")
    return (handle, _u32s(tokens, "input tokens"), params, g, first_step, max_steps, _u32s(stop_ids, "stop token ids"),
            _adapter(adapter))


def _handle(v: Any, what: str = "context") -> int:
    if type(v) is not int or not 0 <= v < _U32:
        raise InvalidHandleError(f"no {what} with handle {v!r}")
    return v


def _u32(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < _U32:
        raise ValueError(f"{what} must be an integer in [0, 2**32), got {v!r}")
    return int(v)


def _u32s(vs: Any, what: str) -> list[int]:
    if isinstance(vs, (str, bytes)) or not hasattr(vs, "__iter__"):
        raise ValueError(f"{what} must be a list of integers, got {type(vs).__name__}")
    vs = list(vs)
    for v in vs:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < _U32:
            raise ValueError(f"{what}: {v!r} is not an integer in [0, 2**32)")
    return vs


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{what} must be a str, got {type(v).__name__}")
    return v


def _model(v: Any) -> str | None:
    return None if v is None else _str(v, "model name")


def _float(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SamplingError(f"{what} must be a number, got {v!r}")
    return float(v)


# -- futures ---------------------------------------------------------------------
class HostFuture:
    """A host operation in flight (``u64`` handle); await with :func:`wait`."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __repr__(self) -> str:
        return f"HostFuture({self.handle})"


_waiting: dict[int, asyncio.Future] = {}


def _slot_result(r: Any) -> Any:
    if isinstance(r, _wit_types.SlotResult_Distribution):
        ids, probs = r.value
        return (list(ids), list(probs))
    if isinstance(r, _wit_types.SlotResult_Attention):
        return scores_from_record(r.value)
    return r.value


def _future_value(v: Any) -> Any:
    if isinstance(v, _wit_types.FutureValue_Tokens):  # a forward pass's sampled tokens
        return v.value
    if isinstance(v, _wit_types.FutureValue_Forward):
        return [_slot_result(r) for r in v.value]
    if isinstance(v, _wit_types.FutureValue_Count):
        return v.value
    if isinstance(v, _wit_types.FutureValue_Stats):
        s = v.value
        return {"tokens": s.tokens, "pages": s.pages, "live_pages": s.live_pages, "shared_pages": s.shared_pages}
    if isinstance(v, _wit_types.FutureValue_Message):
        return v.value.value
    if isinstance(v, _wit_types.FutureValue_Http):
        r = v.value
        return {"status": r.status, "headers": dict(r.headers), "body": bytes(r.body)}
    if isinstance(v, _wit_types.FutureValue_Child):
        c = v.value
        return {"id": c.id, "status": c.status, "result": json.loads(c.result_json), "error": c.error, "output": list(c.output)}
    if isinstance(v, _wit_types.FutureValue_Code):
        c = v.value
        return {"status": c.status, "stdout": c.stdout, "error": c.error, "truncated": c.truncated, "elapsed_ms": c.elapsed_ms}
    raise HostError(f"unknown future value {v!r}")


def _complete(handle: int) -> None:
    fut = _waiting.pop(handle, None)
    try:
        value = _future_value(_wit_inference.future_take(handle))
    except Err as e:
        if fut is not None and not fut.done():
            fut.set_exception(_error(e.value))
        return
    if fut is not None and not fut.done():
        fut.set_result(value)


async def wait(fut: HostFuture) -> Any:
    """Await a host future; returns its value (as the native binding does).

    Raises:
        the host's error for the operation (e.g. ``KvCacheFullError``).
    """
    if not isinstance(fut, HostFuture):
        raise TypeError(f"wait takes a host future, got {type(fut).__name__}")
    _handle(fut.handle, "future")
    loop = asyncio.get_running_loop()
    if type(loop) is HostLoop and not _waiting and not loop._ready and not loop._scheduled:
        # Nothing else can run before this future completes (no ready
        # callback, no timer, no other host future awaited), so the loop's
        # next turn would block in wait-any for this one handle: take it in
        # one blocking host call instead (future-take waits), without an
        # asyncio future, a task switch and a second host call per wait.
        return _future_value(_call(_wit_inference.future_take, fut.handle))
    af = loop.create_future()
    _waiting[fut.handle] = af
    try:
        return await af
    except asyncio.CancelledError:
        if _waiting.pop(fut.handle, None) is not None:
            _wit_inference.future_drop(fut.handle)
        raise


class _HostSelector:
    """The loop's 'selector': blocks in the host's ``wait-any`` until a host
    future is ready or the next timer is due."""

    def select(self, timeout: float | None) -> list:
        if timeout is not None and timeout <= 0:
            return []
        handles = list(_waiting)
        if not handles and timeout is None:
            raise RuntimeError("deadlock: the inferlet waits for something that no host call or timer will complete")
        done = _call(_wit_inference.wait_any, handles, None if timeout is None else int(timeout * 1e9))
        if done:
            _complete(done)
        return []

    def close(self) -> None:
        pass


class HostLoop(asyncio.BaseEventLoop):
    """asyncio loop of a component: no sockets, no self-pipe; idles in the
    host (``wait-any``)."""

    def __init__(self) -> None:
        super().__init__()
        self._selector = _HostSelector()

    def _process_events(self, event_list: list) -> None:
        pass

    def _write_to_self(self) -> None:
        pass


# -- the adapter -------------------------------------------------------------------
def _sampler_params(o: OutputSlot) -> Any:
    """WIT ``sampler-params`` of a ``sample`` slot."""
    if not isinstance(o, OutputSlot) or o.kind != "sample":
        raise SamplingError(f"sampler parameters are a `sample` tartlet.forward.OutputSlot, got {o!r}")
    top_k, seed = o.top_k, o.seed
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k < _U32):
        raise SamplingError(f"top_k must be an integer >= 1 (or None), got {top_k!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64):
        raise SamplingError(f"seed must be an int in [0, 2**64), got {seed!r}")
    validate_filters(o.typical_p, o.xtc_probability, o.xtc_threshold)
    dry = slot_dry(o)  # validated; None when DRY is off
    return _wit_types.SamplerParams(
        temperature=_float(0.0 if o.temperature is None else o.temperature, "temperature"),
        top_k=top_k,
        top_p=_float(o.top_p, "top_p"),
        min_p=_float(o.min_p, "min_p"),
        seed=seed,
        typical_p=float(o.typical_p), xtc_probability=float(o.xtc_probability), xtc_threshold=float(o.xtc_threshold),
        dry=None if dry is None else _wit_types.DryParams(*dry),
    )


def _output_slot(o: Any) -> Any:
    """An :class:`OutputSlot` as the WIT record ``output-slot``."""
    if not isinstance(o, OutputSlot):
        raise SamplingError(f"an output slot is a tartlet.forward.OutputSlot, got {type(o).__name__}")
    kind = o.kind
    if kind == "sample":
        k: Any = _wit_types.SlotKind_Sample(_sampler_params(o))
    elif kind == "distribution":
        kk = o.k
        if isinstance(kk, bool) or not isinstance(kk, int) or not 1 <= kk < _U32:
            raise SamplingError(f"distribution k must be an integer >= 1, got {kk!r}")
        k = _wit_types.SlotKind_Distribution(_wit_types.DistributionParams(kk, _float(1.0 if o.temperature is None else o.temperature, "temperature")))
    elif kind == "logits":
        k = _wit_types.SlotKind_Logits()
    elif kind == "logprobs":
        k = _wit_types.SlotKind_Logprobs(_u32s(o.token_ids, "logprobs token_ids"))
    elif kind == "entropy":
        k = _wit_types.SlotKind_Entropy()
    elif kind == "hidden":  # an s32 here; the host checks it against the model's layers
        if o.layer is not None and (type(o.layer) is not int or not -(1 << 31) <= o.layer < 1 << 31):
            raise SamplingError(f"hidden-state layer must be an int or None (the final hidden state), got {o.layer!r}")
        k = _wit_types.SlotKind_Hidden(o.layer)
    else:
        raise SamplingError(f"unknown output kind {kind!r} ({', '.join(OUTPUT_KINDS)})")
    mask = o.logit_mask
    index = _u32(o.index, "output index")
    grammar = None if o.grammar is None else _handle(o.grammar, "grammar matcher")
    return _wit_types.OutputSlot(index, k, None if mask is None else _u32s(mask, "logit mask"), grammar)


class WasmHost:
    """:class:`tartlet.host.api.HostApi`'s methods over the WIT imports."""

    # models
    def model_names(self) -> list[str]:
        return _call(_wit_model.model_names)

    def adapter_names(self, model: str | None) -> list[str]:
        return _call(_wit_model.adapter_names, _model(model))

    def adapter_info(self, model: str | None, name: str) -> list[dict[str, Any]]:
        mods = _call(_wit_model.adapter_info, _model(model), _str(name, "adapter name"))
        return [{k: getattr(m, k) for k in ("name", "rank", "in_features", "out_features", "scale")} for m in mods]

    def adapter_fork(self, model: str | None, name: str, new_name: str | None) -> str:
        new = None if new_name is None else _str(new_name, "adapter name")
        return _call(_wit_model.adapter_fork, _model(model), _str(name, "adapter name"), new)

    def adapter_save(self, model: str | None, name: str, new_name: str) -> None:
        _call(_wit_model.adapter_save, _model(model), _str(name, "adapter name"), _str(new_name, "adapter name"))

    def adapter_drop(self, model: str | None, name: str) -> None:
        _call(_wit_model.adapter_drop, _model(model), _str(name, "adapter name"))

    def adapter_delete(self, model: str | None, name: str) -> None:
        _call(_wit_model.adapter_delete, _model(model), _str(name, "adapter name"))

    def adapter_weights(self, model: str | None, name: str, module: str) -> tuple[bytes, bytes]:
        w = _call(_wit_model.adapter_weights, _model(model), _str(name, "adapter name"), _str(module, "module name"))
        return bytes(w.a), bytes(w.b)

    def adapter_set_weights(self, model: str | None, name: str, module: str, a: bytes | None, b: bytes | None) -> None:
        if not all(v is None or isinstance(v, (bytes, bytearray)) for v in (a, b)):
            raise AdapterError(f"{module}: weights are float32 little-endian bytes (or None)")
        _call(_wit_model.adapter_set_weights, _model(model), _str(name, "adapter name"), _str(module, "module name"),
              None if a is None else bytes(a), None if b is None else bytes(b))

    def adapter_perturb(self, model: str | None, name: str, seed: int, scale: float) -> None:
        if any(isinstance(v, bool) for v in (seed, scale)) or not isinstance(seed, int) or not 0 <= seed < 1 << 63 \
                or not isinstance(scale, (int, float)):
            raise AdapterError(f"seed must be an int in [0, 2**63) and scale a number, got {seed!r}, {scale!r}")
        _call(_wit_model.adapter_perturb, _model(model), _str(name, "adapter name"), seed, float(scale))

    def model_info(self, model: str | None) -> dict[str, Any]:
        m = _call(_wit_model.model_info, _model(model))
        return {
            "name": m.name, "vocab_size": m.vocab_size, "eos_token_ids": list(m.eos_token_ids),
            "bos_token_id": m.bos_token_id, "page_size": m.page_size, "max_seq_len": m.max_seq_len,
            "has_chat_template": m.has_chat_template, "add_bos_token": m.add_bos_token,
            "speculative": None if m.speculative is None else {
                "method": m.speculative.method, "max_draft": m.speculative.max_draft, "max_ngram": m.speculative.max_ngram,
                "min_ngram": m.speculative.min_ngram, "max_batch": m.speculative.max_batch,
            },
        }  # fmt: skip

    def tokenize(self, model: str | None, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"tokenize takes a str, got {type(text).__name__}")
        return _call(_wit_model.tokenize, _model(model), text)

    def detokenize(self, model: str | None, ids: list[int]) -> str:
        return _call(_wit_model.detokenize, _model(model), _u32s(ids, "token ids"))

    def apply_chat_template(
        self, model: str | None, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None,
    ) -> str:
        msgs = []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"a chat message is a dict with `role` and `content`, got {m!r}")
            content, calls, call_id, name = m.get("content"), m.get("tool_calls"), m.get("tool_call_id"), m.get("name")
            msgs.append(_wit_types.ChatMessage(
                _str(m["role"], "role"), None if content is None else _str(content, "content"),
                None if calls is None else json.dumps(calls), None if call_id is None else _str(call_id, "tool_call_id"),
                None if name is None else _str(name, "name"),
            ))
        return _call(_wit_model.apply_chat_template, _model(model), msgs, bool(add_generation_prompt), None if tools is None else json.dumps(tools))

    def decoder_new(self, model: str | None) -> int:
        return _call(_wit_model.decoder_new, _model(model))

    def decoder_push(self, handle: int, ids: list[int]) -> str:
        return _call(_wit_model.decoder_push, _handle(handle, "decoder"), _u32s(ids, "token ids"))

    def decoder_free(self, handle: int) -> None:
        _call(_wit_model.decoder_free, _handle(handle, "decoder"))

    # contexts
    def context_new(self, model: str | None) -> int:
        return _call(_wit_context.context_new, _model(model))

    def context_fork(self, handle: int) -> int:
        return _call(_wit_context.context_fork, _handle(handle))

    def context_free(self, handle: int) -> None:
        _call(_wit_context.context_free, _handle(handle))

    def context_tokens(self, handle: int) -> list[int]:
        return _call(_wit_context.context_tokens, _handle(handle))

    def context_len(self, handle: int) -> int:
        return _call(_wit_context.context_len, _handle(handle))

    def context_truncate(self, handle: int, n: int) -> None:
        _handle(handle)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < _U32:
            raise ValueError(f"truncate to {n!r} outside [0, len]")
        _call(_wit_context.context_truncate, handle, n)

    def context_mask(self, handle: int, start: int, end: int, masked: bool) -> None:
        _handle(handle)
        if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < _U32 for x in (start, end)):
            raise ValueError(f"mask range [{start!r}, {end!r}) outside the context")
        _call(_wit_context.context_mask, handle, start, end, bool(masked))

    def context_drop_masked_pages(self, handle: int) -> HostFuture:
        return HostFuture(_call(_wit_context.context_drop_masked_pages, _handle(handle)))

    def context_stats(self, handle: int) -> HostFuture:
        return HostFuture(_call(_wit_context.context_stats, _handle(handle)))

    # snapshots
    def snapshot_save(self, handle: int, name: str) -> None:
        _call(_wit_context.snapshot_save, _handle(handle), _str(name, "snapshot name"))

    def snapshot_open(self, model: str | None, name: str) -> int:
        return _call(_wit_context.snapshot_open, _model(model), _str(name, "snapshot name"))

    def snapshot_take(self, model: str | None, name: str) -> int:
        return _call(_wit_context.snapshot_take, _model(model), _str(name, "snapshot name"))

    def snapshot_delete(self, model: str | None, name: str) -> None:
        _call(_wit_context.snapshot_delete, _model(model), _str(name, "snapshot name"))

    def snapshot_names(self, model: str | None) -> list[str]:
        return _call(_wit_context.snapshot_names, _model(model))

    # forward pass
    def forward(
        self,
        handle: int,
        tokens: list[int],
        positions: list[int] | None = None,
        attention: list[list[int]] | None = None,
        outputs: list[OutputSlot] | None = None,
        adapter: str | None = None,
        probe: AttentionProbe | None = None,
    ) -> HostFuture:
        if not isinstance(tokens, list) or not tokens:
            raise ValueError("forward needs a non-empty list of input tokens")
        _handle(handle)
        tokens = _u32s(tokens, "input tokens")
        slots = [_output_slot(o) for o in (outputs or [])]
        pos = None if positions is None else _u32s(positions, "positions")
        attn = None if attention is None else [_u32s(m, "attention mask") for m in attention]
        ap = None if probe is None else probe_record(probe, _wit_types.AttentionProbe)
        return HostFuture(_call(_wit_inference.forward, handle, tokens, pos, attn, slots, _adapter(adapter), ap))

    def generate(
        self, handle: int, tokens: list[int], sampler: OutputSlot, grammar: int | None, first_step: int, max_steps: int,
        stop_ids: list[int], adapter: str | None = None,
    ) -> HostFuture:
        return HostFuture(_call(_wit_inference.generate, *_decode_args("generate", handle, tokens, sampler, grammar,
                                                                         first_step, max_steps, stop_ids, adapter)))

    def generate_stream(
        self, handle: int, tokens: list[int], sampler: OutputSlot, grammar: int | None, first_step: int, max_steps: int,
        stop_ids: list[int], adapter: str | None = None,
    ) -> int:
        return _call(_wit_inference.generate_stream, *_decode_args("generate_stream", handle, tokens, sampler, grammar,
                                                                     first_step, max_steps, stop_ids, adapter))

    def stream_next(self, handle: int, count: int) -> HostFuture:
        _handle(handle, "token stream")
        return HostFuture(_call(_wit_inference.stream_next, handle, _u32(count, "count")))

    def stream_close(self, handle: int) -> HostFuture:
        _handle(handle, "token stream")
        return HostFuture(_call(_wit_inference.stream_close, handle))

    # stats, session
    def kv_stats(self, model: str | None) -> dict[str, int]:
        s = _call(_wit_model.kv_stats, _model(model))
        return {"total": s.total, "free": s.free, "cached": s.cached, "used": s.used, "page_size": s.page_size,
                "batch_requests": s.batch_requests}

    def session_send(self, msg: str | bytes) -> None:
        if isinstance(msg, str):
            _call(_wit_io.session_send, _wit_types.Message_Text(msg))
        elif isinstance(msg, (bytes, bytearray)):
            _call(_wit_io.session_send, _wit_types.Message_Bytes(bytes(msg)))
        else:
            raise TypeError(f"session messages are str or bytes, got {type(msg).__name__}")

    def session_receive(self) -> HostFuture:
        return HostFuture(_call(_wit_io.session_receive))


    # messaging
    def messaging_push(self, topic: str, msg: str | bytes) -> None:
        _call(_wit_io.messaging_push, _str(topic, "topic"), _message(msg))

    def messaging_pull(self, topic: str) -> HostFuture:
        return HostFuture(_call(_wit_io.messaging_pull, _str(topic, "topic")))

    def messaging_broadcast(self, topic: str, msg: str | bytes) -> int:
        return _call(_wit_io.messaging_broadcast, _str(topic, "topic"), _message(msg))

    def messaging_subscribe(self, topic: str) -> int:
        return _call(_wit_io.messaging_subscribe, _str(topic, "topic"))

    def messaging_next(self, sid: int) -> HostFuture:
        return HostFuture(_call(_wit_io.messaging_next, _handle(sid, "subscription")))

    def messaging_unsubscribe(self, sid: int) -> None:
        _call(_wit_io.messaging_unsubscribe, _handle(sid, "subscription"))

    # store
    def store_get(self, key: str) -> str | None:
        return _call(_wit_io.store_get, _str(key, "key")).value

    def store_set(self, key: str, value: str) -> None:
        _call(_wit_io.store_set, _str(key, "key"), _str(value, "value"))

    def store_delete(self, key: str) -> bool:
        return _call(_wit_io.store_delete, _str(key, "key"))

    def store_keys(self, prefix: str = "") -> list[str]:
        return _call(_wit_io.store_keys, _str(prefix, "prefix"))

    # http
    def http_fetch(self, url: str, method: str = "GET", headers: dict[str, str] | None = None, body: bytes | str | None = None) -> HostFuture:
        hs = [(_str(k, "header name"), _str(v, "header value")) for k, v in dict(headers or {}).items()]
        data = body.encode() if isinstance(body, str) else (None if body is None else bytes(body))
        return HostFuture(_call(_wit_io.http_fetch, _str(url, "url"), _str(method, "method"), hs, data))

    def mcp_servers(self) -> dict[str, str]:
        return dict(_wit_io.mcp_servers())

    # sandboxed code
    def code_run(self, code: str, setup: str = "", time_limit_s: float | None = None, memory_mb: int | None = None) -> HostFuture:
        if time_limit_s is not None and (isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float))):
            raise ValueError(f"time_limit_s must be a number of seconds, got {time_limit_s!r}")
        mb = None if memory_mb is None else _u32(memory_mb, "memory_mb")
        t = None if time_limit_s is None else float(time_limit_s)
        return HostFuture(_call(_wit_io.code_run, _str(code, "code"), _str(setup, "setup"), t, mb))

    # child inferlets
    def child_launch(self, name: str, args: dict[str, Any] | None = None) -> int:
        return _call(_wit_io.child_launch, _str(name, "inferlet name"), json.dumps(args or {}))

    def child_wait(self, h: int) -> HostFuture:
        return HostFuture(_call(_wit_io.child_wait, _handle(h, "child inferlet")))

    def child_abort(self, h: int) -> None:
        _call(_wit_io.child_abort, _handle(h, "child inferlet"))

    def child_id(self, h: int) -> str:
        return _call(_wit_io.child_id, _handle(h, "child inferlet"))

    # grammar matchers
    def grammar_new(self, model: str | None, kind: str, spec: Any) -> int:
        return _call(_wit_grammar.grammar_new, _model(model), _str(kind, "grammar kind"), json.dumps(spec))

    def grammar_mask(self, handle: int, form: str = "brle") -> list[int] | bytes:
        return _call(_wit_grammar.grammar_mask, _handle(handle, "grammar matcher"), _str(form, "mask form")).value

    def grammar_advance(self, handle: int, token: int) -> None:
        _call(_wit_grammar.grammar_advance, _handle(handle, "grammar matcher"), _u32(token, "token id"))

    def grammar_fork(self, handle: int) -> int:
        return _call(_wit_grammar.grammar_fork, _handle(handle, "grammar matcher"))

    def grammar_reset(self, handle: int) -> None:
        _call(_wit_grammar.grammar_reset, _handle(handle, "grammar matcher"))

    def grammar_is_finished(self, handle: int) -> bool:
        return _call(_wit_grammar.grammar_is_finished, _handle(handle, "grammar matcher"))

    def grammar_is_accepting(self, handle: int) -> bool:
        return _call(_wit_grammar.grammar_is_accepting, _handle(handle, "grammar matcher"))

    def grammar_free(self, handle: int) -> None:
        _call(_wit_grammar.grammar_free, _handle(handle, "grammar matcher"))


def _message(msg: Any) -> Any:
    if isinstance(msg, str):
        return _wit_types.Message_Text(msg)
    if isinstance(msg, (bytes, bytearray)):
        return _wit_types.Message_Bytes(bytes(msg))
    raise TypeError(f"messages are str or bytes, got {type(msg).__name__}")


_HOST = WasmHost()


def host() -> WasmHost:
    """The host API of the running inferlet (the component's WIT imports)."""
    return _HOST


# -- the export ----------------------------------------------------------------------
def run_export(main: Any, args_json: str) -> str:
    """Run ``main(args)`` to the end on a :class:`HostLoop`; the export
    ``run`` of world ``inferlet``.

    Returns:
        ``main``'s result as JSON.

    Raises:
        Err: ``"ClassName: message\\n<traceback>"`` for any exception, so
            only real faults (traps) end the component abnormally.
    """
    try:
        if not inspect.iscoroutinefunction(main):
            raise TypeError("the inferlet must define `async def main(args: dict)`")
        args = json.loads(args_json)
        result = asyncio.run(main(args), loop_factory=HostLoop)
        try:
            return json.dumps(result)
        except TypeError as e:
            raise TypeError(f"a sandboxed inferlet's result must be JSON-serialisable: {e}") from None
    except Exception as e:
        raise Err(f"{type(e).__name__}: {e}\n{traceback.format_exc()}") from None
    finally:
        _waiting.clear()
