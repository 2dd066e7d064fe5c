"""Samplers and probes on synthetic logits (SlotSampler), and parameter
validation in the SDK and on the host's forward path."""

from __future__ import annotations

import math

import pytest
import torch

import tartlet
from tartlet.engine.core.sampler import OutputSlot, ProbeSpec, SamplerSpec, SamplingError, SlotSampler

V = 8
#: probabilities 0.4, 0.2, 0.15, 0.1, 0.06, 0.05, 0.03, 0.01 at shuffled ids
PROBS = torch.tensor([0.1, 0.03, 0.4, 0.06, 0.15, 0.01, 0.2, 0.05])
LOGITS = PROBS.log() + 3.0  # a shift changes nothing after softmax
ORDER = PROBS.argsort(descending=True).tolist()  # ids by probability: [2, 6, 4, 0, 3, 7, 1, 5]
N = 4000


def draw(spec_kw: dict, n: int = N, logits: torch.Tensor = LOGITS, allowed: torch.Tensor | None = None) -> list[int]:
    """``n`` draws with seeds 0..n-1, all in one batch."""
    slots = [OutputSlot(0, SamplerSpec(seed=i, **spec_kw), allowed) for i in range(n)]
    out = SlotSampler(V).run(logits.expand(n, V), slots)
    assert all(isinstance(t, int) for t in out), out[:3]
    return out


def freqs(ids: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(ids), minlength=V).float() / len(ids)


def assert_follows(ids: list[int], p: torch.Tensor) -> None:
    """Empirical frequencies within 5 standard errors (+0.005) of ``p``."""
    f = freqs(ids)
    tol = 5 * (p * (1 - p) / len(ids)).sqrt() + 0.005
    assert bool(((f - p).abs() <= tol).all()), f"frequencies {f.tolist()} vs expected {p.tolist()}"


def test_argmax():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    slots = [OutputSlot(0, SamplerSpec()) for _ in range(5)]
    assert SlotSampler(V).run(logits, slots) == logits.argmax(-1).tolist()


def test_temperature_follows_softmax():
    ids = draw({"temperature": 1.0})
    assert set(ids) == set(range(V))  # full support
    assert_follows(ids, PROBS)
    hot = draw({"temperature": 2.0})
    assert_follows(hot, torch.softmax(LOGITS / 2.0, -1))
    cold = draw({"temperature": 0.05}, n=500)
    assert set(cold) == {ORDER[0]}  # (0.2/0.4)**20 ~ 1e-6: only the mode


def test_top_k_support_and_frequencies():
    for k in (1, 2, 3, 5):
        assert set(draw({"temperature": 1.0, "top_k": k}, n=1000)) == set(ORDER[:k]), k
    # a big k with temperature 1 is plain multinomial
    ids = draw({"temperature": 1.0, "top_k": 100})
    assert_follows(ids, PROBS)
    # top-k 3 renormalises over the three most likely tokens
    ids3 = draw({"temperature": 1.0, "top_k": 3})
    p3 = torch.zeros(V)
    p3[ORDER[:3]] = PROBS[ORDER[:3]] / PROBS[ORDER[:3]].sum()
    assert_follows(ids3, p3)


def test_top_p_support():
    # sorted probs 0.4, 0.2, 0.15, 0.1, ...: cumulative 0.4, 0.6, 0.75, 0.85
    cases = {0.1: 1, 0.5: 2, 0.7: 3, 0.8: 4, 1.0: V}
    for p, n in cases.items():
        assert set(draw({"temperature": 1.0, "top_p": p}, n=1500)) == set(ORDER[:n]), p


def test_min_p_support():
    # p >= min_p * 0.4: min_p 0.3 -> >= 0.12 -> {0.4, 0.2, 0.15}; 0.6 -> >= 0.24 -> {0.4}
    assert set(draw({"temperature": 1.0, "min_p": 0.3}, n=1500)) == set(ORDER[:3])
    assert set(draw({"temperature": 1.0, "min_p": 0.6}, n=300)) == {ORDER[0]}
    assert set(draw({"temperature": 1.0, "min_p": 0.0}, n=3000)) == set(range(V))


def test_top_k_top_p_combined():
    # top-k 5 renormalises to 0.4/0.91, 0.2/0.91, ... (cum 0.44, 0.66, 0.82, 0.93); top-p 0.7 keeps 3
    assert set(draw({"temperature": 1.0, "top_k": 5, "top_p": 0.7}, n=1500)) == set(ORDER[:3])


def test_top_p_beyond_candidate_list():
    # a flat distribution over a large vocabulary: top-p 0.9 needs more than 512 candidates
    big = 2000
    logits = torch.zeros(1, big)
    slots = [OutputSlot(0, SamplerSpec(temperature=1.0, top_p=0.9, seed=s)) for s in range(300)]
    ids = SlotSampler(big).run(logits.expand(300, big), slots)
    assert max(ids) >= 512 or len(set(ids)) > 250


def test_seed_reproducibility():
    s = SlotSampler(V)
    spec = SamplerSpec(temperature=1.0, seed=1234)
    first = s.run(LOGITS[None], [OutputSlot(0, spec)])[0]
    # the same seed gives the same draw alone or in a batch with other slots
    mixed = [OutputSlot(0, SamplerSpec(temperature=1.0, seed=i)) for i in range(7)] + [OutputSlot(0, spec)]
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(1))
    logits[7] = LOGITS
    assert s.run(logits, mixed)[7] == first
    assert SlotSampler(V).run(LOGITS[None], [OutputSlot(0, spec)])[0] == first
    # different seeds do not all agree
    assert len(set(draw({"temperature": 1.0}, n=50))) > 1
    # the SDK derives a different seed per step from one sampler seed
    sampler = tartlet.Sampler(temperature=1.0, seed=7)
    seeds = [sampler.slot(0, step).seed for step in range(4)]
    assert len(set(seeds)) == 4 and seeds == [tartlet.Sampler(temperature=1.0, seed=7).slot(0, i).seed for i in range(4)]


def test_logit_mask():
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[0, 3, 5]] = True
    ids = draw({"temperature": 1.0}, n=2000, allowed=allowed)
    assert set(ids) == {0, 3, 5}
    greedy = SlotSampler(V).run(LOGITS[None], [OutputSlot(0, SamplerSpec(), allowed)])
    assert greedy == [0]  # the most likely allowed id (0.1)
    dist = SlotSampler(V).run(LOGITS[None], [OutputSlot(0, ProbeSpec("distribution", k=V), allowed)])[0]
    assert set(dist[0][:3]) == {0, 3, 5} and sum(dist[1]) == pytest.approx(1.0, abs=1e-5)


def test_all_masked_is_a_sampling_error_for_that_slot_only():
    none = torch.zeros(V, dtype=torch.bool)
    out = SlotSampler(V).run(LOGITS.expand(2, V), [OutputSlot(0, SamplerSpec(), none), OutputSlot(0, SamplerSpec())])
    assert isinstance(out[0], SamplingError) and "allows no token" in str(out[0])
    assert out[1] == ORDER[0]


def test_probes():
    s = SlotSampler(V)
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3))
    dist, raw, lp, ent, uni = s.run(
        torch.stack([logits, logits, logits, logits, torch.zeros(V)]),
        [
            OutputSlot(0, ProbeSpec("distribution", k=5)),
            OutputSlot(0, ProbeSpec("logits")),
            OutputSlot(0, ProbeSpec("logprobs", token_ids=(0, 5, 7))),
            OutputSlot(0, ProbeSpec("entropy")),
            OutputSlot(0, ProbeSpec("entropy")),
        ],
    )
    ids, probs = dist
    assert len(ids) == len(probs) == 5
    assert probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-6
    ref = torch.softmax(logits, -1)
    assert ids == ref.topk(5).indices.tolist()
    assert probs == pytest.approx(ref.topk(5).values.tolist(), abs=1e-6)
    assert raw == pytest.approx(logits.tolist(), abs=0)
    assert lp == pytest.approx(torch.log_softmax(logits, -1)[[0, 5, 7]].tolist(), abs=1e-6)
    assert ent == pytest.approx(float(-(ref * ref.log()).sum()), abs=1e-5)
    assert uni == pytest.approx(math.log(V), abs=1e-6)
    # distribution with a temperature
    ids2, probs2 = s.run(logits[None], [OutputSlot(0, ProbeSpec("distribution", k=V, temperature=0.5))])[0]
    assert probs2 == pytest.approx(torch.softmax(logits / 0.5, -1).sort(descending=True).values.tolist(), abs=1e-6)


def test_invalid_probe_specs():
    with pytest.raises(SamplingError, match="unknown probe kind 'foo'"):
        ProbeSpec("foo")
    with pytest.raises(SamplingError, match="k >= 1"):
        ProbeSpec("distribution", k=0)
    with pytest.raises(SamplingError, match="temperature > 0"):
        ProbeSpec("distribution", temperature=0.0)
    out = SlotSampler(V).run(LOGITS[None], [OutputSlot(0, ProbeSpec("logprobs", token_ids=(99,)))])
    assert isinstance(out[0], SamplingError) and "99" in str(out[0])


BAD_PARAMS = [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -3}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
]


@pytest.mark.parametrize(("kw", "name"), BAD_PARAMS)
def test_sdk_sampler_rejects_bad_params(kw, name):
    with pytest.raises(ValueError, match=name):
        tartlet.Sampler(**kw)
    with pytest.raises(ValueError, match=name):
        SamplerSpec(**kw)


def test_sdk_sampler_presets_validate():
    with pytest.raises(ValueError, match="top_k"):
        tartlet.Sampler.top_k(0)
    with pytest.raises(ValueError, match="top_p"):
        tartlet.Sampler.top_p(2.0)
    with pytest.raises(ValueError, match="seed"):
        tartlet.Sampler(temperature=1.0, seed="x")
    with pytest.raises(ValueError, match="k >= 1"):
        tartlet.Sampler.custom(lambda ids, probs: ids[0], k=0)
    assert tartlet.Sampler.top_k_top_p(5, 0.9).slot(3) == tartlet.sdk.forward.OutputSlot(
        3, "sample", temperature=1.0, top_k=5, top_p=0.9, min_p=0.0)


def test_sdk_sampler_optional_arguments_are_keyword_only():
    """Pie's order is ``top_p(temperature, p)``: ``Sampler.top_p(0.6, 0.95)``
    must not silently mean p=0.6 at temperature 0.95."""
    S = tartlet.Sampler
    for call in (lambda: S.top_p(0.6, 0.95), lambda: S.top_k(5, 0.7), lambda: S.min_p(0.1, 0.7),
                 lambda: S.top_k_top_p(5, 0.9, 0.7), lambda: S.multinomial(0.7), lambda: S.top_p(0.9, 0.7, 1),
                 lambda: S.reasoning(3), lambda: S.custom(lambda ids, probs: ids[0], 8), lambda: S(0.7)):
        with pytest.raises(TypeError):
            call()
    s = S.top_p(0.6, temperature=0.95, seed=2)
    assert (s.top_p, s.temperature, s.seed) == (0.6, 0.95, 2)


@pytest.mark.parametrize(("kw", "name"), BAD_PARAMS + [({"seed": "abc"}, "seed")])
def test_host_forward_rejects_bad_params(host_state, kw, name):
    from tartlet.host.api import HostApi

    api = HostApi(host_state)
    h = api.context_new(None)
    slot = tartlet.sdk.forward.OutputSlot(0, "sample", **{"temperature": 1.0, **kw})
    with pytest.raises(ValueError, match=name):
        api.forward(h, [1, 2, 3], outputs=[slot])
    assert api.context_len(h) == 0 and api.context_tokens(h) == []
    api.close()


class _LazyMaskSlot(OutputSlot):
    """A greedy slot with a check and a mask that counts its reads."""

    def __init__(self, allow: list[int], spec=None) -> None:
        self.reads = 0
        self.checked: list[int] = []
        self._mask = torch.zeros(V, dtype=torch.bool)
        self._mask[allow] = True
        super().__init__(0, spec or SamplerSpec(), None, self._check)

    def _check(self, t: int) -> bool:
        self.checked.append(t)
        return bool(self._mask[t])

    @property
    def allowed(self):
        self.reads += 1
        return self._mask

    @allowed.setter
    def allowed(self, value):  # the dataclass __init__ assigns None
        pass


@pytest.mark.parametrize("use_c", [False, True])
def test_greedy_check_before_the_mask(use_c):
    """A greedy slot with ``check``: its unmasked argmax, checked, is taken
    without reading the mask; a forbidden one falls back to the masked
    argmax. Ties take the lowest id either way; filtered draws (top-p here)
    never call ``check`` and read the mask."""
    from tartlet.engine.kernels.cpu_kernels import load as load_cpu_kernels

    kern = load_cpu_kernels() if use_c else None
    sampler = SlotSampler(V, kern.argmax_rows if kern is not None else None)
    logits = torch.stack([LOGITS, LOGITS, torch.tensor([1.0, 5.0, 5.0, 0, 0, 0, 0, 0]), LOGITS])
    slots = [_LazyMaskSlot([2, 3]), _LazyMaskSlot([0, 1]), _LazyMaskSlot([2, 1]),
             _LazyMaskSlot([0, 4], SamplerSpec(temperature=1.0, top_p=0.9, seed=3))]
    out = sampler.run(logits, slots)
    assert out[0] == 2 and slots[0].reads == 0 and slots[0].checked == [2]  # the best token is allowed
    assert out[1] == 0 and slots[1].reads == 1 and slots[1].checked == [2]  # forbidden: masked argmax
    assert out[2] == 1 and slots[2].reads == 0 and slots[2].checked == [1]  # tie of 1 and 2: lowest id
    assert out[3] in (0, 4) and slots[3].reads == 1 and slots[3].checked == []


@pytest.mark.parametrize("seeded", [True, False])
def test_plain_draw_checked_first_follows_the_masked_distribution(seeded):
    """A temperature draw with a check: an allowed draw from the unmasked
    softmax is kept, a forbidden one is drawn again from the masked logits
    (seeded: with the same noise). The result follows the masked softmax
    exactly; here the allowed tokens hold 0.41 of the mass, so about 59% of
    the draws read the mask."""
    allow = [0, 3, 4, 7]  # probabilities 0.1, 0.06, 0.15, 0.05
    p = torch.zeros(V)
    p[allow] = PROBS[allow] / PROBS[allow].sum()
    slots = [_LazyMaskSlot(allow, SamplerSpec(temperature=1.0, seed=i if seeded else None)) for i in range(N)]
    out = SlotSampler(V).run(LOGITS.expand(N, V), slots)
    assert all(t in allow for t in out)
    assert_follows(out, p)
    reads = sum(s.reads for s in slots) / N
    assert all(len(s.checked) == 1 for s in slots) and 0.5 < reads < 0.68, reads
