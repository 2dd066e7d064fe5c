"""Users' LoRA adapters shared by replicas through one folder (issue 34,
under issue 33's ``tartlet serve --replicas``).

Two host states, each with its own engine of the default model (as two
replicas would have), keep users' adapters in the same folder with
``configure_adapters(..., shared=True)``: an adapter uploaded or saved
through one is used through the other with the same logits; one removed
there is gone here (a clear error naming it); one saved again there runs its
new version here; the quota counts the folder; user namespaces hold.

The adapters are the ones tests/engine/test_lora.py trains (``tests/lora_reference.py``).
"""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import pytest

from harness import assert_no_leaks, inline_program, run_ok
from tartlet.sdk.errors import AdapterError, LimitError

pytestmark = pytest.mark.slow

LOGITS = """
from tartlet import AdapterError, Model, forward

async def main(args):
    model = Model.load()
    out = {"names": model.adapters()}
    try:
        with model.new_context() as ctx:
            ctx.fill_tokens(args["ids"])
            (lp,) = await ctx.forward(outputs=[forward.logits(len(args["ids"]) - 1)], adapter=args["adapter"])
        out["logits"] = lp
    except AdapterError as e:
        out["error"] = str(e)
    return out
"""

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def adapter_dirs(gguf_path, hf_model, hf_tokenizer):
    from lora_reference import ADAPTERS, lora_adapter

    return {name: lora_adapter(gguf_path, hf_model, hf_tokenizer, name) for name in ADAPTERS}


@pytest.fixture(scope="module")
def engines(loaded_model):
    """Two replicas' engines (float32 weights, shared tensors)."""
    from tartlet.engine.core.engine import Engine, EngineConfig

    lm = loaded_model
    out = [Engine(EngineConfig(kv_cache_mb=32), lm.config, dict(lm.weights), lm.tokenizer) for _ in range(2)]
    yield out
    for e in out:
        e.close()


@pytest.fixture
def replicas(engines, tmp_path):
    """Two host states on the two engines, one shared adapters folder."""
    from tartlet.host.state import HostState
    from tartlet.runtime.native import NativeRuntime

    out = []
    for eng in engines:
        st = HostState()
        st.add_engine(eng)
        st.configure_adapters(None, tmp_path / "adapters", shared=True)
        out.append(Replica(st, NativeRuntime(st)))
    yield out
    for r in out:
        assert_no_leaks(r.state)


class Replica:
    def __init__(self, state, runtime) -> None:
        self.state = state
        self.runtime = runtime

    @property
    def adapters(self):
        return self.state.model(None).adapters

    async def logits(self, ids: list[int], adapter: str, owner: str = "alice") -> dict:
        prog = inline_program(Path(tempfile.mkdtemp()), LOGITS, f"logits{uuid.uuid4().hex[:6]}")
        return await run_ok(self.runtime, prog, {"ids": ids, "adapter": adapter}, owner=owner)


@pytest.fixture(scope="module")
def prompt(engines):
    tok = engines[0].tokenizer
    return tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True))


def _files(folder: Path) -> dict[str, bytes]:
    return {n: (folder / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")}


async def test_uploaded_on_one_replica_runs_on_the_other(replicas, adapter_dirs, prompt):
    a, b = replicas
    assert b.adapters.saved_names("alice") == []
    info = a.adapters.add_upload("alice", "mine", _files(adapter_dirs["paris-is-pie"]))
    # B never saw the upload: the name comes from the folder, the matrices on first use
    assert b.adapters.names("alice") == ["mine"]
    listed = b.adapters.listing("alice")
    assert [(x["name"], x["owner"], x["weight_bytes"]) for x in listed] == [("mine", "user", info["weight_bytes"])]
    assert b.adapters._saved[("alice", "mine")].adapter is None
    on_a, on_b = await a.logits(prompt, "mine"), await b.logits(prompt, "mine")
    assert "error" not in on_b and on_b["logits"] == on_a["logits"]
    assert b.adapters.find("alice", "mine").key == a.adapters.find("alice", "mine").key
    base = await b.logits(prompt, None)
    assert base.get("logits") != on_b["logits"]


async def test_removed_on_one_replica_is_gone_on_the_other(replicas, adapter_dirs, prompt):
    a, b = replicas
    a.adapters.add_upload("alice", "mine", _files(adapter_dirs["paris-is-pie"]))
    assert "logits" in await b.logits(prompt, "mine")  # B holds it loaded now
    assert b.adapters._saved[("alice", "mine")].adapter is not None
    a.adapters.delete("alice", "mine")
    res = await b.logits(prompt, "mine")
    assert "no adapter named 'mine'" in res["error"] and "mine" not in res["names"]
    assert b.adapters.listing("alice") == [] and b.adapters.used("alice") == 0
    with pytest.raises(AdapterError, match="no adapter of yours named 'mine'"):
        b.adapters.delete("alice", "mine")
    # removed through B while A only listed it
    b.adapters.add_upload("alice", "other", _files(adapter_dirs["paris-is-tartlet"]))
    assert a.adapters.saved_names("alice") == ["other"]
    b.adapters.delete("alice", "other")
    assert a.adapters.saved_names("alice") == [] and a.adapters.find("alice", "other") is None


async def test_saved_again_on_one_replica_runs_its_new_version_on_the_other(replicas, adapter_dirs, prompt):
    a, b = replicas
    a.adapters.add_upload("alice", "mine", _files(adapter_dirs["paris-is-pie"]))
    first = await b.logits(prompt, "mine")
    a.adapters.delete("alice", "mine")
    a.adapters.add_upload("alice", "mine", _files(adapter_dirs["paris-is-tartlet"]))
    second_a, second_b = await a.logits(prompt, "mine"), await b.logits(prompt, "mine")
    assert second_b["logits"] == second_a["logits"] != first["logits"]
    # a fork edited and saved through B is what A runs next
    from tartlet.host.api import HostApi

    api = HostApi(b.state, owner="alice")
    try:
        f = api.adapter_fork(None, "mine", None)
        api.adapter_perturb(None, f, 5, 0.05)
        api.adapter_delete(None, "mine")
        api.adapter_save(None, f, "mine")
        tuned_b = await b.logits(prompt, "mine")
    finally:
        api.close()
    tuned_a = await a.logits(prompt, "mine")
    assert tuned_a["logits"] == tuned_b["logits"] != second_a["logits"]
    assert a.adapters.find("alice", "mine").key == b.adapters.find("alice", "mine").key


async def test_namespaces_and_the_quota_follow_the_folder(replicas, adapter_dirs, prompt):
    a, b = replicas
    info = a.adapters.add_upload("alice", "mine", _files(adapter_dirs["paris-is-pie"]))
    size = info["weight_bytes"]
    # bob sees nothing of alice's, on either replica
    for r in (a, b):
        assert r.adapters.names("bob") == [] and r.adapters.listing("bob") == []
        res = await r.logits(prompt, "mine", owner="bob")
        assert "no adapter named 'mine'" in res["error"]
    with pytest.raises(AdapterError, match="no adapter of yours named 'mine'"):
        b.adapters.delete("bob", "mine")
    # the same name is bob's own on B
    b.adapters.add_upload("bob", "mine", _files(adapter_dirs["paris-is-tartlet"]))
    assert a.adapters.find("bob", "mine").key != a.adapters.find("alice", "mine").key
    # B counts alice's adapter saved through A
    assert b.adapters.used("alice") == size
    b.adapters.max_bytes_per_user = size + size // 2
    with pytest.raises(LimitError, match="max_adapter_mb_per_user"):
        b.adapters.add_upload("alice", "second", _files(adapter_dirs["paris-is-pie"]))
    with pytest.raises(LimitError, match="max_adapter_mb_per_user"):
        b.adapters.charge("alice", size)  # a fork of it
    a.adapters.delete("alice", "mine")
    b.adapters.add_upload("alice", "second", _files(adapter_dirs["paris-is-pie"]))
    # a name taken through the other replica is refused
    with pytest.raises(AdapterError, match="exists already"):
        a.adapters.add_upload("alice", "second", _files(adapter_dirs["paris-is-pie"]))


def test_a_save_racing_another_replicas_save_fails_clearly(engines, adapter_dirs, tmp_path):
    """Two replicas save one name at once: the rename into place refuses to
    replace the other's folder, so one save fails with AdapterError and
    both then see the winner."""
    from tartlet.host.state import HostState

    states = []
    for eng in engines:
        st = HostState()
        st.add_engine(eng)
        st.configure_adapters(None, tmp_path / "adapters", shared=True)
        states.append(st)
    a, b = (st.model(None).adapters for st in states)
    adapter = engines[0].read_adapter(adapter_dirs["paris-is-pie"], "x")
    b._sync("alice")  # B's view is taken before A's save ...
    a.save("alice", "race", adapter)
    b._sync = lambda owner: None  # ... and not brought up to date: B's save reaches the rename
    with pytest.raises(AdapterError, match="exists already"):
        b.save("alice", "race", adapter)
    del b._sync
    assert b.saved_names("alice") == ["race"] and b.used("alice") == adapter.weight_bytes
    assert [p.name for p in (tmp_path / "adapters").glob("*/*/.tmp-*")] == []


async def test_an_unchanged_folder_costs_one_stat(replicas, adapter_dirs, prompt, monkeypatch):
    """Once a user's folder is older than the racy window, a use only
    stats it; any save or delete through another replica changes its mtime,
    so the next use lists it again."""
    import os
    import time

    a, b = replicas
    a.adapters.add_upload("alice", "mine", _files(adapter_dirs["paris-is-pie"]))
    folder = a.adapters.store.user_dir("alice")
    old = time.time() - 60
    os.utime(folder, (old, old))  # as if saved a minute ago
    store = b.adapters.store
    scans = []
    real_scan = store.scan
    monkeypatch.setattr(store, "scan", lambda *args: scans.append(args) or real_scan(*args))
    assert "logits" in await b.logits(prompt, "mine")
    assert b.adapters.find("alice", "mine") is not None and b.adapters.names("alice") == ["mine"]
    assert len(scans) == 1  # listed once, then one stat per call
    a.adapters.delete("alice", "mine")  # the folder's mtime is now
    assert "no adapter named 'mine'" in (await b.logits(prompt, "mine"))["error"]
    assert len(scans) >= 2
