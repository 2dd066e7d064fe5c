"""The WASM runtime on the real model: components give the same greedy
output as native runs, parallel forks inside a component batch, and every
kind of bad component is contained (clear error, pages freed, the runtime
still serves the next inferlet).

Components are built once per session (``tartlet.runtime.builder`` caches
builds by content hash and compiled components on disk, under
``$TARTLET_CACHE_DIR`` or the user cache), so reruns skip the ~10 s build and
the ~10 s compile.
"""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("wasmtime")
pytest.importorskip("componentize_py")

from harness import assert_no_leaks, run, run_ok  # noqa: E402
from tartlet.runtime.builder import build, build_key  # noqa: E402
from tartlet.runtime.instance import Status  # noqa: E402
from tartlet.runtime.program import find_program, load_program  # noqa: E402
from tartlet.runtime.wasm import WasmInstanceError, WasmLimits, WasmLoadError, WasmRuntime  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.wasm]  # componentize-py builds (cached) and wasmtime compiles

PROBE_SOURCE = textwrap.dedent('"""Probe inferlet for the WASM runtime tests: each `case` exercises one\nbehaviour of the sandbox (args: case, plus case-specific ones)."""\nimport asyncio\n\nfrom tartlet import Model, Sampler, _binding, forward\n\n\nasync def forks(args):\n    model = Model.load()\n    with model.new_context() as ctx:\n        ctx.fill(args.get("prompt", "Once upon a time"))\n        await ctx.flush()\n        children = [ctx.fork() for _ in range(args.get("n", 4))]\n        for i, c in enumerate(children):\n            c.fill(f" {i}")\n        gens = [c.generate(Sampler.greedy(), max_tokens=args.get("max_tokens", 8), eos=False) for c in children]\n        out = await asyncio.gather(*(g.collect_tokens() for g in gens))\n        for c in children:\n            c.close()\n        return out\n\n\nasync def bad_calls(args):\n    host = _binding.host()\n    errors = {}\n    model = Model.load()\n    probes = {\n        "unknown_context": lambda: host.context_len(12345),\n        "negative_handle": lambda: host.context_len(-1),\n        "huge_handle": lambda: host.context_len(2**40),\n        "token_out_of_vocab": lambda: host.forward(host.context_new(None), [10**6], None, None, []),\n        "truncate_negative": lambda: host.context_truncate(host.context_new(None), -1),\n        "truncate_past_end": lambda: host.context_truncate(host.context_new(None), 5),\n        "bad_sampler": lambda: host.forward(host.context_new(None), [1], None, None, [forward.OutputSlot(0, "sample", top_p=2.0)]),\n        "unknown_snapshot": lambda: host.snapshot_open(None, "no-such-snapshot"),\n        "unknown_decoder": lambda: host.decoder_push(777, [1]),\n        "detokenize_out_of_vocab": lambda: host.detokenize(None, [-5]),\n        "bad_store_key": lambda: host.store_get(""),\n        "bad_grammar": lambda: host.grammar_new(None, "regex", "("),\n    }\n    import tartlet.sdk.errors\n    classes = {}\n    for name, call in probes.items():\n        try:\n            call()\n            errors[name] = None\n        except Exception as e:\n            errors[name] = f"{type(e).__name__}: {e}"\n            classes[name] = type(e) is getattr(tartlet.sdk.errors, type(e).__name__, None) or type(e).__module__ == "builtins"\n    errors["sdk_classes"] = classes\n    host.store_set("probe-key", "kept")\n    errors["store"] = [host.store_get("probe-key"), host.store_get("probe-missing")]\n    errors["kv_total"] = host.kv_stats(None)["total"]\n    try:\n        await _binding.wait(_binding.HostFuture(424242))\n    except Exception as e:\n        errors["unknown_future"] = f"{type(e).__name__}: {e}"\n    with model.new_context() as ctx:  # still works after all that\n        ctx.fill("Hello")\n        errors["after"] = await ctx.generate(max_tokens=4).collect_tokens()\n    return errors\n\n\nasync def main(args):\n    case = args["case"]\n    if case == "forks":\n        return await forks(args)\n    if case == "bad_calls":\n        return await bad_calls(args)\n    if case == "trap":\n        import os\n        os.abort()\n    if case == "exit":\n        raise SystemExit(3)\n    if case == "oom":\n        hog = []\n        while True:\n            hog.append(bytearray(1 << 20))\n    if case == "loop":\n        n = 0\n        while True:\n            n += 1\n    if case == "open":\n        with open(args.get("path", "/etc/passwd")) as f:\n            return f.read()\n    if case == "listdir":\n        import os\n        return os.listdir("/")\n    if case == "socket":\n        import socket\n        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n        s.connect(("127.0.0.1", 80))\n        return "connected"\n    if case == "scratch":\n        with open("/scratch/note.txt", "w") as f:\n            f.write("kept")\n        with open("/scratch/note.txt") as f:\n            return f.read()\n    if case == "sleep":\n        await asyncio.sleep(args.get("s", 0.02))\n        return "slept"\n    if case == "fail":\n        raise ValueError("boom")\n    if case == "print":\n        print("hello from the guest")\n        return "printed"\n    raise ValueError(f"unknown case {case!r}")\n')


@pytest.fixture(scope="session")
def probe_dir(tmp_path_factory) -> Path:
    """The probe inferlet's folder (one ``case`` per sandbox behaviour)."""
    d = tmp_path_factory.mktemp("probe")
    (d / "main.py").write_text(PROBE_SOURCE)
    (d / "inferlet.toml").write_text('name = "probe"\nversion = "0.1.0"\nentry = "main.py"\n')
    return d


@pytest.fixture(scope="session")
def probe_wasm(probe_dir) -> Path:
    return build(probe_dir)


@pytest.fixture(scope="session")
def text_completion_wasm() -> Path:
    return build(find_program("text-completion"))


@pytest.fixture(scope="session")
def wasm_runtime_shared(host_state):
    return WasmRuntime(host_state, limits=WasmLimits(memory_mb=256, cpu_time_s=20))


@pytest.fixture
def wasm_runtime(wasm_runtime_shared, host_state):
    """The shared WASM runtime; checks that every instance ended and no page leaked."""
    before = set(wasm_runtime_shared.instances)
    yield wasm_runtime_shared
    for iid, inst in wasm_runtime_shared.instances.items():
        if iid not in before:
            assert inst.done.is_set(), f"instance {iid} still running after the test"
    assert_no_leaks(host_state)


PROMPT = {"prompt": "Name three colors.", "max_tokens": 24}


async def assert_still_serving(wasm_runtime, text_completion_wasm, runtime) -> None:
    """The runtime still runs a component, with the native greedy output."""
    native = await run_ok(runtime, "text-completion", PROMPT)
    sandboxed = await run_ok(wasm_runtime, text_completion_wasm, PROMPT)
    assert sandboxed["tokens"] == native["tokens"]


async def test_text_completion_matches_native(wasm_runtime, runtime, text_completion_wasm):
    native = await run(runtime, "text-completion", PROMPT)
    sandboxed = await run(wasm_runtime, text_completion_wasm, PROMPT)
    assert native.status is Status.FINISHED and sandboxed.status is Status.FINISHED, sandboxed.error
    assert sandboxed.result == native.result
    assert len(sandboxed.result["tokens"]) > 4
    assert sandboxed.output == native.output  # same streamed pieces, in order


async def test_text_completion_speculates_in_a_component(wasm_runtime, runtime, text_completion_wasm, host_state):
    """``model-info`` carries ``[[models]] speculative`` and ``kv-stats`` its
    ``batch-requests`` into a component: the sandboxed ``text-completion``
    speculates as the native one does (same tokens, same passes)."""
    slot = host_state.model(None)
    slot.speculative = {"method": "ngram", "max_draft": 8, "max_ngram": 3, "min_ngram": 1, "max_batch": 4}
    args = {"prompt": "Repeat this sentence word for word: the keeper trimmed the wick and polished the lens.",
            "max_tokens": 32}
    try:
        native = await run_ok(runtime, "text-completion", args)
        sandboxed = await run_ok(wasm_runtime, text_completion_wasm, args)
    finally:
        slot.speculative = None
    assert sandboxed == native
    spec = native["speculative"]
    assert spec["stopped"] is None and spec["accepted"] > 0 and spec["passes"] < len(native["tokens"])


async def test_folder_is_built_on_launch(wasm_runtime, runtime, text_completion_wasm):
    res = await run_ok(wasm_runtime, "text-completion", {"prompt": "Hi", "max_tokens": 4})
    assert res == await run_ok(runtime, "text-completion", {"prompt": "Hi", "max_tokens": 4})


async def test_parallel_forks_batch_inside_one_component(wasm_runtime, runtime, probe_wasm, probe_dir, engine):
    args = {"case": "forks", "n": 4, "max_tokens": 8}
    native = await run_ok(runtime, load_program(probe_dir), args)
    calls0 = engine.scheduler.stats.model_calls
    sandboxed = await run_ok(wasm_runtime, probe_wasm, args)
    calls = engine.scheduler.stats.model_calls - calls0
    assert sandboxed == native
    generated = sum(len(t) for t in sandboxed)
    assert generated == 4 * 8
    assert calls < generated, f"{calls} model calls for {generated} tokens: forks did not batch"


async def test_bad_host_calls_raise_in_the_guest(wasm_runtime, probe_wasm):
    errs = await run_ok(wasm_runtime, probe_wasm, {"case": "bad_calls"})
    assert errs["unknown_context"].startswith("InvalidHandleError: no context with handle 12345")
    assert errs["negative_handle"].startswith("InvalidHandleError")
    assert errs["huge_handle"].startswith("InvalidHandleError")
    assert errs["token_out_of_vocab"].startswith("ValueError: token id 1000000 outside the vocabulary")
    assert errs["truncate_negative"].startswith("ValueError")
    assert errs["truncate_past_end"].startswith("ValueError: truncate to 5 outside [0, 0]")
    assert errs["bad_sampler"].startswith("SamplingError") and "top_p" in errs["bad_sampler"]
    assert errs["unknown_snapshot"].startswith("SnapshotError")
    assert errs["unknown_decoder"].startswith("InvalidHandleError: no decoder with handle 777")
    assert errs["detokenize_out_of_vocab"].startswith("ValueError")
    assert errs["unknown_future"].startswith("InvalidHandleError: no future with handle 424242")
    assert errs["bad_store_key"].startswith("StoreError: a store key is a non-empty str")
    assert errs["bad_grammar"].startswith("GrammarError")
    # each is the SDK's own class (tartlet.sdk.errors) or a builtin, as natively
    assert errs["sdk_classes"] and all(errs["sdk_classes"].values()), errs["sdk_classes"]
    assert errs["store"] == ["kept", None] and errs["kv_total"] > 0  # record results (tagged) still arrive
    assert len(errs["after"]) == 4  # the instance kept working after every refused call


@pytest.mark.parametrize(
    "case, expected",
    [
        ("trap", ["crashed", "trap"]),
        ("exit", ["exited with status"]),
        ("oom", ["MemoryError", "memory cap is 64 MiB"]),
        ("loop", ["CPU time limit of 1 s exceeded"]),
        ("open", ["FileNotFoundError", "/etc/passwd"]),
        ("listdir", ["FileNotFoundError"]),
        ("socket", ["PermissionError"]),
        ("fail", ["ValueError: boom"]),
    ],
)
async def test_bad_component_is_contained(wasm_runtime, runtime, probe_wasm, text_completion_wasm, case, expected):
    inst = await run(wasm_runtime, probe_wasm, {"case": case}, limits=WasmLimits(memory_mb=64, cpu_time_s=1))
    assert inst.status is Status.FAILED
    for text in expected:
        assert text in inst.error, f"{case}: {inst.error!r} lacks {text!r}"
    await assert_still_serving(wasm_runtime, text_completion_wasm, runtime)


async def test_invalid_components_are_refused_at_launch(wasm_runtime, runtime, text_completion_wasm, tmp_path):
    garbage = tmp_path / "garbage.wasm"
    garbage.write_bytes(b"this is not webassembly at all")
    core = tmp_path / "core.wasm"
    core.write_bytes(b"\0asm\x01\0\0\0")  # a valid empty core module, not a component
    for bad in (garbage, core):
        with pytest.raises(WasmLoadError, match="not a"):
            wasm_runtime.launch(bad, {})
    with pytest.raises(WasmInstanceError, match="memory"):  # initial memory above the cap
        wasm_runtime.launch(text_completion_wasm, PROMPT, limits=WasmLimits(memory_mb=4))
    await assert_still_serving(wasm_runtime, text_completion_wasm, runtime)


async def test_scratch_dir_only_when_granted(wasm_runtime, probe_wasm):
    assert await run_ok(wasm_runtime, probe_wasm, {"case": "scratch"}, limits=WasmLimits(scratch=True)) == "kept"
    inst = await run(wasm_runtime, probe_wasm, {"case": "scratch"})
    assert inst.status is Status.FAILED and "FileNotFoundError" in inst.error


async def test_abort_and_wall_time_limit_end_a_spinning_component(wasm_runtime, probe_wasm):
    inst = wasm_runtime.launch(probe_wasm, {"case": "loop"}, limits=WasmLimits(cpu_time_s=None))
    await asyncio.sleep(0.3)
    inst.abort("stopped by the test")
    await asyncio.wait_for(inst.wait(), 10)
    assert inst.status is Status.ABORTED and inst.error == "stopped by the test"
    inst = await asyncio.wait_for(
        run(wasm_runtime, probe_wasm, {"case": "loop"}, time_limit_s=0.3, limits=WasmLimits(cpu_time_s=None)), 10
    )
    assert inst.status is Status.FAILED and "time limit of 0.3 s exceeded" in inst.error


async def test_a_users_spinning_components_are_held_to_its_cpu_share(wasm_runtime, probe_wasm, monkeypatch):
    """Issue 40: compute-bound guests of one user took the CPU the model
    thread needs for everyone; their threads' CPU is charged to the owner's
    share at each epoch tick, and a thread over it sleeps."""
    from tartlet.runtime.reservations import CpuShares

    charged: dict[str, float] = {}
    naps: list[float] = []

    class Recording(CpuShares):
        def charge(self, owner: str, cpu_s: float) -> float:
            charged[owner] = charged.get(owner, 0.0) + cpu_s
            nap = super().charge(owner, cpu_s)
            naps.append(nap)
            return nap

    monkeypatch.setattr(wasm_runtime, "cpu", Recording(0.05))
    insts = [wasm_runtime.launch(probe_wasm, {"case": "loop"}, owner="hog", limits=WasmLimits(cpu_time_s=None), time_limit_s=0.8)
             for _ in range(2)]  # fmt: skip
    for inst in insts:
        await asyncio.wait_for(inst.wait(), 20)
        assert inst.status is Status.FAILED and "time limit" in inst.error
    assert set(charged) == {"hog"} and any(n > 0 for n in naps)
    # two spinning threads for 0.8 s, held to 0.05 cores (+ the bucket and one tick per thread)
    assert charged["hog"] < 0.05 * 0.8 + 0.05 * 0.2 + 2 * 0.05 + 0.1


async def test_abort_and_wall_time_limit_wake_a_component_blocked_in_the_host(wasm_runtime, probe_wasm):
    # the guest idles in wait-any (one blocking wait, no poll slices): stop() wakes it
    inst = wasm_runtime.launch(probe_wasm, {"case": "sleep", "s": 60})
    await asyncio.sleep(0.3)
    t0 = asyncio.get_running_loop().time()
    inst.abort("stopped by the test")
    await asyncio.wait_for(inst.wait(), 10)
    assert inst.status is Status.ABORTED and inst.error == "stopped by the test"
    assert asyncio.get_running_loop().time() - t0 < 2
    inst = await asyncio.wait_for(run(wasm_runtime, probe_wasm, {"case": "sleep", "s": 60}, time_limit_s=0.3), 10)
    assert inst.status is Status.FAILED and "time limit of 0.3 s exceeded" in inst.error


async def test_asyncio_sleep_and_print_work_in_the_guest(wasm_runtime, probe_wasm):
    assert await run_ok(wasm_runtime, probe_wasm, {"case": "sleep"}) == "slept"
    assert await run_ok(wasm_runtime, probe_wasm, {"case": "print"}) == "printed"


def test_builds_are_cached_by_content(probe_dir, probe_wasm, tmp_path):
    assert build(probe_dir) == probe_wasm  # same content: the cached file
    mtime = probe_wasm.stat().st_mtime_ns
    assert build(probe_dir).stat().st_mtime_ns == mtime  # not rebuilt
    changed = tmp_path / "probe"
    changed.mkdir()
    (changed / "main.py").write_text(PROBE_SOURCE + "\n# changed\n")
    assert build_key(load_program(changed)) != build_key(load_program(probe_dir))


async def test_prepare_returns_the_component_that_launch_runs(wasm_runtime, probe_dir, probe_wasm, monkeypatch):
    # the server launches what prepare built (off the loop): launch must not
    # look for a build again, which would run componentize-py on the event
    # loop whenever the SDK source changed in between
    prepared = wasm_runtime.prepare(load_program(probe_dir))
    assert prepared.entry == probe_wasm and prepared.name == "probe"
    monkeypatch.setattr("tartlet.runtime.builder.build", lambda *a, **k: pytest.fail("launch built again"))
    assert await run_ok(wasm_runtime, prepared, {"case": "sleep"}) == "slept"
    # a loaded component is found again by its file, without reading it
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"read {self} again"))
    assert wasm_runtime.wasm.load(probe_wasm) is wasm_runtime.wasm.load(probe_wasm)
