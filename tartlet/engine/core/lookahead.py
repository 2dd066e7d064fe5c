"""Overlap scheduling: the next decode step is built and queued on the
device while the current one runs (SGLang's overlap scheduler, vLLM's
asynchronous scheduling).

Without it a GPU idles between two decode steps while the host reads the
sampled tokens, runs the continuations, builds the next batch and uploads
it (about 0.6 ms of a 5 ms batch-1 step of an 8B model on an H200). With
it the host does that work for step N+1 while step N runs:

1. When a launched batch's every output slot is plain greedy
   (:func:`~.model_runner.plain_greedy`: the argmax is taken on the device)
   and every request with an output is a token chain
   (:attr:`~.requests.ForwardRequest.feed_back`: its continuation feeds the
   sampled token back, as a host-side ``generate`` does), the scheduler
   makes each request's next pass at once, a **lookahead**
   (:func:`lookaheads`), and queues it. Its input token is a placeholder on
   the host; on the device it is the token step N sampled
   (:meth:`~.model_runner.ModelRunner.launch`'s ``feeds``, a copy in stream
   order).
2. The scheduler builds and launches step N+1 with the lookaheads (and
   whatever else is queued), then finishes step N: it waits for the
   tokens, writes each into its lookahead's place in the sequence, and runs
   the continuations (:func:`settle`). A continuation that goes on as
   predicted hands its future and continuation to the lookahead, which is
   then an ordinary request; one that stops (a stop token, ``max_steps``,
   a closed stream) or asks for something else **drops** the lookahead,
   whose pass is rolled back when it finishes (its row of step N+1 was
   wasted), and is handled as without overlap.

So the tokens reach the continuations one step late, and greedy outputs
are those of the synchronous loop (the tests compare them). Other passes
on a sequence with a step in flight wait for it to finish (the lookahead
alone may be built before), so commands never see a token that may be
rolled back. Batches with other outputs (draws, probes, masks, hidden
states, stepping inferlets' passes) run synchronously, as before.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from .model_runner import Launch
from .requests import ForwardRequest


def lookaheads(launch: Launch, future: Future[list[object]]) -> list[ForwardRequest]:
    """The lookahead passes of ``launch``'s requests, linked to them, or
    ``[]`` when the launch does not qualify (module docstring, step 1): no
    device-side tokens, or a request with an output that is not a token
    chain ending its pass here. ``future``: a placeholder they share until
    each takes its origin's (a ``Future`` each would cost ~15 us, a step of
    256 chains 4 ms); nothing resolves it (see :meth:`Scheduler._fail`)."""
    if launch.feed is None:
        return []
    for it in launch.items:
        req = it.req
        if not it.out_slots or req.dropped:  # a prefill chunk before its last (no output), a dropped lookahead
            continue
        if (req.feed_back is None or req.done != len(req.tokens) or len(req.outputs) != 1
                or req.outputs[0].index != len(req.tokens) - 1 or req.probe is not None):
            return []
    now = time.perf_counter()
    out = []
    k = 0  # the output slot of the chunk (one each)
    for it in launch.items:
        req = it.req
        if it.out_slots and not req.dropped:
            la = ForwardRequest(req.seq, [0], outputs=[req.feed_back], future=future, continued=True, user=req.user,  # type: ignore[list-item]  # checked above
                                adapter=req.adapter, feed_back=req.feed_back, origin=req, feed=(launch, k))
            la.enqueued_at = now
            req.ahead = la
            out.append(la)
        k += len(it.out_slots)
    return out


def drop(la: ForwardRequest) -> None:
    """Drop lookahead ``la`` and the lookahead made from it, if any: they
    run no further (queued) or are rolled back when their step finishes."""
    while la is not None:
        la.dropped = True
        la = la.ahead  # type: ignore[assignment]  # the loop ends at None


def place_token(req: ForwardRequest) -> None:
    """Once ``req``'s pass is done: write its sampled token over the
    placeholder of its lookahead in the sequence, if the lookahead is
    reserved there (before the finished pages are registered in the prefix
    cache)."""
    la = req.ahead
    if la is None or la.dropped or la.start_len < 0 or req.seq.freed:
        return
    tok = req.results[0]
    if isinstance(tok, int) and la.start_len < len(req.seq.tokens):
        req.seq.tokens[la.start_len] = tok


def settle(req: ForwardRequest, again: list[ForwardRequest]) -> None:
    """Run the continuation of ``req`` (done, its results in, a lookahead
    made for it): hand its future and continuation to the lookahead when
    the continuation asks for the pass the lookahead runs; else drop the
    lookahead and do what the continuation says (resolve the future,
    re-arm ``req`` into ``again``, or fail it with what it raised)."""
    la = req.ahead
    assert la is not None and req.then is not None  # called for requests with a lookahead
    req.ahead = None
    if la.dropped:  # could not be queued (pool full, quota, length, freed): as without overlap
        if not req.continue_into(again):
            req.future.set_result(req.results)
        return
    try:
        nxt = req.then(req.results)
    except BaseException as e:  # reported to the submitter
        drop(la)
        req.future.set_exception(e)
        return
    if nxt is None:
        drop(la)
        req.future.set_result(req.results)
        return
    tokens, outputs = nxt
    if tokens == [req.results[0]] and len(outputs) == 1 and outputs[0] is la.outputs[0]:
        la.origin, la.feed, la.tokens = None, None, list(tokens)
        la.then, la.future = req.then, req.future
        return
    drop(la)
    req.continue_with(nxt, again)
