"""The engine: one model, its tokenizer, its page pool and its scheduler.

:class:`Engine` is what the host layer talks to. It is built from an
:class:`EngineConfig` (usually the ``[engine]`` table of the TOML config):
the model is resolved (a known name is downloaded on first use, see
:mod:`tartlet.engine.loading.model_store`), loaded (quantized GGUF weights stay
quantized on the CPU), the page pool is
sized from a memory budget, and the scheduler thread is started.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, cast

import torch

from ...sdk.errors import AdapterError
from ..cuda.graphs import DecodeGraphs, unsupported
from ..cuda.quant_matmul import CudaQuantLinear
from ..loading import huge_pages
from ..loading.quant_formats import QuantWeight
from ..models.config import ModelConfig
from ..models.linear import Linear
from ..models.llama import LlamaModel
from ..models.lora import LoraAdapter, ModuleLora, build_adapter
from ..models.quant_linear import QuantLinear
from ..text.tokenizer import Tokenizer
from .kv_cache import PagePool
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: KV pool element types: the float dtypes, and int8 rows with a scale each (:mod:`tartlet.engine.core.kv_quant`)
_KV_DTYPES = {**_DTYPES, "int8": torch.int8}

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    """Engine settings.

    Attributes:
        model: a known model name (``tartlet model list``), a ``.gguf`` file
            or a Hugging Face folder.
        dtype: ``auto`` (default): on CUDA, bfloat16 with every weight
            dequantized to it unless ``quantize`` is set; on the CPU, compute
            in float32 and keep the matrices of a quantized GGUF file in their
            blocks, multiplied by the quantized CPU kernels
            (:mod:`tartlet.engine.models.quant_linear`; without a C compiler
            they are dequantized). ``float32``,
            ``bfloat16`` or ``float16``: the reference path, every weight
            dequantized to that dtype.
        quantize: quantize float matrices at load (``q8_0``, ``q4_0``,
            ``q4_1``, ``q5_0``, ``q5_1``; see
            :data:`tartlet.engine.loading.quant_formats.QUANTIZE_TYPES`): Hugging
            Face folders and float tensors of GGUF files; ``None`` keeps them
            float. On CUDA it also keeps a GGUF file's quantized matrices in
            their blocks on the GPU, multiplied by Triton kernels
            (:mod:`tartlet.engine.cuda.quant_matmul`): a third of bfloat16's
            memory at 4 bits and faster decode at one sequence, slower than
            bfloat16 from a few sequences on (docs/benchmarks.md, "bench_gpu.py:
            the engine on a CUDA GPU").
        device: ``cpu``, ``cuda`` or ``auto`` (CUDA when available).
        page_size: tokens per KV page.
        kv_cache_mb: memory budget of the page pool, in MiB.
        max_batch_tokens: token budget of one model call.
        batch_wait_ms: how long a round waits for last round's requests, ms.
        threads: torch intra-op threads (``None``: torch's default).
        cpu_kernels: use the fused C kernels on CPU in float32 (compiled on
            first use; see :mod:`tartlet.engine.kernels.cpu_kernels`).
        gemv_copy: on CPU in float32, keep a second, transposed copy of the
            layer weights for batch-1 decode steps (~1.2x faster there; costs
            the layer weights' size again in memory, ~430 MB for the default
            model). See :mod:`tartlet.engine.models.linear`.
        act_bits: with quantized weights, activations are quantized per
            block of 32 to 16-bit (default) or 8-bit integers (llama.cpp's
            choice: faster, but on SmolLM2-135M it flips greedy answers), or
            ``auto``: 16 bits into the projections fed by an RMSNorm (QKV,
            gate/up, head), 8 bits into the output and down projections
            (keeps that answer; logits move ~1.0 vs 0.01); see
            :mod:`tartlet.engine.models.llama`. All three keep the NLL
            within 0.5% of float32 on SmolLM2 and Gemma-3-270M
            (``benchmarks/bench_accuracy.py``, docs/benchmarks.md).
        matmul_dtype: with quantized weights, the precision of the float
            GEMM that calls of 8+ rows (prompts, decode batches) take on
            AVX-512: ``float32`` (default), or ``bfloat16`` (products ~1.8x
            faster than float32 at 64 rows; needs AVX512_BF16; batching may
            then change greedy outputs at near-ties). ``bfloat16`` keeps
            Q4/Q8 weights in the row layout for that GEMM; by default they
            are interleaved and take an integer kernel at every row count,
            faster still (64-row step of the default model 80 vs 86 ms on a
            Zen 4 VM), so the option serves the other formats (Q5, Q6). See
            :class:`~tartlet.engine.models.llama.LlamaModel`.
        kv_dtype: element type of the KV page pool: ``auto`` (float16 for
            quantized weights, as llama.cpp stores them by default; else the
            compute dtype: float32 for float weights on the CPU, the
            reference path), ``float32``, ``bfloat16``, ``float16`` or
            ``int8``. A 16-bit pool holds twice the tokens of float32 in the
            same ``kv_cache_mb``; keys and values are rounded when written
            (to nearest even). A float16 pool is read and written by the C
            kernels and the fused decode step, with half the attention's
            memory traffic of float32 (at 64 concurrent requests ~1.1x the
            default model's throughput; its logits move by at most 0.044
            against 0.009-0.013 with float32 pages, greedy tokens on 256
            teacher-forced positions unchanged), a bfloat16 one by PyTorch.
            An ``int8`` pool stores each (token, KV head) row as int8
            quants plus a float32 scale (llama.cpp's Q8_0 scheme per row,
            :mod:`tartlet.engine.core.kv_quant`): ``head_dim + 4`` bytes instead
            of ``4 * head_dim``, 3.8x the tokens of float32 at ``head_dim``
            64; the C kernels quantize on write and dequantize inside decode
            attention, prefill dequantizes the gathered rows.
        huge_pages: on CPU under Linux, back the weights with 2 MiB
            transparent huge pages (:mod:`tartlet.engine.loading.huge_pages`: fewer
            TLB misses and prefetcher restarts while a decode step streams
            them); best effort, ``False`` keeps 4 KiB pages.
        cuda_graphs: on CUDA, replay decode steps as CUDA graphs (one per
            batch-size and length bucket, captured on first use; see
            :mod:`tartlet.engine.cuda.graphs`); ``False``: launch each op.
            Costs one page of the pool (the padded rows' scratch page).
        overlap: overlap scheduling (:mod:`tartlet.engine.core.lookahead`):
            greedy token chains' next decode step is built and queued while
            the current one runs; ``None``: on with CUDA (on a CPU the host
            computes the step itself, nothing overlaps).
        adapters: LoRA adapters to load at start, name -> path (a PEFT
            folder or a GGUF adapter file; :mod:`tartlet.engine.loading.adapter_loader`).
    """

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    quantize: str | None = None
    device: str = "auto"
    page_size: int = 16
    kv_cache_mb: int = 1024
    max_batch_tokens: int = 512
    batch_wait_ms: float = 3.0
    threads: int | None = None
    cpu_kernels: bool = True
    gemv_copy: bool = True
    act_bits: int | str = 16
    matmul_dtype: str = "float32"
    kv_dtype: str = "auto"
    huge_pages: bool = True
    cuda_graphs: bool = True
    overlap: bool | None = None
    adapters: dict[str, str] = field(default_factory=dict)

    def torch_dtype(self) -> torch.dtype:
        """The compute dtype (``auto``: float32 on the CPU, bfloat16 on CUDA)."""
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        try:
            return _DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {self.dtype!r} (choose from auto, {', '.join(_DTYPES)})") from None

    def keeps_quantized(self) -> bool:
        """Whether quantized weights stay in their blocks: on the CPU when
        ``dtype`` is ``auto`` or ``quantize`` is set and the quantized C
        kernels can be built; on CUDA when ``quantize`` is set and Triton is
        there (:mod:`tartlet.engine.cuda.quant_matmul`: slower than bfloat16
        beyond a few rows, so not by default); else they are dequantized."""
        if self.torch_device().type == "cuda":
            from ..cuda.quant_matmul import available

            return self.quantize is not None and available()
        if self.dtype != "auto" and self.quantize is None:
            return False
        if self.torch_device().type != "cpu":
            return False
        from ..kernels.quant_kernels import load

        return load() is not None

    def torch_kv_dtype(self, quantized: bool = False) -> torch.dtype:
        """The KV pool's element type for a model whose weights stay
        quantized (``quantized``: the quantized CPU kernels run it) or not.
        ``auto``: float16 for quantized weights (what llama.cpp stores), else
        the compute dtype (float32 for float weights on the CPU, the
        reference path; bfloat16 on CUDA).

        Raises:
            ValueError: ``kv_dtype`` is not one of auto, float32, bfloat16,
                float16, int8.
        """
        if self.kv_dtype == "auto":
            return torch.float16 if quantized else self.torch_dtype()
        try:
            return _KV_DTYPES[self.kv_dtype]
        except KeyError:
            raise ValueError(f"unknown kv_dtype {self.kv_dtype!r} (choose from auto, {', '.join(_KV_DTYPES)})") from None

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


class Engine:
    """A loaded model ready to serve forward passes.

    Attributes:
        name: model name as given in the config.
        config: the model's architecture.
        tokenizer: its tokenizer and chat template.
        pool: the page pool.
        scheduler: the running scheduler.
    """

    def __init__(self, cfg: EngineConfig, model_config: ModelConfig, weights: dict[str, torch.Tensor | QuantWeight], tokenizer: Tokenizer) -> None:
        if cfg.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {cfg.page_size}")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.name = cfg.model
        self.config = model_config
        self.tokenizer = tokenizer
        dtype, device = cfg.torch_dtype(), cfg.torch_device()
        self.model = LlamaModel(
            model_config, weights, dtype=dtype, device=device, cpu_kernels=cfg.cpu_kernels, gemv_copy=cfg.gemv_copy,
            act_bits=cfg.act_bits, matmul_dtype=cfg.matmul_dtype,
        )
        #: seconds :meth:`load` took from the model file to a running engine (None when built directly)
        self.load_seconds: float | None = None
        #: the thread moving the weights onto huge pages (``huge_pages``), or None
        self.huge_pages_thread = (huge_pages.Mover(self.model.weight_tensors())
                                  if cfg.huge_pages and device.type == "cpu" else None)
        c = model_config
        kv_dtype = cfg.torch_kv_dtype(quantized=self.model.matmul_dtype is not None)
        per_page = PagePool.bytes_per_page(cfg.page_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, kv_dtype)
        num_pages = max(1, int(cfg.kv_cache_mb * 2**20) // per_page)
        self.pool = PagePool(num_pages, cfg.page_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, kv_dtype, device)
        graphs = None  # CUDA graphs of decode steps, for the model runner
        if cfg.cuda_graphs and unsupported(self.model) is None and self.pool.num_pages > 1:
            scratch = self.pool.reserve_scratch()
            graphs = DecodeGraphs(self.model, self.pool.k, self.pool.v, scratch * cfg.page_size)
        log.info("%s", self.kv_summary())
        #: LoRA adapters by name (:meth:`load_adapter`)
        self.adapters: dict[str, LoraAdapter] = {}
        self._adapters_lock = threading.Lock()
        for adapter_name, adapter_path in cfg.adapters.items():
            self.load_adapter(adapter_path, adapter_name)
        self.scheduler = Scheduler(
            self.model, self.pool, max_batch_tokens=cfg.max_batch_tokens, batch_wait_s=cfg.batch_wait_ms / 1000, graphs=graphs,
            overlap=cfg.overlap if cfg.overlap is not None else device.type == "cuda",
        )
        self.scheduler.start()

    @classmethod
    def load(cls, cfg: EngineConfig, progress: Callable[[str], None] | None = None) -> "Engine":
        """Resolve, load and start the model named by ``cfg.model``.

        Raises:
            tartlet.engine.loading.loader.ModelLoadError: unknown name, missing or
                invalid model file.
        """
        from ..loading.loader import load_model
        from ..loading.model_store import resolve

        cfg.torch_kv_dtype()  # a bad kv_dtype fails before any download or load
        path: Path = resolve(cfg.model, progress=progress)
        if progress:
            progress(f"loading {path.name}")
        quantized = cfg.keeps_quantized()
        if cfg.quantize is not None and not quantized:
            raise ValueError(f"quantize = {cfg.quantize!r} needs quantized kernels: the C ones on the CPU (a C compiler), Triton on CUDA")
        t0 = time.perf_counter()
        # converted weights allocated on huge pages from the start (huge_pages.empty): little left to collapse
        with huge_pages.for_new_weights(cfg.huge_pages and cfg.torch_device().type == "cpu"):
            loaded = load_model(path, dtype=cfg.torch_dtype(), quantized=quantized, quantize=cfg.quantize)
            engine = cls(cfg, loaded.config, loaded.weights, loaded.tokenizer)
        engine.load_seconds = time.perf_counter() - t0
        return engine

    def kv_summary(self) -> str:
        """The page pool's capacity in words, e.g. for the default model in
        64 MiB: ``KV pool int8: 342 pages of 16 tokens (5472 tokens) in 63.9
        MiB, 12240 bytes per token (408 per token per layer)`` (K plus V;
        float32: 91 pages, 1536 bytes per token per layer)."""
        p, c = self.pool, self.config
        dtype = str(p.k.dtype).replace("torch.", "")
        per_layer = 2 * p.k.shape[2] * p.k.shape[3] * p.k.element_size()
        return (f"KV pool {dtype}: {p.num_pages} pages of {p.page_size} tokens ({p.num_pages * p.page_size} tokens) "
                f"in {p.nbytes() / 2**20:.1f} MiB, {per_layer * c.num_hidden_layers} bytes per token "
                f"({per_layer} per token per layer)")

    def load_adapter(self, path: str | Path, name: str | None = None) -> LoraAdapter:
        """Load the LoRA adapter at ``path`` (a PEFT folder or a GGUF adapter
        file) and serve it as ``name`` (default: the file or folder name).
        Its matrices are float32 on the CPU (the compute dtype on CUDA); the
        base weights are untouched (they stay quantized). Loading the same
        content under its name again returns the adapter already loaded.

        Raises:
            AdapterError: see :func:`~tartlet.engine.loading.adapter_loader.load_adapter`;
                also when ``name`` already serves an adapter of other content.
        """
        adapter = self.read_adapter(path, name)
        with self._adapters_lock:
            old = self.adapters.get(adapter.name)
            if old is not None:
                if old.key != adapter.key:
                    raise AdapterError(f"{adapter.source}: adapter name {adapter.name!r} already serves {old.source}")
                return old
            self.adapters[adapter.name] = adapter
        log.info("LoRA adapter %r: %d modules, rank %d, %.1f MiB (%s)", adapter.name, adapter.modules, adapter.rank,
                 adapter.nbytes / 2**20, adapter.source)
        return adapter

    def read_adapter(self, path: str | Path, name: str | None = None) -> LoraAdapter:
        """The LoRA adapter at ``path``, checked against this model, as
        :meth:`load_adapter` loads it, but not served under a name (the
        host keeps its users' adapters itself, :mod:`tartlet.host.adapter_manager`).

        Raises:
            AdapterError: as :meth:`load_adapter`.
        """
        from ..loading.adapter_loader import load_adapter

        m = self.model
        dtype = torch.float32 if m.device.type == "cpu" else m.dtype
        return self._fits(load_adapter(path, self.config, name, dtype=dtype, device=m.device))

    def build_adapter(self, name: str, source: Path, parts: dict[tuple[int, str], ModuleLora]) -> LoraAdapter:
        """A new adapter of this model from per-module matrices (an edited
        copy of another's :attr:`~tartlet.engine.models.lora.LoraAdapter.parts`,
        :mod:`tartlet.engine.models.lora_edit`), fused and placed as
        :meth:`load_adapter` places a loaded one; not served under a name.

        Raises:
            AdapterError: modules or shapes that do not fit the model
                (:func:`~tartlet.engine.models.lora.build_adapter`).
        """
        m = self.model
        dtype = torch.float32 if m.device.type == "cpu" else m.dtype
        return self._fits(build_adapter(name, source, self.config, parts, dtype=dtype, device=m.device))

    def _fits(self, adapter: LoraAdapter) -> LoraAdapter:
        """``adapter``, after checking its fused matrices against the loaded
        model's projections (the loader checked the config's shapes).

        Raises:
            AdapterError: a projection it changes does not fit.
        """
        m = self.model
        for i, layer in enumerate(adapter.layers):
            for proj, pair in layer.items():
                lin = cast("dict[str, object]", m.layers[i]).get(proj)
                if not isinstance(lin, (Linear, QuantLinear, CudaQuantLinear)) or (pair.at.shape[0], pair.bt.shape[1]) != (
                        lin.in_features, lin.out_features):
                    raise AdapterError(f"{adapter.source}: layer {i} {proj} does not fit the loaded model's projection")
        return adapter

    def adapter(self, name: str) -> LoraAdapter:
        """The adapter served as ``name``.

        Raises:
            AdapterError: no adapter of that name (the message lists those served).
        """
        a = self.adapters.get(name)
        if a is None:
            served = ", ".join(sorted(self.adapters)) or "none"
            raise AdapterError(f"model {self.name!r} serves no adapter named {name!r} (adapters: {served})")
        return a

    @property
    def runner(self) -> ModelRunner:
        """What runs each batch (:mod:`.model_runner`): its ``fused`` C step
        and CUDA ``graphs`` (None when off), and ``forward(batch)``."""
        return self.scheduler.runner

    def new_sequence(self) -> Sequence:
        """An empty sequence on this engine's pool."""
        return Sequence(self.pool)

    def close(self) -> None:
        """Stop the scheduler; pending requests fail."""
        self.scheduler.stop()
