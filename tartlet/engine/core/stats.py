"""The scheduler's counters (read by the server's /metrics)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    """Counters since start (monotonic; read without locking).

    ``tokens_generated`` counts the tokens sampled: output slots with a
    sampler that yielded a token (probes excluded; with speculative decoding
    every verified position counts, accepted or not). ``decode_steps``
    counts single-token request chunks, which differs from it whenever a
    pass samples several positions or none.

    Where the scheduler thread's time goes (seconds): ``forward_seconds``
    in model calls (batch tensors, model, samplers); ``batch_wait_seconds``
    waiting for last round's sequences to come back (``batch_wait_s``);
    ``overhead_seconds`` in its own Python between model calls (draining
    the queue into a batch, running commands, committing pages, resolving
    futures). The rest is idle (an empty queue). ``mixed_calls``: model
    calls holding both single-token (decode) and multi-token (prefill)
    chunks.

    ``last_batch``: requests in the last model call (0 before the first):
    the engine's load as speculative decoding reads it (``kv-stats``
    ``batch_requests``; :class:`tartlet.drafter.AdaptiveDrafter`). Not an
    average, so a lone request after a burst sees its own calls, not the
    burst's.

    Overlap scheduling (:mod:`.lookahead`): ``lookaheads`` passes made
    before their token reached the host, ``lookaheads_dropped`` of them
    dropped (their chain stopped or asked for another pass; each dropped
    one that ran cost a wasted row).
    """

    model_calls: int = 0
    batched_requests: int = 0
    tokens_computed: int = 0
    prefix_tokens_reused: int = 0
    decode_steps: int = 0
    tokens_generated: int = 0
    mixed_calls: int = 0
    forward_seconds: float = 0.0
    queue_wait_seconds: float = 0.0
    batch_wait_seconds: float = 0.0
    overhead_seconds: float = 0.0
    batch_sizes: collections.Counter[int] = field(default_factory=collections.Counter)
    last_batch: int = 0
    lookaheads: int = 0
    lookaheads_dropped: int = 0
