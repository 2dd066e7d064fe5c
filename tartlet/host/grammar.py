"""Host-side grammar matchers: llguidance bridged to a model's tokenizer.

A matcher holds the parse state of one constrained generation. Each step it
yields the set of tokens that keep the output inside the grammar (a logit
mask, True = allowed) and advances by the token that was sampled.

Engine choice: llguidance (https://github.com/guidance-ai/llguidance), picked
over xgrammar by measurement with this model's tokenizer (see
``docs/constrained-decoding.md``): a 60-property JSON Schema compiles in about
5 ms versus about 500 ms, and a mask costs about 40 us on average with a
worst case under 1 ms versus 13 ms.

Tokenizer bridge: llguidance reads the HF ``tokenizers`` JSON of
:attr:`tartlet.engine.text.tokenizer.Tokenizer.backend` (byte-level BPE; special
tokens are never produced by a grammar except the end-of-sequence ids, which
are allowed exactly when the grammar accepts). The mask covers the model's
``vocab_size`` (49152 for SmolLM2), ids beyond the tokenizer are never allowed.

Mask formats (all little-endian bit order: bit ``i % 8`` of byte ``i // 8`` is
token ``i``, the llguidance bitmask layout):

* packed bits, ``ceil(V / 8)`` bytes;
* BRLE run lengths (:mod:`tartlet.sdk.brle`);
* a bool ``[V]`` tensor for the sampler (:class:`GrammarOutputSlot`), computed
  on :data:`MASK_POOL` while the forward pass runs.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance as llg
import numpy as np
import numpy.typing as npt
import torch
from llguidance.gbnf_to_lark import any_to_lark

from ..engine.core.sampler import OutputSlot, ProbeSpec, SamplerSpec, checkable
from ..sdk.errors import GrammarError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # the stub's TypedDict, not exported at run time

#: Constraint kinds a host accepts in ``grammar_new``.
GRAMMAR_KINDS = ("json_schema", "any_json", "regex", "grammar")
#: Largest grammar spec (JSON text, regex or grammar text), in characters.
MAX_SPEC_CHARS = 1 << 20
#: Compiled matchers kept (initial state) for reuse by later ``grammar_new``.
TEMPLATE_CACHE_SIZE = 128

#: Threads that compute masks while the forward pass runs (llguidance drops
#: the GIL while computing a mask).
MASK_POOL = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="tartlet-grammar")

#: JSON compile options: compact separators (``,`` and ``:``), no free
#: whitespace. Flexible whitespace lets a small model pad with newlines
#: forever; compact output is also fewer tokens.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


@dataclass
class GrammarStats:
    """Counters since start, for benchmarks (monotonic; read without locking).

    Attributes:
        compiles: grammars compiled (template cache misses).
        compile_seconds: time spent compiling and computing first masks.
        masks: masks computed.
        mask_seconds: time spent computing masks (on any thread).
        wait_seconds: time the sampler waited for a mask that was not ready
            when the logits were (the part of mask time not overlapped).
        advances: tokens consumed.
        advance_seconds: time spent consuming tokens.
        checks: picked tokens checked against a matcher before any mask
            (:meth:`Matcher.accepts`); ``checks_passed`` of them were
            allowed, so those steps computed no mask.
        check_seconds: time spent checking.
    """

    compiles: int = 0
    compile_seconds: float = 0.0
    masks: int = 0
    mask_seconds: float = 0.0
    wait_seconds: float = 0.0
    advances: int = 0
    advance_seconds: float = 0.0
    checks: int = 0
    checks_passed: int = 0
    check_seconds: float = 0.0


STATS = GrammarStats()

_tokenizers: "weakref.WeakKeyDictionary[Any, llg.LLTokenizer]" = weakref.WeakKeyDictionary()
_templates: "collections.OrderedDict[tuple[int, str], llg.LLMatcher]" = collections.OrderedDict()
_lock = threading.Lock()


def ll_tokenizer(tokenizer: Any, vocab_size: int) -> llg.LLTokenizer:
    """The llguidance tokenizer for a :class:`tartlet.engine.text.tokenizer.Tokenizer`
    (built once per tokenizer, ~0.3-0.7 s, then cached).

    Args:
        tokenizer: the engine's tokenizer (``backend`` is an HF
            ``tokenizers.Tokenizer``; ``eos_token_ids`` end generation).
        vocab_size: the model's vocabulary size (mask length).
    """
    with _lock:
        lt = _tokenizers.get(tokenizer)
        if lt is None:
            lt = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids))
            _tokenizers[tokenizer] = lt
        return lt


def to_llguidance(kind: str, spec: Any) -> str:
    """The llguidance grammar text for a constraint spec.

    Args:
        kind: one of :data:`GRAMMAR_KINDS`.
        spec: ``json_schema``: a JSON Schema as a dict, a bool or JSON text;
            ``any_json``: ignored (None); ``regex``: a pattern (Rust ``regex``
            syntax, full match); ``grammar``: Lark text (llguidance dialect)
            or GBNF/EBNF text (llama.cpp, ``root ::= ...``).

    Raises:
        GrammarError: unknown kind, wrong spec type, a spec too large, JSON
            that does not parse, or GBNF that does not convert.
    """
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r} (known: {', '.join(GRAMMAR_KINDS)})")
    if kind == "any_json":
        if spec is not None:
            raise GrammarError("an any_json grammar takes no spec")
        return llg.LLMatcher.grammar_from_json_schema({}, defaults=_JSON_OPTIONS)
    if kind == "json_schema":
        if isinstance(spec, str):
            if len(spec) > MAX_SPEC_CHARS:
                raise GrammarError(f"JSON Schema text is {len(spec)} characters, more than {MAX_SPEC_CHARS}")
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise GrammarError(f"JSON Schema text is not valid JSON: {e}") from None
        if spec is False:
            raise GrammarError("invalid JSON Schema: the schema `false` matches nothing (unsatisfiable)")
        if spec is True:
            spec = {}
        if not isinstance(spec, dict):
            raise GrammarError(f"a JSON Schema is a dict, a bool or JSON text, got {type(spec).__name__}")
        try:
            text = json.dumps(spec)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"JSON Schema is not JSON-serialisable: {e}") from None
        if len(text) > MAX_SPEC_CHARS:
            raise GrammarError(f"JSON Schema is {len(text)} characters of JSON, more than {MAX_SPEC_CHARS}")
        try:
            return llg.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"invalid JSON Schema: {e}") from None
    if not isinstance(spec, str):
        raise GrammarError(f"a {kind} spec is a str, got {type(spec).__name__}")
    if len(spec) > MAX_SPEC_CHARS:
        raise GrammarError(f"{kind} spec is {len(spec)} characters, more than {MAX_SPEC_CHARS}")
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec)
    if not spec.strip():
        raise GrammarError("empty grammar text")
    try:
        lark = any_to_lark(spec)
    except Exception as e:  # the GBNF converter raises plain exceptions
        raise GrammarError(f"invalid GBNF grammar: {e}") from None
    return llg.LLMatcher.grammar_from_lark(lark)


_KIND_NAMES = {"json_schema": "JSON Schema", "any_json": "JSON", "regex": "regex", "grammar": "grammar"}


class Matcher:
    """One grammar matcher bound to one engine's tokenizer.

    Thread safety: every method takes the matcher's lock, and methods that
    read or change the state first wait for a mask still being computed
    (:meth:`mask_async`), so a mask is always of the state it was asked in.
    """

    def __init__(self, engine: Any, kind: str, ll: llg.LLMatcher, vocab_size: int) -> None:
        self.engine = engine
        self.kind = kind
        self.vocab_size = vocab_size
        self._m = ll
        self._lock = threading.Lock()
        self._pending: Future[torch.Tensor] | None = None
        self.consumed = 0
        self.error: str | None = None

    # -- construction -------------------------------------------------------
    @classmethod
    def compile(cls, engine: Any, kind: str, spec: Any) -> "Matcher":
        """A fresh matcher for ``spec`` on ``engine``'s tokenizer.

        Compiled grammars are cached (initial state, :data:`TEMPLATE_CACHE_SIZE`
        entries) so compiling the same spec again costs one copy.

        Raises:
            GrammarError: the spec is invalid, uses an unsupported feature,
                or no token can start it (the message is llguidance's).
        """
        grammar = to_llguidance(kind, spec)
        vocab = int(engine.config.vocab_size)
        lt = ll_tokenizer(engine.tokenizer, vocab)
        key = (id(lt), grammar)
        with _lock:
            tmpl = _templates.get(key)
            if tmpl is not None:
                _templates.move_to_end(key)
        if tmpl is None:
            t0 = time.perf_counter()
            ll = llg.LLMatcher(lt, grammar, log_level=0)
            if ll.is_error():
                raise GrammarError(f"invalid {_KIND_NAMES[kind]}: {_first_lines(ll.get_error())}")
            first = np.frombuffer(ll.compute_bitmask(), dtype=np.uint8)
            STATS.compiles += 1
            STATS.compile_seconds += time.perf_counter() - t0
            if ll.is_error() or not (first.any() or ll.is_accepting()):
                why = _first_lines(ll.get_error()) if ll.is_error() else "no token is allowed"
                raise GrammarError(f"unsatisfiable {_KIND_NAMES[kind]}: no token sequence can match it ({why})")
            ll.reset()
            with _lock:
                _templates[key] = ll
                while len(_templates) > TEMPLATE_CACHE_SIZE:
                    _templates.popitem(last=False)
            tmpl = ll
        return cls(engine, kind, tmpl.deep_copy(), vocab)

    # -- state --------------------------------------------------------------
    def _settle(self) -> None:
        p = self._pending
        if p is not None:
            self._pending = None
            try:
                p.result()
            except Exception:  # recorded in self.error by the job
                pass

    def _check(self) -> None:
        if self.error is None and self._m.is_error():
            self.error = _first_lines(self._m.get_error())
        if self.error is not None:
            raise GrammarError(f"the {_KIND_NAMES[self.kind]} matcher failed after {self.consumed} tokens: {self.error}")

    def advance(self, token: int) -> None:
        """Consume the sampled ``token``.

        Raises:
            GrammarError: the token is not allowed here (the state is left
                unchanged), or the matcher failed earlier.
        """
        self._settle()
        with self._lock:
            self._check()
            t0 = time.perf_counter()
            ok = self._m.try_consume_tokens([token]) == 1
            STATS.advances += 1
            STATS.advance_seconds += time.perf_counter() - t0
            if not ok:
                text = self.engine.tokenizer.decode([token])
                raise GrammarError(
                    f"token {token} ({text!r}) is not allowed by the {_KIND_NAMES[self.kind]} after {self.consumed} tokens"
                )
            self.consumed += 1

    def accepts(self, token: int) -> bool:
        """True when the mask of the current state would allow ``token``
        (nothing is consumed; a few microseconds where a mask takes ~0.5
        ms); False may also mean "ask the mask".

        llguidance's ``validate_tokens`` decides, except where the grammar
        forces the next bytes (``compute_ff_bytes``, e.g. ``","name":"``
        after a finished enum value): there the mask keeps to the canonical
        tokens of the forced bytes (it forbids ``",`` where ``","`` is one
        token) while ``validate_tokens`` accepts any valid bytes, so this
        returns False. Checked against the mask over every token of 52
        unforced states of 12 schemas (no difference) and in tests.
        False for a token id outside the vocabulary and for a failed
        matcher (whose error the next call raises)."""
        self._settle()
        with self._lock:
            if self.error is not None or self._m.is_error() or not 0 <= token < self.vocab_size:
                return False
            t0 = time.perf_counter()
            ok = not self._m.compute_ff_bytes() and self._m.validate_tokens([token]) == 1
            STATS.checks += 1
            STATS.checks_passed += ok
            STATS.check_seconds += time.perf_counter() - t0
            return ok

    def ensure_ok(self) -> None:
        """Raise the matcher's error, if it failed.

        Raises:
            GrammarError: the matcher failed earlier.
        """
        self._settle()
        with self._lock:
            self._check()

    def fork(self) -> "Matcher":
        """An independent copy of this matcher in the same state."""
        self._settle()
        with self._lock:
            self._check()
            m = Matcher(self.engine, self.kind, self._m.deep_copy(), self.vocab_size)
            m.consumed = self.consumed
            return m

    def reset(self) -> None:
        """Back to the initial state (no token consumed)."""
        self._settle()
        with self._lock:
            self._check()
            self._m.reset()
            self.consumed = 0

    def is_finished(self) -> bool:
        """True when the grammar is complete and allows nothing but the
        end-of-sequence tokens (or consumed one)."""
        self._settle()
        with self._lock:
            self._check()
            return self._m.is_stopped()

    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (more may follow)."""
        self._settle()
        with self._lock:
            self._check()
            return self._m.is_accepting()

    # -- masks --------------------------------------------------------------
    def bits(self) -> npt.NDArray[np.uint8]:
        """Packed allowed-token bits of the current state: uint8
        ``[ceil(V / 8)]``, little-endian bit order.

        Raises:
            GrammarError: the matcher failed (earlier or now).
        """
        self._settle()
        with self._lock:
            self._check()
            out = self._compute()
            self._check()
            return out

    def _compute(self) -> npt.NDArray[np.uint8]:
        t0 = time.perf_counter()
        words = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        self._m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        STATS.masks += 1
        STATS.mask_seconds += time.perf_counter() - t0
        return words.view(np.uint8)[: (self.vocab_size + 7) // 8]

    def mask_async(self) -> Future[torch.Tensor]:
        """Start computing the bool ``[V]`` mask tensor of the current state
        on :data:`MASK_POOL`; a future of it. A failed matcher gives an
        all-False mask (the sampler then fails that slot alone) and the error
        is raised by the next call on this matcher.

        Raises:
            GrammarError: the matcher failed earlier.
        """
        self._settle()
        with self._lock:
            self._check()

        def job() -> torch.Tensor:
            with self._lock:
                try:
                    packed = self._compute()
                except Exception as e:  # keep the batch alive; report on the next call
                    self.error = f"mask computation failed: {e}"
                    return torch.zeros(self.vocab_size, dtype=torch.bool)
                if self._m.is_error():
                    self.error = _first_lines(self._m.get_error())
                    return torch.zeros(self.vocab_size, dtype=torch.bool)
            return bits_to_tensor(packed, self.vocab_size)

        fut = MASK_POOL.submit(job)
        self._pending = fut
        return fut

    def close(self) -> None:
        """Wait for a mask in flight; the matcher is then dropped."""
        self._settle()


def bits_to_tensor(packed: npt.NDArray[np.uint8], size: int) -> torch.Tensor:
    """Packed little-endian bits -> bool tensor ``[size]``."""
    bits = np.unpackbits(packed, count=size, bitorder="little").view(np.bool_)
    return torch.from_numpy(bits)


def bits_to_brle(packed: npt.NDArray[np.uint8], size: int) -> list[int]:
    """Packed little-endian bits -> BRLE run lengths (first run False) over
    ``size`` bits (:mod:`tartlet.sdk.brle` format)."""
    bits = np.unpackbits(packed, count=size, bitorder="little")
    edges = np.flatnonzero(bits[1:] != bits[:-1]) + 1
    bounds = np.concatenate(([0], edges, [size]))
    runs: list[int] = np.diff(bounds).tolist()
    return ([0] + runs) if size and bits[0] else runs


class GrammarOutputSlot(OutputSlot):
    """An output slot whose logit mask comes from a matcher.

    A greedy slot, or a plain temperature draw (no top-k, top-p or min-p;
    :func:`~tartlet.engine.core.sampler.checkable`), computes no mask up front:
    the sampler picks from the unmasked logits and checks the token with the
    matcher (:attr:`OutputSlot.check`, :meth:`Matcher.accepts`); only when
    the grammar forbids it is the mask computed, then, while the sampler
    waits: on the sampler's thread when it is the batch's only one (a
    handoff to a worker thread cost ~0.15 ms on a 2-core machine), else on
    :data:`MASK_POOL` beside the others (``OutputSlot.prefetch``). Greedy
    picks the same token as masking first, a draw follows the
    same (masked) distribution (see :attr:`OutputSlot.check`). On a JSON
    string's inside or free text nearly every step's pick is allowed, so
    most steps cost a check (~10 us) instead of a mask (~0.5 ms of CPU that,
    on a machine whose cores all run the forward pass, came out of the
    pass). Other slots (filtered draws, probes) need the whole mask: it is
    computed on :data:`MASK_POOL` from submission on, while the batch waits
    and runs; reading it blocks only for what is left (counted in
    :attr:`GrammarStats.wait_seconds`).

    Raises:
        GrammarError: (construction) the matcher failed earlier.
    """

    #: Checkable slots pick before any mask (False: every slot computes its
    #: mask up front, as filtered draws do; for tests and benchmarks).
    check_first = True

    def __init__(self, index: int, spec: SamplerSpec | ProbeSpec, matcher: Matcher, extra: torch.Tensor | None) -> None:
        self._matcher = matcher
        self._extra = extra
        self._resolved: torch.Tensor | None = None
        lazy = self.check_first and checkable(spec)
        if lazy:
            matcher.ensure_ok()
        self._mask: Future[torch.Tensor] | None = None if lazy else matcher.mask_async()
        super().__init__(index, spec, None, self._accepts if lazy else None, self._prefetch if lazy else None)

    def _accepts(self, token: int) -> bool:
        return (self._extra is None or bool(self._extra[token])) and self._matcher.accepts(token)

    def _prefetch(self) -> None:
        """Start this checked slot's mask on :data:`MASK_POOL` (the sampler
        needs several masks of one batch: see ``OutputSlot.prefetch``)."""
        if self._mask is None and self._resolved is None:
            try:
                self._mask = self._matcher.mask_async()
            except GrammarError:  # failed since: `allowed` gives the empty mask
                pass

    @property
    def allowed(self) -> torch.Tensor:
        if self._resolved is None:
            t0 = time.perf_counter()
            try:
                if self._mask is None:  # a checked slot whose pick the grammar forbids: computed here
                    m = bits_to_tensor(self._matcher.bits(), self._matcher.vocab_size)
                else:
                    m = self._mask.result()
            except GrammarError:  # failed since: this slot fails alone, the next call raises
                m = torch.zeros(self._matcher.vocab_size, dtype=torch.bool)
            STATS.wait_seconds += time.perf_counter() - t0
            self._resolved = m if self._extra is None else (m & self._extra)
        return self._resolved

    @allowed.setter
    def allowed(self, value: Any) -> None:  # the dataclass __init__ assigns None
        if value is not None:
            self._resolved = value


def _first_lines(msg: str, n: int = 6) -> str:
    """An llguidance error message without its parser-state dump."""
    msg = msg.strip()
    cut = msg.find("\n<state>")
    if cut >= 0:
        msg = msg[:cut]
    lines = msg.splitlines()
    return "\n".join(lines[:n]) + ("\n..." if len(lines) > n else "")
