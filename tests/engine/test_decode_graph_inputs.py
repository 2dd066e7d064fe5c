"""What a CUDA graph of a decode step replays, checked on the CPU (CI has no
GPU; tests/engine/test_cuda.py runs the graphs themselves on one): a decode step
copied into larger static inputs (:func:`tartlet.engine.cuda.graphs.fill_static`:
rows past the batch write to a scratch page and see nothing, columns past
each request's slots are masked, stale values left in both) gives the
logits of the step run as it is."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow  # loads an engine of its own


def test_padded_static_inputs_give_the_steps_logits(loaded_model):
    from tartlet.engine.core.batch import BatchItem, build_batch
    from tartlet.engine.core.engine import Engine, EngineConfig
    from tartlet.engine.core.requests import ForwardRequest
    from tartlet.engine.core.sampler import OutputSlot, SamplerSpec
    from tartlet.engine.cuda.graphs import fill_static, static_inputs

    lm = loaded_model
    eng = Engine(EngineConfig(kv_cache_mb=16, device="cpu"), lm.config, dict(lm.weights), lm.tokenizer)
    try:
        ps = eng.pool.page_size
        scratch = eng.pool.reserve_scratch() * ps
        sched = eng.scheduler
        prompts = [eng.tokenizer.encode(t) for t in ("The capital of France is", "Once upon a time,", "1, 2, 3,")]
        seqs = [eng.new_sequence() for _ in prompts]
        nxt = [int(sched.submit(ForwardRequest(s, p, outputs=[OutputSlot(len(p) - 1, SamplerSpec(temperature=0.0))])).result(60)[0])
               for s, p in zip(seqs, prompts)]  # fmt: skip

        def step() -> tuple[torch.Tensor, torch.Tensor]:  # on the scheduler thread, as the model always runs
            items = []
            for s, t in zip(seqs, nxt):
                n = len(s)
                items.append(BatchItem(s, [t], n, s.reserve([t], [n], custom_attention=False), [0], None))
            batch = build_batch(items)
            want = eng.model.forward_eager(batch, eng.pool.k, eng.pool.v)
            st = static_inputs(8, 64, scratch, torch.device("cpu"))
            st.input_ids.fill_(11)  # stale values of an earlier, longer step
            st.positions.fill_(40)
            st.groups[0].kv_slots.fill_(5)
            fill_static(st, batch, scratch)
            assert st.write_slots[3:].eq(scratch).all() and not st.groups[0].mask[3:].any()
            got = eng.model.forward_eager(st, eng.pool.k, eng.pool.v).index_select(0, batch.output_rows)
            return want, got

        want, got = sched.command(step).result(60)
        assert want.shape == got.shape == (3, lm.config.vocab_size)
        assert float((want - got).abs().max()) <= 1e-4 * float(want.abs().max())
        assert want.argmax(-1).tolist() == got.argmax(-1).tolist()
        for s in seqs:
            sched.command(s.free, s).result(60)
        assert eng.pool.stats().used == 0
    finally:
        eng.close()
