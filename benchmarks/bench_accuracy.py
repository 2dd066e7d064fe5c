"""The accuracy gate of 8-bit activations (issue 38): teacher-forced
accuracy of the quantized CPU path against the float reference.

For each model, the same GGUF runs as

* ``float32``: the reference, every weight dequantized to float32
  (``EngineConfig(dtype="float32")``, float32 KV pages);
* ``act16``, ``act8``, ``auto``: weights kept quantized, activations
  quantized per block of 32 to 16-bit or 8-bit integers, or ``"auto"`` (the
  default: 16 bits into the projections fed by an RMSNorm, 8 bits into the
  output and down projections; :class:`~tartlet.engine.models.llama.LlamaModel`),
  with the KV pages a served engine gets (``kv_dtype="auto"``: float16).

Over :data:`TEXT` (an English expository passage written for this script,
checked in, so every machine scores the same characters; >= 1,024 tokens
with both default models' tokenizers), in windows of ``--window`` tokens
(512) moved by ``--stride`` (256), as perplexity tools do: the first window
scores all its tokens, each later one only the tokens past the previous
window's end, so every text token (but the first, without BOS) is scored
once with at least ``window - stride`` tokens of context. A model whose
tokenizer adds BOS gets BOS at the head of every window.

Per setting: mean negative log-likelihood (nats/token) and perplexity, the
NLL change relative to the reference, top-1 agreement with the reference's
argmax at every scored position, and the largest absolute logit
difference. **The gate** (issue 38): a setting passes when its mean NLL is
within 0.5% of the float reference (``|rel| <= 0.005``); the default
(``act_bits = "auto"``) must pass on every model.

Logits come from the engine's own passes (scheduler, model runner, sampler)
through ``logprobs`` probe slots at every scored position; the float32
logits ``[S, V]`` the sampler receives for them are read by wrapping
``Sampler.run`` (:func:`window_logits`), NLLs computed from them in
float64, and every run checks that the probes' (float32)
log-probabilities equal those
(``tests/engine/test_bench_accuracy.py`` also checks :func:`text_nll`
against the ``logits`` probe of an inferlet).

Each window is one prefill pass (the path 8-bit activations are meant
for: prompts and multi-row steps); ``--decode`` instead feeds every scored
position as a decode step of its own (1-row kernels; ~window times slower).
On AVX-512 VNNI the two paths differ for 16-bit activations into weight
kinds that are not interleaved (Q6_K, e.g. in a Q4_K_M file): 8+ rows take
the float panel GEMM, 1-7 rows the 16-bit integer kernel; 8-bit
activations take their integer kernels at any row count
(:mod:`tartlet.engine.models.quant_linear`).

    .venv/bin/python benchmarks/bench_accuracy.py                    # the default model and gemma3-270m
    .venv/bin/python benchmarks/bench_accuracy.py --model gemma3-270m --decode
    .venv/bin/python benchmarks/bench_accuracy.py --model /models/llama-7b.Q4_K_M.gguf

The figures do not depend on machine load. ``llama-perplexity`` is not run:
the cached llama.cpp build keeps only ``llama-server`` and ``llama-quantize``
and a fresh build takes far longer than the gate itself (see ``llamacpp.py``).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from common import report

#: the settings, in table order: the float reference first
SETTINGS: tuple[str, ...] = ("float32", "act16", "act8", "auto")
ACT_BITS: dict[str, int | str] = {"act16": 16, "act8": 8, "auto": "auto"}
#: the gate: |NLL / reference NLL - 1| at most this
GATE = 0.005
DEFAULT_MODELS = ("smollm2-135m-instruct", "gemma3-270m")

TEXT = (
    "Rivers have shaped the places where people live for as long as there have been settlements at all. A river "
    "brings fresh water for drinking and for fields, carries boats and the goods they hold, and lays down rich "
    "soil when it floods. The earliest cities of Mesopotamia grew up between the Tigris and the Euphrates, and "
    "the kingdoms of ancient Egypt depended so completely on the yearly flood of the Nile that their calendar "
    "was built around it. Farmers watched the water rise in late summer, waited for it to fall, and then sowed "
    "their seed in the dark mud it left behind. When the flood was too low, the harvest failed; when it was too "
    "high, villages were swept away. Much of the early history of engineering is the story of people trying to "
    "make that rhythm more predictable, with canals, dikes, reservoirs and, much later, great dams of concrete.\n\n"
    "A river is also a border and a road. Many countries draw their frontiers along the middle of a channel, "
    "which causes trouble whenever the channel moves, as rivers on wide plains often do. At the same time, the "
    "river joins the towns along its banks into a single chain of trade. Before railways, moving a heavy load "
    "overland was slow and expensive, while a barge could carry many tons downstream with little more than a "
    "current and a steering oar. Going upstream was harder: crews rowed, poled or hauled their boats with ropes "
    "from towpaths on the shore, sometimes helped by horses or oxen. The invention of the steamboat in the early "
    "nineteenth century changed this almost overnight, and cities such as St. Louis, Cincinnati and New Orleans "
    "grew rich on the traffic of the Mississippi and the Ohio.\n\n"
    "Bread has a history nearly as long as that of farming itself. The first breads were probably flat cakes of "
    "crushed grain and water, baked on hot stones at the edge of a fire. Leavened bread, which rises because "
    "yeast produces bubbles of carbon dioxide in the dough, appears in Egypt several thousand years ago, and "
    "bakers there learned to keep a piece of each day's dough to start the next batch. The same method, now "
    "called sourdough, is still used today. A good loaf depends on a balance of simple things: the kind of flour, "
    "the amount of water, the temperature of the room, and the patience of the baker. Wheat flour contains "
    "proteins that form gluten when they are mixed with water and kneaded, and this elastic network traps the "
    "gas and lets the loaf rise. Rye and barley form much less gluten, so breads made from them are denser and "
    "darker, which is why they became the everyday food of colder regions where wheat grew poorly.\n\n"
    "In the towns of medieval Europe the price and weight of bread were fixed by law, because a rise in the cost "
    "of grain could quickly turn into hunger and unrest. Bakers who sold short loaves were fined or paraded "
    "through the streets, and some historians believe that the custom of the baker's dozen, thirteen loaves sold "
    "as twelve, began as a way to avoid such punishment. Mills were often owned by a lord or a monastery, and "
    "peasants had to pay to have their grain ground there, a right that was jealously guarded and bitterly "
    "resented. Windmills and watermills were among the most complex machines of their age, with gears of "
    "hardwood, millstones that weighed more than a ton, and a miller who had to judge the wind or the flow of "
    "the stream to keep the stones turning at the right speed.\n\n"
    "The lighthouse is a simpler machine, but one with a long and stubborn history. For centuries, sailors "
    "approaching a dangerous coast at night had nothing to guide them but fires lit on hills or towers. The most "
    "famous of the ancient lights stood on the island of Pharos at the harbor of Alexandria, and it was said to "
    "be visible from many miles out at sea. Later towers burned wood, coal or candles, and their light was weak "
    "and uncertain. In the eighteenth century oil lamps with reflectors made the beams stronger, and in the "
    "1820s the French physicist Augustin Fresnel designed a lens built from rings of glass prisms that could "
    "gather nearly all the light of a lamp into a single bright beam. His lenses were soon installed on coasts "
    "around the world, and many of them are still in place.\n\n"
    "Keeping a lighthouse was lonely and demanding work. The keeper trimmed the wicks, polished the brass and "
    "the glass, wound the clockwork that turned the lens, and wrote in a logbook the weather, the passing ships "
    "and every small event of the day. On remote rocks, keepers and their families might not see another person "
    "for weeks, and supplies arrived only when the sea was calm enough for a boat to land. During storms they "
    "stayed awake through the night, because a light that went out could mean a wreck before morning. Today "
    "almost every lighthouse is automatic, powered by electricity and checked from a distance, and satellite "
    "navigation tells a ship its position to within a few meters. Yet the towers remain, and many coastal "
    "towns have turned them into museums that remind visitors how recently the sea was far more dangerous.\n\n"
    "Clocks tell a related story about the wish to measure and control the world. Sundials worked only when the "
    "sun was shining, and water clocks, which measured time by the steady flow of water from one vessel into "
    "another, were affected by temperature and by dirt in the water. Mechanical clocks driven by falling weights "
    "appeared in the towers of European churches and town halls in the late thirteenth century. They were large, "
    "loud and not very accurate, often gaining or losing a quarter of an hour in a day, but they divided the day "
    "into equal hours and rang them out for everyone to hear. The pendulum clock, developed by Christiaan "
    "Huygens in 1656, reduced the error to a few seconds a day, and for the first time it made sense for "
    "clocks to have minute hands. A century later John Harrison built a series of marine timekeepers that kept "
    "accurate time on a rolling ship, which finally allowed sailors to work out their longitude at sea by "
    "comparing local noon with the time at their home port.\n\n"
    "Each of these histories follows a similar pattern. People begin with a natural force or a simple tool, "
    "learn its habits through long experience, and then, often in a short burst of invention, find a way to "
    "make it more regular, more powerful or more widely shared. The results change not only how work is done "
    "but also how people think about distance, about hunger, about danger and about time itself. It is easy "
    "to forget how strange our ordinary world would seem to someone from only a few generations ago, in which "
    "clean water runs from a tap, bread is sold in every shop, ships find their way in the dark without a "
    "keeper's lamp, and every pocket holds a clock more accurate than the best instrument Harrison ever made."
)


@dataclass
class Scores:
    """Per-position results of one setting over the text, in position order."""

    nll: list[float] = field(default_factory=list)  # -log p(target), nats
    top1: list[int] = field(default_factory=list)  # argmax of the logits
    logits: list[torch.Tensor] = field(default_factory=list)  # float32 [S, V] per window (kept only when asked)
    max_diff: float = 0.0  # largest |logit - reference logit| (with a reference)


def windows(n: int, bos: bool, window: int, stride: int) -> list[tuple[int, int, int]]:
    """``(start, end, first)`` text-token ranges of the windows over ``n``
    tokens: window ``k`` holds tokens ``[start, end)`` (``window`` tokens,
    one less with BOS in front) and scores the targets ``[first, end)``
    (each text token once; the very first only after BOS).

    Raises:
        ValueError: ``stride`` not in ``[1, window - 1]`` or ``n < 2``."""
    if not 1 <= stride < window or n < 2:
        raise ValueError(f"need 1 <= stride < window and at least 2 tokens (stride {stride}, window {window}, n {n})")
    size = window - int(bos)
    out: list[tuple[int, int, int]] = []
    start, scored = 0, 0 if bos else 1
    while True:
        end = min(start + size, n)
        out.append((start, end, scored))
        if end == n:
            return out
        scored, start = end, start + stride


def window_logits(engine: Any, inputs: list[int], positions: list[int], targets: list[int],
                  decode: bool = False) -> tuple[torch.Tensor, list[float]]:
    """``inputs`` through ``engine`` on a fresh sequence, in one forward
    pass (a prefill), or with ``decode`` the inputs up to ``positions[0]``
    in one pass and then one token a pass (decode steps; ``positions`` must
    then be consecutive): the float32 logits ``[len(positions), V]`` at
    input indexes ``positions``, and ``log p(targets[i])`` there (nats,
    float64 log-softmax of those logits; the ``logprobs`` probe slots that
    make the engine compute them agree to float32 rounding). The logits
    are the rows the engine's sampler receives for the probe slots
    (``Sampler.run`` wrapped meanwhile; the engine must run nothing else).

    Raises:
        RuntimeError: the captured rows do not match the probes (a row per
            slot, same log-probabilities within 1e-4)."""
    from tartlet.engine.core.requests import ForwardRequest
    from tartlet.engine.core.sampler import OutputSlot, ProbeSpec

    sampler = engine.runner.sampler
    rows: list[torch.Tensor] = []
    run = sampler.run

    def capture(logits: torch.Tensor, slots: list[Any], history: Any = None) -> list[object]:
        rows.append(logits.detach().to("cpu", torch.float32).clone())
        out: list[object] = run(logits, slots, history)
        return out

    seq = engine.new_sequence()
    sampler.run = capture
    try:
        slots = [OutputSlot(p, ProbeSpec("logprobs", token_ids=(t,))) for p, t in zip(positions, targets)]
        if not decode:
            res = engine.scheduler.submit(ForwardRequest(seq, list(inputs), outputs=slots)).result(600)
        else:
            p0 = positions[0]
            assert positions == list(range(p0, p0 + len(positions))), "decode needs consecutive positions"
            res = engine.scheduler.submit(ForwardRequest(seq, list(inputs[: p0 + 1]), outputs=[
                OutputSlot(p0, slots[0].spec)])).result(600)
            for p, slot in zip(positions[1:], slots[1:]):
                res += engine.scheduler.submit(ForwardRequest(seq, [inputs[p]], outputs=[OutputSlot(0, slot.spec)])).result(600)
    finally:
        del sampler.run  # the class's method again
        engine.scheduler.command(seq.free, seq).result(60)
    logits = torch.cat(rows) if rows else torch.empty(0)
    logp = [float(r[0]) for r in res]
    if logits.shape[0] != len(positions):
        raise RuntimeError(f"captured {logits.shape[0]} logit rows for {len(positions)} probe slots")
    ours = torch.log_softmax(logits.double(), -1)[torch.arange(len(targets)), torch.tensor(targets)]
    if not torch.allclose(ours, torch.tensor(logp, dtype=torch.float64), atol=1e-4):
        raise RuntimeError("captured logits do not match the logprobs probes")
    return logits, ours.tolist()


def score(engine: Any, ids: list[int], window: int, stride: int, keep_logits: bool = False,
          ref: Scores | None = None, decode: bool = False) -> Scores:
    """Teacher-forced scores of text tokens ``ids`` (no BOS; added per
    window when the engine's tokenizer adds one) on ``engine``; with
    ``ref`` (scored with ``keep_logits``), also the largest absolute logit
    difference from it. ``decode``: the scored positions one decode step
    each (:func:`window_logits`)."""
    tok = engine.tokenizer
    bos = [tok.bos_token_id] if tok.add_bos_token else []
    out = Scores()
    for k, (start, end, first) in enumerate(windows(len(ids), bool(bos), window, stride)):
        inputs = bos + ids[start:end]
        targets = ids[first:end]
        positions = [len(bos) + j - start - 1 for j in range(first, end)]  # the input before each target
        logits, logp = window_logits(engine, inputs, positions, targets, decode)
        out.nll += [-x for x in logp]
        out.top1 += logits.argmax(-1).tolist()
        if keep_logits:
            out.logits.append(logits)
        if ref is not None:
            out.max_diff = max(out.max_diff, float((logits - ref.logits[k]).abs().max()))
    return out


def text_nll(engine: Any, ids: list[int], window: int = 512, stride: int = 256, decode: bool = False) -> float:
    """Mean teacher-forced negative log-likelihood of ``ids`` on ``engine``,
    nats/token (see :func:`score`)."""
    s = score(engine, ids, window, stride, decode=decode)
    return math.fsum(s.nll) / len(s.nll)


def load(model: str, setting: str, window: int) -> Any:
    """A started engine of ``model`` in ``setting`` (one of :data:`SETTINGS`)."""
    from tartlet.engine.core.engine import Engine, EngineConfig

    common = dict(model=model, kv_cache_mb=256, max_batch_tokens=max(512, window), gemv_copy=False, huge_pages=False)
    if setting == "float32":
        return Engine.load(EngineConfig(dtype="float32", **common))  # type: ignore[arg-type]
    return Engine.load(EngineConfig(act_bits=ACT_BITS[setting], **common))  # type: ignore[arg-type]


def evaluate(model: str, text: str, window: int, stride: int, decode: bool = False) -> tuple[list[list[Any]], dict[str, Any]]:
    """The table rows and JSON payload of ``model`` over ``text``. Engines
    are loaded one at a time; the reference's logits are kept for the
    comparison (``[tokens, V]`` float32: ~1 GiB for a 262k vocabulary)."""
    from tartlet.engine.loading.model_store import resolve

    path = resolve(model)
    rows: list[list[Any]] = []
    ref: Scores | None = None
    res: dict[str, Any] = {"model": model, "file": path.name, "mode": "decode" if decode else "prefill", "settings": {}}
    for setting in SETTINGS:
        t0 = time.perf_counter()
        engine = load(str(path), setting, window)
        try:
            ids = engine.tokenizer.encode(text)
            s = score(engine, ids, window, stride, keep_logits=ref is None, ref=ref, decode=decode)
        finally:
            engine.close()
        nll = math.fsum(s.nll) / len(s.nll)
        if ref is None:
            ref, ref_nll = s, nll
            agree, diff = 1.0, 0.0
        else:
            agree = sum(a == b for a, b in zip(s.top1, ref.top1)) / len(s.top1)
            diff = s.max_diff
        rel = nll / ref_nll - 1
        ok = abs(rel) <= GATE
        rows.append([model, setting, len(s.nll), f"{nll:.4f}", f"{math.exp(nll):.3f}", f"{100 * rel:+.3f}%",
                     f"{100 * agree:.2f}%", f"{diff:.3f}", "ref" if setting == "float32" else ("pass" if ok else "FAIL"),
                     round(time.perf_counter() - t0, 1)])
        res["settings"][setting] = {"nll": nll, "ppl": math.exp(nll), "rel_nll": rel, "top1_agreement": agree,
                                    "max_abs_logit_diff": diff, "tokens": len(s.nll), "passes": ok}
    res["tokens"] = len(ref.nll) if ref else 0
    res["gate_auto"] = res["settings"]["auto"]["passes"]
    return rows, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="model name or GGUF path (repeatable; default: "
                    + ", ".join(DEFAULT_MODELS) + ")")
    ap.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    ap.add_argument("--stride", type=int, default=256, help="tokens between window starts (default 256)")
    ap.add_argument("--text-file", help="score this UTF-8 file instead of the built-in passage")
    ap.add_argument("--decode", action="store_true", help="score each position in a decode step of its own (1-row "
                    "kernels) instead of one prefill pass per window")
    args = ap.parse_args()
    text = open(args.text_file, encoding="utf-8").read() if args.text_file else TEXT
    rows: list[list[Any]] = []
    payload: dict[str, Any] = {"window": args.window, "stride": args.stride, "gate": GATE, "decode": args.decode,
                               "models": []}
    for model in args.model or DEFAULT_MODELS:
        r, res = evaluate(model, text, args.window, args.stride, args.decode)
        rows += r
        payload["models"].append(res)
    mode = "decode steps" if args.decode else "prefill passes"
    report(f"Teacher-forced accuracy vs the float32 reference ({mode}, window {args.window}, stride {args.stride}; "
           f"gate: |NLL change| <= {100 * GATE:.1f}%)",
           ["model", "setting", "tokens", "NLL", "PPL", "vs ref", "top-1 agree", "max |dlogit|", "gate", "s"],
           rows, payload)


if __name__ == "__main__":
    main()
