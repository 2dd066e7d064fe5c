"""Host side of the WIT contract: the imports of world ``inferlet`` (interfaces
``model``, ``context``, ``inference``, ``grammar``, ``io`` of ``tartlet:inferlet``).

Every import calls :class:`tartlet.host.api.HostApi` of the instance that
runs on the calling thread (each WASM instance has its own thread), after
converting WIT values (wasmtime-py ``Record``/``Variant``/lists) to the
plain data HostApi takes, and its result back. Futures (forward passes,
stats, session receives) live in a per-instance handle table
(``u64`` -> ``concurrent.futures.Future``); ``wait-any`` blocks until one
of them completes on a lock their done callbacks release (the GIL is
released while blocked).

Host functions never raise into wasmtime (wasmtime-py would park the
exception in a process-global): a failed call returns the ``result`` error
``call-error { code, message }``, ``code`` naming the exception's class
(:func:`tartlet.sdk.errors.error_code`; server paths in its message replaced
by placeholders, :mod:`tartlet.host.redact`). The only exception is :class:`WasmtimeError`,
raised on purpose to trap an instance that was aborted or ran out of CPU
time; wasmtime passes it through as a trap of that instance alone.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from concurrent.futures import Future
from typing import Any

from wasmtime import WasmtimeError
from wasmtime.component import Linker, Record, Variant

from ..host.api import HostApi
from ..host.redact import redact
from ..sdk.attention_probe import AttentionProbe, AttentionScores
from ..sdk.errors import InvalidHandleError, error_code
from ..sdk.forward import OutputSlot

#: The WIT package the component imports its interfaces from, and its version.
PACKAGE, VERSION = "tartlet:inferlet", "0.4.0"  # 0.2.0: the interfaces (0.1.0 had one `host`); 0.3.0: LoRA adapters; 0.4.0: issue 36 probes (hidden states, ...)

#: The interfaces of the WIT package (``wit/tartlet.wit``) and their
#: functions, each imported by world ``inferlet`` as
#: ``tartlet:inferlet/NAME@0.4.0`` (their shared types are interface
#: ``types``, which has no function); tests/runtime/test_wit_contract.py checks
#: this table against the WIT.
INTERFACES: dict[str, tuple[str, ...]] = {
    "model": (
        "model-names", "model-info", "adapter-names", "tokenize", "detokenize", "apply-chat-template", "decoder-new",
        "decoder-push", "decoder-free", "adapter-info", "adapter-fork", "adapter-save", "adapter-drop", "adapter-delete",
        "adapter-weights", "adapter-set-weights", "adapter-perturb", "kv-stats",
    ),
    "context": (
        "context-new", "context-fork", "context-free", "context-tokens", "context-len", "context-truncate",
        "context-mask", "context-drop-masked-pages", "context-stats", "snapshot-save", "snapshot-open",
        "snapshot-take", "snapshot-delete", "snapshot-names",
    ),
    "inference": (
        "forward", "generate", "generate-stream", "stream-next", "stream-close", "wait-any", "future-take",
        "future-drop",
    ),
    "grammar": (
        "grammar-new", "grammar-mask", "grammar-advance", "grammar-fork", "grammar-reset",
        "grammar-is-finished", "grammar-is-accepting", "grammar-free",
    ),
    "io": (
        "session-send", "session-receive", "messaging-push", "messaging-pull", "messaging-broadcast",
        "messaging-subscribe", "messaging-next", "messaging-unsubscribe", "store-get", "store-set",
        "store-delete", "store-keys", "http-fetch", "mcp-servers", "code-run", "child-launch", "child-wait",
        "child-abort", "child-id",
    ),
}
#: Largest number of futures one instance may hold.
MAX_FUTURES = 65536

_current = threading.local()


def current() -> "InstanceHost | None":
    """The :class:`InstanceHost` bound to the calling thread (None if none)."""
    return getattr(_current, "host", None)


class InstanceHost:
    """Host-side state of one WASM instance: its HostApi, its futures, and
    why it must stop (abort / CPU limit), checked at every host call.

    Args:
        api: the instance's host API.
    """

    def __init__(self, api: HostApi) -> None:
        self.api = api
        self.futures: dict[int, tuple[str, Future[Any]]] = {}  # handle -> (kind, future); kind says its result type
        self._ids = itertools.count(1)
        self.stop_reason: str | None = None
        #: the wake-up signal of ``wait-any``: a lock used as a binary
        #: semaphore (locked = no signal), released by every future of the
        #: table as it completes and by :meth:`stop`. ``Lock.acquire`` blocks
        #: in C with the GIL released; ``concurrent.futures.wait`` cost ~110 µs
        #: of Python per call (a waiter object, a lock per future, installed
        #: and removed on every call), on the path from a pass's end to the
        #: guest's next request
        self._signal = threading.Lock()
        self._signal.acquire()
        self.host_calls = 0

    def bind(self) -> None:
        """Make this the instance of the calling thread."""
        _current.host = self

    def unbind(self) -> None:
        _current.host = None

    def stop(self, reason: str) -> None:
        """Make the instance stop (any thread): its next host call traps,
        and a ``wait-any`` blocked now returns at once to trap."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self._notify()

    def _notify(self, _fut: object = None) -> None:
        """Wake a ``wait-any`` (any thread; the done callback of every future)."""
        try:
            self._signal.release()
        except RuntimeError:  # already signalled
            pass

    def check_stop(self) -> None:
        """Trap the instance (raise WasmtimeError) when it must stop."""
        if self.stop_reason is not None:
            raise WasmtimeError(f"tartlet: {self.stop_reason}")

    def add_future(self, kind: str, fut: Future[Any]) -> int:
        if len(self.futures) >= MAX_FUTURES:
            fut.cancel()
            raise ValueError(f"more than {MAX_FUTURES} host futures in flight; await some first")
        h = next(self._ids)
        self.futures[h] = (kind, fut)
        fut.add_done_callback(self._notify)
        return h

    def future(self, h: int) -> tuple[str, Future[Any]]:
        entry = self.futures.get(h)
        if entry is None:
            raise InvalidHandleError(f"no future with handle {h} (already taken, dropped, or never created)")
        return entry

    def wait_any(self, handles: list[int], timeout_ns: int | None) -> int:
        """The first of ``handles`` that is done (0 after ``timeout_ns``).
        An unknown handle counts as done: its ``future-take`` then fails with
        InvalidHandleError, which the guest raises where it awaited it."""
        for h in handles:
            if h not in self.futures:
                return h
        futs = [(h, self.futures[h][1]) for h in handles]
        deadline = None if timeout_ns is None else time.monotonic() + timeout_ns / 1e9
        if not futs and deadline is None:
            raise ValueError("wait-any with no handles and no timeout would block forever")
        # block until a future of the table completes or stop() is called (no
        # polling: with 32 instances a 100 ms poll slice was 320 wakeups a
        # second). A signal left from a future not waited for here only costs
        # one more turn of the loop; one given between the check below and
        # the acquire is not lost (the lock stays released until acquired).
        signal = self._signal
        while True:
            for h, f in futs:
                if f.done():
                    return h
            self.check_stop()
            if deadline is None:
                signal.acquire()
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return 0
            signal.acquire(timeout=left)

    def close(self) -> None:
        """Forget all futures (the instance ended); HostApi.close frees pages."""
        for _, f in self.futures.values():
            f.cancel()
        self.futures.clear()


# -- value conversion --------------------------------------------------------------
def _record(**fields: Any) -> Record:
    r = Record()
    for k, v in fields.items():
        setattr(r, k.replace("_", "-"), v)
    return r



def _sampler(p: Any, index: int = 0) -> OutputSlot:
    """WIT ``sampler-params`` -> a ``sample`` :class:`OutputSlot` at ``index``
    (no ``dry``: DRY's off values)."""
    slot = OutputSlot(
        index, "sample", temperature=p.temperature, top_k=getattr(p, "top-k"), top_p=getattr(p, "top-p"),
        min_p=getattr(p, "min-p"), seed=p.seed, typical_p=getattr(p, "typical-p"),
        xtc_probability=getattr(p, "xtc-probability"), xtc_threshold=getattr(p, "xtc-threshold"),
    )  # fmt: skip
    dry = p.dry
    if dry is not None:
        slot.dry_multiplier, slot.dry_base = dry.multiplier, dry.base
        slot.dry_allowed_length, slot.dry_penalty_last_n = getattr(dry, "allowed-length"), getattr(dry, "penalty-last-n")
        slot.dry_sequence_breakers = list(getattr(dry, "sequence-breakers"))
    return slot


def _slot(o: Any) -> OutputSlot:
    """WIT ``output-slot`` -> the SDK's :class:`OutputSlot` HostApi takes."""
    kind: Variant = o.kind
    p: Any = kind.payload  # by tag: sampler-params, distribution-params, a list of ids, or none
    mask = getattr(o, "logit-mask")
    slot = _sampler(p, o.index) if kind.tag == "sample" else OutputSlot(o.index, kind.tag)
    slot.logit_mask, slot.grammar = None if mask is None else list(mask), o.grammar
    if kind.tag == "distribution":
        slot.k, slot.temperature = p.k, p.temperature
    elif kind.tag == "logprobs":
        slot.token_ids = list(p)
    elif kind.tag == "hidden":
        slot.layer = p  # option<s32>: None = the final hidden state
    return slot


def _slot_result(r: Any) -> Any:
    """A HostApi slot result -> WIT ``slot-result`` (untagged variant; the
    attention probe's scores are its one record case)."""
    if isinstance(r, AttentionScores):  # per layer, its rows one after the other
        return _record(layers=list(r.layers), reduce=r.reduce, per=r.per, kv_heads=r.kv_heads,
                       scores=[[x for row in rows for x in row] for rows in r.scores])
    if isinstance(r, tuple):
        ids, probs = r
        return ([int(i) for i in ids], [float(p) for p in probs])
    if isinstance(r, list):
        return [float(x) for x in r]
    if isinstance(r, float):
        return r
    return int(r)


def _future_value(kind: str, v: Any) -> Variant:
    """A finished future's value -> WIT ``future-value`` (a tagged variant:
    ``stats``, ``http`` and ``child`` are all records)."""
    if kind == "forward" and all(type(r) is int for r in v):  # sampled tokens only: the list<u32> case
        return Variant("tokens", v if type(v) is list else list(v))
    return Variant(kind, _future_payload(kind, v))


def _future_payload(kind: str, v: Any) -> Any:
    if kind == "forward":
        return [_slot_result(r) for r in v]
    if kind == "count":
        return int(v)
    if kind == "stats":
        return _record(**{k: int(v[k]) for k in ("tokens", "pages", "live_pages", "shared_pages")})
    if kind == "message":
        return v
    if kind == "http":
        body = v["body"]
        return _record(
            status=int(v["status"]), headers=[(str(k), str(x)) for k, x in dict(v["headers"]).items()],
            body=body.encode() if isinstance(body, str) else bytes(body),
        )  # fmt: skip
    if kind == "child":
        return _record(
            id=str(v["id"]), status=str(v["status"]), result_json=json.dumps(v["result"]),
            error=None if v["error"] is None else str(v["error"]),
            output=[m if isinstance(m, str) else bytes(m).decode("utf-8", "replace") for m in v["output"]],
        )  # fmt: skip
    if kind == "code":
        return _record(
            status=str(v["status"]), stdout=str(v["stdout"]), error=None if v["error"] is None else str(v["error"]),
            truncated=bool(v["truncated"]), elapsed_ms=min(int(v["elapsed_ms"]), 2**32 - 1),
        )  # fmt: skip
    raise ValueError(f"unknown future kind {kind!r}")


# -- the imports -----------------------------------------------------------------------
def _forward(h: InstanceHost, handle: int, tokens: list[int], positions: Any, attention: Any, outputs: list[Any],
             adapter: str | None, probe: Any = None) -> int:
    slots = [_slot(o) for o in outputs]
    ap = None
    if probe is not None:  # WIT attention-probe -> the SDK's AttentionProbe (HostApi validates it)
        layers = probe.layers
        ap = AttentionProbe(None if layers is None else list(layers), probe.reduce, probe.per, getattr(probe, "per-kv-head"))
    return h.add_future("forward", h.api.forward(handle, list(tokens), positions, attention, slots, adapter, ap))


def _generate(h: InstanceHost, handle: int, tokens: list[int], sampler: Any, grammar: int | None, first_step: int,
              max_steps: int, stop: list[int], adapter: str | None) -> int:
    fut = h.api.generate(handle, list(tokens), _sampler(sampler), grammar, first_step, max_steps, list(stop), adapter)
    return h.add_future("forward", fut)  # one slot-result::token per sampled token


def _generate_stream(h: InstanceHost, handle: int, tokens: list[int], sampler: Any, grammar: int | None,
                     first_step: int, max_steps: int, stop: list[int], adapter: str | None) -> int:
    return h.api.generate_stream(handle, list(tokens), _sampler(sampler), grammar, first_step, max_steps, list(stop),
                                 adapter)


def _future_take(h: InstanceHost, handle: int) -> Any:
    kind, fut = h.future(handle)
    if not fut.done():  # block as wait-any would: a guest with nothing else to run takes in one call
        h.wait_any([handle], None)
    del h.futures[handle]
    if fut.cancelled():
        raise RuntimeError("the operation was cancelled")
    exc = fut.exception()
    if exc is not None:
        raise exc
    return _future_value(kind, fut.result())


def _model_info(h: InstanceHost, model: str | None) -> Record:
    i = h.api.model_info(model)
    return _record(
        name=i["name"], vocab_size=i["vocab_size"], eos_token_ids=list(i["eos_token_ids"]),
        bos_token_id=i["bos_token_id"], page_size=i["page_size"], max_seq_len=i["max_seq_len"],
        has_chat_template=bool(i["has_chat_template"]), add_bos_token=bool(i["add_bos_token"]),
        speculative=None if i["speculative"] is None else _record(**i["speculative"]),
    )  # fmt: skip


def _adapter_weights(h: InstanceHost, model: str | None, name: str, module: str) -> Record:
    a, b = h.api.adapter_weights(model, name, module)
    return _record(a=a, b=b)


def _adapter_set_weights(h: InstanceHost, model: str | None, name: str, module: str, a: Any, b: Any) -> None:
    h.api.adapter_set_weights(model, name, module, None if a is None else bytes(a), None if b is None else bytes(b))


def _kv_stats(h: InstanceHost, model: str | None) -> Record:
    s = h.api.kv_stats(model)
    return _record(**{k: int(s[k]) for k in ("total", "free", "cached", "used", "page_size", "batch_requests")})


def _chat(h: InstanceHost, model: str | None, messages: list[Any], agp: bool, tools: str | None) -> str:
    msgs = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        calls, call_id = getattr(m, "tool-calls"), getattr(m, "tool-call-id")
        if calls is not None:
            msg["tool_calls"] = _json_arg(calls, "tool-calls")
        if call_id is not None:
            msg["tool_call_id"] = call_id
        if m.name is not None:
            msg["name"] = m.name
        msgs.append(msg)
    return h.api.apply_chat_template(model, msgs, agp, None if tools is None else _json_arg(tools, "tools"))


def _json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{what} is not valid JSON text: {e}") from None


# name -> (implementation, how the result is returned):
#   plain: no result<>; unit: result<_, call-error>; untagged: result<T,
#   call-error> whose T wasmtime-py tells apart from the error's Record by its
#   Python class; tagged: result<T, call-error> with T a record, so both
#   cases are Records and need wasmtime's Variant("ok"/"err", ...)
#   (tests/runtime/test_wit_contract.py checks each mode against the WIT)
IMPORTS: dict[str, tuple[Any, str]] = {
    "model-names": (lambda h: h.api.model_names(), "plain"),
    "adapter-names": (lambda h, m: h.api.adapter_names(m), "untagged"),
    "adapter-info": (lambda h, m, n: [_record(**d) for d in h.api.adapter_info(m, n)], "untagged"),
    "adapter-fork": (lambda h, m, n, new: h.api.adapter_fork(m, n, new), "untagged"),
    "adapter-save": (lambda h, m, n, new: h.api.adapter_save(m, n, new), "unit"),
    "adapter-drop": (lambda h, m, n: h.api.adapter_drop(m, n), "unit"),
    "adapter-delete": (lambda h, m, n: h.api.adapter_delete(m, n), "unit"),
    "adapter-weights": (_adapter_weights, "tagged"),
    "adapter-set-weights": (_adapter_set_weights, "unit"),
    "adapter-perturb": (lambda h, m, n, seed, scale: h.api.adapter_perturb(m, n, seed, scale), "unit"),
    "model-info": (_model_info, "tagged"),
    "tokenize": (lambda h, m, text: h.api.tokenize(m, text), "untagged"),
    "detokenize": (lambda h, m, ids: h.api.detokenize(m, list(ids)), "untagged"),
    "apply-chat-template": (_chat, "untagged"),
    "decoder-new": (lambda h, m: h.api.decoder_new(m), "untagged"),
    "decoder-push": (lambda h, d, ids: h.api.decoder_push(d, list(ids)), "untagged"),
    "decoder-free": (lambda h, d: h.api.decoder_free(d), "plain"),
    "context-new": (lambda h, m: h.api.context_new(m), "untagged"),
    "context-fork": (lambda h, c: h.api.context_fork(c), "untagged"),
    "context-free": (lambda h, c: h.api.context_free(c), "unit"),
    "context-tokens": (lambda h, c: h.api.context_tokens(c), "untagged"),
    "context-len": (lambda h, c: h.api.context_len(c), "untagged"),
    "context-truncate": (lambda h, c, n: h.api.context_truncate(c, n), "unit"),
    "context-mask": (lambda h, c, s, e, m: h.api.context_mask(c, s, e, m), "unit"),
    "context-drop-masked-pages": (lambda h, c: h.add_future("count", h.api.context_drop_masked_pages(c)), "untagged"),
    "context-stats": (lambda h, c: h.add_future("stats", h.api.context_stats(c)), "untagged"),
    "snapshot-save": (lambda h, c, name: h.api.snapshot_save(c, name), "unit"),
    "snapshot-open": (lambda h, m, name: h.api.snapshot_open(m, name), "untagged"),
    "snapshot-take": (lambda h, m, name: h.api.snapshot_take(m, name), "untagged"),
    "snapshot-delete": (lambda h, m, name: h.api.snapshot_delete(m, name), "unit"),
    "snapshot-names": (lambda h, m: h.api.snapshot_names(m), "untagged"),
    "forward": (_forward, "untagged"),
    "generate": (_generate, "untagged"),
    "generate-stream": (_generate_stream, "untagged"),
    "stream-next": (lambda h, st, n: h.add_future("forward", h.api.stream_next(st, n)), "untagged"),  # future-value::tokens
    "stream-close": (lambda h, st: h.add_future("forward", h.api.stream_close(st)), "untagged"),
    "kv-stats": (_kv_stats, "tagged"),
    "session-send": (lambda h, msg: h.api.session_send(msg), "unit"),
    "session-receive": (lambda h: h.add_future("message", h.api.session_receive()), "untagged"),
    "messaging-push": (lambda h, t, m: h.api.messaging_push(t, m), "unit"),
    "messaging-pull": (lambda h, t: h.add_future("message", h.api.messaging_pull(t)), "untagged"),
    "messaging-broadcast": (lambda h, t, m: int(h.api.messaging_broadcast(t, m)), "untagged"),
    "messaging-subscribe": (lambda h, t: h.api.messaging_subscribe(t), "untagged"),
    "messaging-next": (lambda h, sid: h.add_future("message", h.api.messaging_next(sid)), "untagged"),
    "messaging-unsubscribe": (lambda h, sid: h.api.messaging_unsubscribe(sid), "unit"),
    "store-get": (lambda h, k: _record(value=h.api.store_get(k)), "tagged"),
    "store-set": (lambda h, k, v: h.api.store_set(k, v), "unit"),
    "store-delete": (lambda h, k: bool(h.api.store_delete(k)), "untagged"),
    "store-keys": (lambda h, p: list(h.api.store_keys(p)), "untagged"),
    "http-fetch": (lambda h, url, method, headers, body: h.add_future("http", h.api.http_fetch(url, method, dict(headers), body)), "untagged"),
    "mcp-servers": (lambda h: sorted(h.api.mcp_servers().items()), "plain"),
    "code-run": (lambda h, code, setup, t, mb: h.add_future("code", h.api.code_run(code, setup, t, mb)), "untagged"),
    "child-launch": (lambda h, name, args: h.api.child_launch(name, json.loads(args)), "untagged"),
    "child-wait": (lambda h, c: h.add_future("child", h.api.child_wait(c)), "untagged"),
    "child-abort": (lambda h, c: h.api.child_abort(c), "unit"),
    "child-id": (lambda h, c: h.api.child_id(c), "untagged"),
    "grammar-new": (lambda h, m, kind, spec: h.api.grammar_new(m, kind, json.loads(spec)), "untagged"),
    "grammar-mask": (lambda h, g, form: h.api.grammar_mask(g, form), "untagged"),
    "grammar-advance": (lambda h, g, t: h.api.grammar_advance(g, t), "unit"),
    "grammar-fork": (lambda h, g: h.api.grammar_fork(g), "untagged"),
    "grammar-reset": (lambda h, g: h.api.grammar_reset(g), "unit"),
    "grammar-is-finished": (lambda h, g: bool(h.api.grammar_is_finished(g)), "untagged"),
    "grammar-is-accepting": (lambda h, g: bool(h.api.grammar_is_accepting(g)), "untagged"),
    "grammar-free": (lambda h, g: h.api.grammar_free(g), "unit"),
    "wait-any": (lambda h, hs, t: h.wait_any(list(hs), t), "untagged"),
    "future-take": (_future_take, "untagged"),  # future-value is a tagged Variant itself
    "future-drop": (lambda h, f: h.futures.pop(f, None), "plain"),
}


def _wrap(name: str, fn: Any, mode: str) -> Any:
    def impl(store: Any, *args: Any) -> Any:
        h = current()
        if h is None:  # pragma: no cover - an import called outside an instance thread
            raise WasmtimeError(f"tartlet: host call {name} outside a WASM instance")
        h.check_stop()
        h.host_calls += 1
        try:
            value = fn(h, *args)
        except WasmtimeError:
            raise
        except Exception as e:
            if mode == "plain":
                return None
            code, msg = error_code(e)
            err = _record(code=code, message=redact(msg))  # no server paths to the guest
            return Variant("err", err) if mode == "tagged" else err
        if mode == "unit" or (mode == "plain" and name not in ("model-names", "mcp-servers")):
            return None
        return Variant("ok", value) if mode == "tagged" else value

    impl.__name__ = f"wit_{name.replace('-', '_')}"
    return impl


def add_host_imports(linker: Linker) -> None:
    """Define every import of world ``inferlet`` in ``linker``: the functions
    of :data:`IMPORTS`, each in its interface's instance (:data:`INTERFACES`)."""
    with linker.root() as root:
        for iface, names in INTERFACES.items():
            with root.add_instance(f"{PACKAGE}/{iface}@{VERSION}") as inst:
                for name in names:
                    fn, mode = IMPORTS[name]
                    inst.add_func(name, _wrap(name, fn, mode))
