"""Sliding-window KV (issue 14 item 2): pages before every layer's window are released.

A random-weight Mistral model with every layer sliding (window ``W = 8``
tokens, two pages of ``PS = 4``) decodes far past its window through a whole
:class:`Engine`. Its logits must equal transformers' (whose sliding attention
sees key ``j`` from query ``i`` when ``i - W < j <= i``), while the sequence
holds exactly the pages that still reach the window: after reserving token
``n`` (``n`` tokens already cached) the pages ``[(n - W + 1) // PS,
ceil((n + 1) / PS))``. Forks, the prefix cache, snapshots read back,
truncation into released pages and page quotas stay correct. A Gemma 3-like
model (sliding and global layers) releases nothing, but its sliding layers
attend over ``W`` keys per decode query, not the whole sequence.
"""

from __future__ import annotations

import pytest
import torch

from tartlet.engine.core.kv_accounting import KvQuotaError, PageAccount
from tartlet.engine.loading.loader import load_model
from test_model_families import DIMS, check, reference

transformers = pytest.importorskip("transformers")

W, PS = 8, 4


def make_model(cls: str, extra: dict, tokenizer, path):
    """A random-weight transformers model saved as a HF folder at ``path``."""
    config = getattr(transformers, cls)(vocab_size=tokenizer.vocab_size, **{**DIMS, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    return model


@pytest.fixture(scope="module")
def mistral(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral")
    return path, make_model("MistralConfig", dict(sliding_window=W), tokenizer, path)


@pytest.fixture(scope="module")
def gemma(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    extra = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=W,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    return path, make_model("Gemma3TextConfig", extra, tokenizer, path)


class Runner:
    """An Engine over a saved model, with helpers that run on its scheduler."""

    def __init__(self, path, kernels: bool = True, max_batch_tokens: int = 512, kv_cache_mb: float = 1) -> None:
        from tartlet.engine.core.engine import Engine, EngineConfig

        cfg = EngineConfig(model=str(path), dtype="float32", kv_cache_mb=kv_cache_mb, page_size=PS, cpu_kernels=kernels,
                           max_batch_tokens=max_batch_tokens)
        loaded = load_model(path, dtype=torch.float32)
        self.eng = Engine(cfg, loaded.config, loaded.weights, loaded.tokenizer)
        self.sch, self.pool = self.eng.scheduler, self.eng.pool

    def forward(self, seq, tokens: list[int], first_out: int = 0) -> torch.Tensor:
        """Logits ``[len(tokens) - first_out, vocab]`` of appending ``tokens`` to ``seq``."""
        from tartlet.engine.core.requests import ForwardRequest
        from tartlet.engine.core.sampler import OutputSlot, ProbeSpec

        outs = [OutputSlot(i, ProbeSpec("logits")) for i in range(first_out, len(tokens))]
        return torch.tensor(list(self.sch.submit(ForwardRequest(seq, tokens, outputs=outs)).result(timeout=120)))

    def do(self, fn, *seqs):
        return self.sch.command(fn, *seqs).result(timeout=60)

    def close(self) -> None:
        self.eng.close()


def expected_live(n: int) -> int:
    """Pages a sequence of ``n`` tokens holds once its last token was reserved (``n - 1`` cached before)."""
    return -(-n // PS) - max(0, n - 1 - W + 1) // PS


def ids_for(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kernels", [True, False], ids=["c-kernels", "pytorch"])
def test_all_sliding_decode_far_past_the_window(mistral, kernels):
    """Logits equal transformers' over 12 prompt + 40 decode steps while the held pages stay bounded."""
    path, ref = mistral
    ids = ids_for(52, 1, ref.config.vocab_size)
    r = Runner(path, kernels)
    try:
        assert r.pool.window == W
        start = r.pool.stats()
        assert start.free == start.total
        seq = r.eng.new_sequence()
        got = [r.forward(seq, ids[:12])]
        assert seq.live_pages() == 3  # nothing before the window of token 11 yet
        for n in range(12, 52):
            got.append(r.forward(seq, [ids[n]]))
            assert seq.live_pages() == expected_live(n + 1) <= 3, n
            assert seq.pages[: seq.window_dropped] == [None] * seq.window_dropped
            assert seq.window_dropped == max(0, n - W + 1) // PS
            st = r.pool.stats()
            assert st.used == seq.live_pages()  # released prompt pages are cached (committed), decode pages too
        check(torch.cat(got), reference(ref, ids), "all-sliding decode past the window")
        assert len(seq) == 52 and seq.pages.count(None) == 11  # tokens 0..43 released, 44..51 held
        r.do(seq.free, seq)
        st = r.pool.stats()
        assert st.used == 0 and st.free + st.cached == st.total
        r.do(r.pool.evict_all_cached)
        assert r.pool.stats().free == start.free
    finally:
        r.close()


def test_chunked_prefill_releases_between_chunks(mistral):
    """A 30-token prompt in chunks of 8 releases pages between chunks and still gives transformers' logits."""
    path, ref = mistral
    ids = ids_for(34, 2, ref.config.vocab_size)
    r = Runner(path, max_batch_tokens=8)
    try:
        seq = r.eng.new_sequence()
        got = [r.forward(seq, ids[:30])]
        # the last chunk was reserved with 24 tokens cached: pages before (24 - 7) // 4 = 4 released
        assert seq.window_dropped == 4 and seq.live_pages() == 8 - 4
        for n in range(30, 34):
            got.append(r.forward(seq, [ids[n]]))
        check(torch.cat(got), reference(ref, ids), "chunked prefill")
        assert seq.live_pages() == expected_live(34)
    finally:
        r.close()


def test_context_longer_than_the_pool(mistral):
    """A 6-page pool (24 tokens) serves a 40-token prompt in chunks of 8 and 8 decode steps: at most
    ceil((W - 1 + 8) / PS) + 1 = 5 pages are live at once."""
    path, ref = mistral
    ids = ids_for(48, 11, ref.config.vocab_size)
    r = Runner(path, max_batch_tokens=8, kv_cache_mb=6 * 3072 / 2**20)  # 3072 bytes per page of this model
    try:
        assert r.pool.num_pages == 6
        seq = r.eng.new_sequence()
        got = [r.forward(seq, ids[:40])]
        got += [r.forward(seq, [t]) for t in ids[40:]]
        check(torch.cat(got), reference(ref, ids), "context longer than the pool")
        assert seq.live_pages() == expected_live(48)
    finally:
        r.close()


def test_forks_before_and_after_release(mistral):
    """A fork taken before the parent releases pages keeps them; a fork taken after shares the released state."""
    path, ref = mistral
    V = ref.config.vocab_size
    a_ids, b_ids, c_ids = ids_for(40, 3, V), ids_for(40, 4, V), ids_for(48, 5, V)
    b_ids[:12] = a_ids[:12]
    c_ids[:30] = a_ids[:30]
    r = Runner(path)
    try:
        a = r.eng.new_sequence()
        got_a = [r.forward(a, a_ids[:12])]
        b = r.do(a.fork, a)  # before any release: shares pages 0..2
        shared = list(a.pages)
        got_a += [r.forward(a, [t]) for t in a_ids[12:30]]
        # a released pages 0..4; b still holds 0..2, so those stay referenced once (by b)
        assert a.window_dropped == (29 - W + 1) // PS == 5
        assert [r.pool.refcount(p) for p in shared] == [1, 1, 1] and b.pages == shared
        c = r.do(a.fork, a)  # after the release: the same None entries, live pages shared
        assert c.pages[:5] == [None] * 5 and c.window_dropped == 5 and c.live_pages() == a.live_pages()
        assert all(r.pool.refcount(p) == 2 for p in a.pages[5:-1])  # full pages shared; the tail was copied
        got_a += [r.forward(a, [t]) for t in a_ids[30:]]
        got_b = [r.forward(b, [t]) for t in b_ids[12:]]
        got_c = [r.forward(c, [t]) for t in c_ids[30:]]
        check(torch.cat(got_a), reference(ref, a_ids), "parent")
        check(torch.cat(got_b), reference(ref, b_ids)[12:], "fork before the release")
        check(torch.cat(got_c), reference(ref, c_ids)[30:], "fork after the release")
        for s, n in ((a, 40), (b, 40), (c, 48)):
            assert s.live_pages() == expected_live(n)
        for s in (a, b, c):
            r.do(s.free, s)
        st = r.pool.stats()
        assert st.used == 0 and st.free + st.cached == st.total
    finally:
        r.close()


def test_prefix_cache_hit_on_released_pages(mistral):
    """Released committed pages stay matchable while cached; once evicted, a match stops at the first missing page."""
    path, ref = mistral
    ids = ids_for(44, 6, ref.config.vocab_size)
    prompt = ids[:24]
    r = Runner(path)
    try:
        a = r.eng.new_sequence()
        r.forward(a, prompt)
        for t in ids[24:40]:
            r.forward(a, [t])
        assert a.window_dropped == (39 - W + 1) // PS == 8  # the whole prompt's pages are released, all cached
        reused0 = r.sch.stats.prefix_tokens_reused
        b = r.eng.new_sequence()
        got = [r.forward(b, prompt, first_out=23)]
        assert r.sch.stats.prefix_tokens_reused - reused0 == 20  # 5 whole pages before the output position
        # b attached pages a released, then released those before its own window when it reserved token 20
        assert b.window_dropped == (20 - W + 1) // PS == 3 and b.live_pages() == 3
        got += [r.forward(b, [t]) for t in ids[24:32]]
        want = reference(ref, prompt + ids[24:32])
        check(torch.cat(got), want[23:], "prefix-cache hit on released pages")
        # evict what nobody holds: a prompt match must then start over, not skip the missing pages
        r.do(r.pool.evict_all_cached)
        reused0 = r.sch.stats.prefix_tokens_reused
        c = r.eng.new_sequence()
        got = r.forward(c, prompt, first_out=23)
        assert r.sch.stats.prefix_tokens_reused - reused0 == 0
        check(got, want[23:24], "prompt recomputed after eviction")
        for s in (a, b, c):
            r.do(s.free, s)
        assert r.pool.stats().used == 0
    finally:
        r.close()


def test_snapshot_of_released_sequence_reads_back(mistral):
    """A snapshot file of a sequence with released pages holds only its live pages and decodes on after install."""
    from tartlet.engine.core.sequence import Sequence
    from tartlet.host.snapshot_manager import _install
    from tartlet.host.snapshot_store import SnapshotFile

    path, ref = mistral
    ids = ids_for(40, 7, ref.config.vocab_size)
    r = Runner(path)
    try:
        a = r.eng.new_sequence()
        r.forward(a, ids[:12])
        for t in ids[12:32]:
            r.forward(a, [t])
        live = [p for p in a.pages if p is not None]
        rows = (torch.tensor(live)[:, None] * PS + torch.arange(PS)).reshape(-1)
        data = SnapshotFile("u", "s", list(a.tokens), list(a.positions), bytes(a.masked),
                            [int(p is not None) for p in a.pages], a.pure, r.pool.k[:, rows].clone(), r.pool.v[:, rows].clone())
        r.do(a.free, a)
        r.do(r.pool.evict_all_cached)
        b = Sequence(r.pool)
        r.do(lambda: _install(b, data), b)
        assert b.live_pages() == len(live) == 2 and b.pages[:6] == [None] * 6  # tokens 0..23 were released
        assert len(b.keys) == 32 // PS  # released pages keyed (not committed), so later pages register
        got = torch.cat([r.forward(b, [t]) for t in ids[32:]])
        check(got, reference(ref, ids)[32:], "decode after reading a released snapshot back")
        assert b.window_dropped == (39 - W + 1) // PS and b.live_pages() == expected_live(40)
        r.do(b.free, b)
        assert r.pool.stats().used == 0
    finally:
        r.close()


def test_truncate_into_released_pages_hides_them(mistral):
    """Cutting back past the release point masks the released tokens the next window would reach: the
    next token's logits equal those of a sequence that kept every page and masked the same tokens."""
    path, ref = mistral
    ids = ids_for(41, 8, ref.config.vocab_size)
    r = Runner(path)
    try:
        a = r.eng.new_sequence()
        r.forward(a, ids[:12])
        for t in ids[12:40]:
            r.forward(a, [t])
        assert a.window_dropped == 8  # tokens 0..31 released
        r.do(lambda: a.truncate(34), a)
        # the window of token 34 is 27..34: 27..31 are gone, so they are hidden
        assert list(a.masked) == [0] * 27 + [1] * 5 + [0] * 2 and not a.pure
        got = r.forward(a, [ids[40]])
        # the same state reached without releasing: the 34 tokens computed in full, then 27..31 masked
        b = r.eng.new_sequence()
        r.forward(b, ids[:34])
        r.do(lambda: b.mask_range(27, 32, True), b)
        want = r.forward(b, [ids[40]])
        check(got, want, "decode after truncating into released pages")
        for s in (a, b):
            r.do(s.free, s)
    finally:
        r.close()


def test_quota_counts_released_pages(mistral):
    """An instance account of 3 pages suffices for any length: released pages leave the account."""
    path, ref = mistral
    ids = ids_for(60, 9, ref.config.vocab_size)
    r = Runner(path)
    try:
        from tartlet.engine.core.sequence import Sequence

        user = PageAccount("user 'u'", limit=None)
        acc = PageAccount("instance 'i'", limit=3, parent=user)
        seq = Sequence(r.pool, acc)
        r.forward(seq, ids[:12])
        for n in range(12, 60):
            r.forward(seq, [ids[n]])
            assert acc.pages == user.pages == seq.live_pages() == expected_live(n + 1)
        r.do(seq.free, seq)
        assert acc.pages == user.pages == 0
        # without the window the same account fails at the 13th token
        r.pool.window = None
        seq = Sequence(r.pool, acc)
        with pytest.raises(KvQuotaError):
            r.forward(seq, ids[:13])
    finally:
        r.close()


def test_mixed_layers_release_nothing_and_sliding_layers_read_the_window(gemma):
    """Gemma 3-like (sliding, global, sliding): every page stays, and the sliding layers' decode attention
    reads exactly W keys (prefill: the whole causal block) while the global layer reads all."""
    path, ref = gemma
    ids = ids_for(40, 10, ref.config.vocab_size)
    r = Runner(path)
    try:
        assert r.pool.window is None
        model = r.eng.model
        widths: list[tuple[int, int, bool]] = []
        inner = model.attention.window_group

        def spy(g, window):
            out = inner(g, window)
            widths.append((g.num_queries, out.kv_slots.shape[1], out.mask is None))
            return out

        model.attention.window_group = spy
        seq = r.eng.new_sequence()
        got = [r.forward(seq, ids[:12])]
        assert widths == [(12, 12, False)]
        widths.clear()
        for n in range(12, 40):
            got.append(r.forward(seq, [ids[n]]))
            assert widths[-1] == (1, W, True), n  # n + 1 keys in the sequence, W of them in the window
        check(torch.cat(got), reference(ref, ids), "mixed sliding/global layers")
        assert seq.window_dropped == 0 and seq.live_pages() == 10 and None not in seq.pages
        r.do(seq.free, seq)
        assert r.pool.stats().used == 0
    finally:
        r.close()
