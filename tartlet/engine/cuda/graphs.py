"""CUDA graphs of decode steps.

A decode step of a large model on a GPU launches a few hundred small
kernels; launched one by one from Python they take longer than the GPU
needs to run them (at batch 1 the step is bound by weight bytes, a few
milliseconds for an 8B model, less than the launches alone). A CUDA graph
records the step's kernels once and replays them with one launch (the
PyTorch API: ``torch.cuda.CUDAGraph``, "CUDA Graphs" in the CUDA C++
Programming Guide), as vLLM and SGLang do for decode.

A graph replays fixed shapes and addresses, so each one is captured for a
bucket: a batch of ``B`` single-token requests attending over at most
``L`` slots runs in the graph of the smallest ``(B', L')`` bucket that
holds it (``B'`` from :data:`BATCH_BUCKETS`, ``L'`` a power of two from
:data:`MIN_COLS`). Its static inputs are filled before each replay; the
rows past ``B`` write their K and V into a scratch page of the pool that no
sequence owns and attend to nothing; columns past each request's length are
never read (the Triton kernel of :mod:`tartlet.engine.cuda.attention`
loops to each request's own length). Graphs are captured on first use of a
bucket and share one memory pool. Positions and hidden tokens are inputs
like the others. Anything else (prefill, mixed batches, pools of another
dtype than the model's, sliding windows, MoE layers, dynamic RoPE) runs op
by op.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..core.batch import AttentionGroup, BatchInputs

if TYPE_CHECKING:
    from ..models.llama import LlamaModel

log = logging.getLogger(__name__)

#: batch sizes a decode graph is captured for (a batch runs in the smallest that holds it)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
#: the narrowest slot list a graph is captured for (then powers of two)
MIN_COLS = 256


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: BatchInputs  # static inputs, filled before each replay
    logits: torch.Tensor  # static output, float32 [B', vocab]


def unsupported(model: "LlamaModel") -> str | None:
    """Why ``model``'s decode steps cannot be captured, or ``None`` when
    they can (CUDA, the Triton decode kernel, no step that reads tensors
    on the host: sliding windows narrow masks with host-side sizes, MoE
    routes on the host, dynamic RoPE picks its base on the host)."""
    if model.device.type != "cuda":
        return "not on CUDA"
    if not model.cuda_decode:
        return "no Triton decode kernel (Triton missing, or attention soft-capping)"
    if any(w is not None for w in model.windows):
        return "sliding-window layers"
    if any("moe" in layer for layer in model.layers):
        return "MoE layers"
    if any(rot.kind == "dynamic" for rot in model.layer_rope):
        return "dynamic RoPE scaling"
    return None


class DecodeGraphs:
    """Captures and replays the decode steps of one model on one page pool.

    Args:
        model: a model for which :func:`unsupported` is ``None``.
        k_cache, v_cache: the pool's tensors (``PagePool.k``/``v``).
        scratch_slot: first pool row of a page no sequence owns
            (``PagePool.reserve_scratch``): padding rows write there.
        max_batch: largest batch replayed (larger ones run op by op).

    Raises:
        ValueError: the model cannot be captured (see :func:`unsupported`).
    """

    def __init__(self, model: "LlamaModel", k_cache: torch.Tensor, v_cache: torch.Tensor, scratch_slot: int,
                 max_batch: int = 256) -> None:  # fmt: skip
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"decode steps cannot run in CUDA graphs: {why}")
        self.model = model
        self.k, self.v = k_cache, v_cache
        self.scratch_slot = scratch_slot
        self.max_batch = min(max_batch, BATCH_BUCKETS[-1])
        self.captures = 0
        self.replays = 0
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def accepts(self, batch: BatchInputs, k_cache: torch.Tensor) -> bool:
        """Whether ``batch`` is a pure decode step a graph can run: one
        attention group of single-token requests in rows ``0..B-1``, every
        row a request, on this pool with the compute dtype (what the Triton
        kernel reads), ``B <= max_batch``, no LoRA adapter, no hidden
        state and no attention probe asked for (those run op by op: a graph returns logits only)."""
        if k_cache is not self.k or k_cache.dtype != self.model.dtype or len(batch.groups) != 1 or batch.lora is not None:
            return False
        if batch.hidden is not None or batch.probe is not None:  # an attention probe: the explicit path (llama._attend)
            return False
        g = batch.groups[0]
        B = g.kv_slots.shape[0]
        return g.num_queries == 1 and g.rows is None and g.row_start == 0 and B == batch.input_ids.shape[0] and B <= self.max_batch

    def run(self, batch: BatchInputs) -> torch.Tensor:
        """Logits of ``batch`` (accepted by :meth:`accepts`), float32 ``[S,
        vocab]`` for ``batch.output_rows``, by replaying its bucket's graph
        (captured now if it is the bucket's first step)."""
        g = batch.groups[0]
        B, L = g.kv_slots.shape
        key = (next(b for b in BATCH_BUCKETS if b >= B), max(MIN_COLS, 1 << (L - 1).bit_length()))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(*key, batch)
        else:
            fill_static(graph.inputs, batch, self.scratch_slot)
        graph.graph.replay()
        self.replays += 1
        return graph.logits.index_select(0, batch.output_rows)

    def _capture(self, bsz: int, cols: int, batch: BatchInputs) -> _Graph:
        st = static_inputs(bsz, cols, self.scratch_slot, self.k.device)
        fill_static(st, batch, self.scratch_slot)
        # warm up on a side stream first (Triton compiles, cuBLAS picks its
        # kernels); it writes this step's K and V, which the replay rewrites
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # unannotated in torch
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model.forward_eager(st, self.k, self.v)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):  # other threads may use the GPU meanwhile
            logits = self.model.forward_eager(st, self.k, self.v)
        self.captures += 1
        log.info("captured the decode step for %d rows x %d slots (%d graphs)", bsz, cols, self.captures)
        return _Graph(graph, st, logits)


def static_inputs(bsz: int, cols: int, scratch_slot: int, device: torch.device) -> BatchInputs:
    """The static inputs of a decode graph for ``bsz`` requests over at most
    ``cols`` slots each: one decode group whose mask is always present
    (padding), every row an output, padded rows writing to ``scratch_slot``."""
    group = AttentionGroup(None, 0, 1, torch.zeros(bsz, cols, dtype=torch.long, device=device),
                           torch.zeros(bsz, 1, cols, dtype=torch.bool, device=device))  # fmt: skip
    return BatchInputs(
        input_ids=torch.zeros(bsz, dtype=torch.long, device=device),
        positions=torch.zeros(bsz, dtype=torch.long, device=device),
        write_slots=torch.full((bsz,), scratch_slot, dtype=torch.long, device=device),
        groups=[group],
        output_rows=torch.arange(bsz, device=device),
    )


def fill_static(st: BatchInputs, batch: BatchInputs, scratch_slot: int) -> None:
    """Copy the decode step ``batch`` (one group of ``B`` single-token
    requests over ``L`` slots, ``B`` and ``L`` within ``st``'s) into the
    static inputs ``st``: rows past ``B`` write to ``scratch_slot`` and see
    no slot, columns past each request's ``L`` are masked (their slot
    numbers are left from earlier steps: never read)."""
    g, sg = batch.groups[0], st.groups[0]
    B, L = g.kv_slots.shape
    st.input_ids[:B].copy_(batch.input_ids)
    st.positions[:B].copy_(batch.positions)
    st.write_slots[:B].copy_(batch.write_slots)
    st.write_slots[B:].fill_(scratch_slot)
    sg.kv_slots[:B, :L].copy_(g.kv_slots)
    assert sg.mask is not None  # static groups always carry one
    sg.mask.zero_()
    if g.mask is None:
        sg.mask[:B, :, :L] = True
    else:
        sg.mask[:B, :, :L].copy_(g.mask)
