"""Users' LoRA adapters on a real server (issue 34, item 4): ``tartlet
adapter add/list/remove`` uploads a PEFT folder or a GGUF LoRA into the
user's namespace, checked on upload; the user's inferlets and OpenAI
requests (``"model": "BASE:NAME"``) use it, other users do not see it; it
is served again after a restart; the per-user quota bounds it."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from server_harness import InProcessServer, add_users, cli_in_process, write_config, write_inferlet

pytestmark = pytest.mark.slow  # an in-process server (its own model load), restarted once

BASE = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ADAPTER_NAMES = """
from tartlet import Model
async def main(args):
    model = Model.load()
    out = {"names": model.adapters()}
    if args.get("fork"):   # a fork of the uploaded adapter, saved under a second name
        model.adapter(args["fork"]).fork().save(args["fork"] + "-copy")
    return out
"""


@pytest.fixture(scope="module")
def adapter_dirs(gguf_path, hf_model, hf_tokenizer):
    from lora_reference import ADAPTERS, lora_adapter

    return {name: lora_adapter(gguf_path, hf_model, hf_tokenizer, name) for name in ADAPTERS}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapter-upload")
    cfg = write_config(d / "config.toml", d / "data", '[programs]\nuploaded_runtime = "native"\n'
                       '[limits]\nmax_adapter_mb_per_user = 8\n')  # paris-is-pie is 1.4 MiB, paris-is-tartlet 9.3 MiB
    keys = add_users(cfg, "alice", "bob")
    return d, cfg, keys


@pytest.fixture(scope="module")
def server(setup):
    srv = InProcessServer(setup[1])
    yield srv
    if srv._thread.is_alive():  # the restart test stops it itself
        srv.stop()


def tartlet(srv, key, *args):
    return cli_in_process("adapter", *args, "--server", srv.url, "--key", key)


def chat(srv, key, model):
    import openai

    oa = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)
    return oa.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)


def models(srv, key):
    r = srv.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def test_upload_serves_the_adapter_to_its_user_only(server, setup, adapter_dirs):
    """An uploaded PEFT folder answers as trained over the OpenAI routes for
    its user, is listed there with ``parent``, and does not exist for
    another user (404, not listed, cannot be removed)."""
    import openai

    from lora_reference import ADAPTERS

    _, _, keys = setup
    r = tartlet(server, keys["alice"], "add", "pie", str(adapter_dirs["paris-is-pie"]))
    assert r.returncode == 0, r.stderr + r.stdout
    assert "added adapter 'pie': 90 modules, rank 4, 1.4 MiB" in r.stdout
    r = tartlet(server, keys["alice"], "list", "--json")
    assert json.loads(r.stdout) == [{"name": "pie", "owner": "user", "weight_bytes": 1474560, "modules": 90, "rank": 4}]
    assert chat(server, keys["alice"], f"{BASE}:pie").choices[0].message.content == ADAPTERS["paris-is-pie"]["answer"]
    assert models(server, keys["alice"])[f"{BASE}:pie"]["parent"] == BASE
    assert f"{BASE}:pie" not in models(server, keys["bob"])
    with pytest.raises(openai.NotFoundError, match=f"{BASE}:pie"):
        chat(server, keys["bob"], f"{BASE}:pie")
    assert json.loads(tartlet(server, keys["bob"], "list", "--json").stdout) == []
    r = tartlet(server, keys["bob"], "remove", "pie")
    assert r.returncode != 0 and "no adapter of yours named 'pie'" in r.stderr + r.stdout


def test_inferlets_of_the_user_use_uploads(server, setup, tmp_path):
    """A user's inferlet sees its uploads (and may fork and save them);
    another user's does not."""
    from tartlet.client import Client

    _, _, keys = setup
    prog = write_inferlet(tmp_path, "adapter_names", ADAPTER_NAMES)

    async def go(key, args):
        async with await Client.connect(server.url, key) as c:
            inst = await c.launch(prog, args)
            ex = await inst.wait()
            assert ex.ok, ex.error
            return ex.result

    assert asyncio.run(go(keys["alice"], {"fork": "pie"}))["names"] == ["pie"]
    assert asyncio.run(go(keys["alice"], {}))["names"] == ["pie", "pie-copy"]
    assert asyncio.run(go(keys["bob"], {}))["names"] == []
    assert tartlet(server, keys["alice"], "remove", "pie-copy").returncode == 0


def test_gguf_upload_and_bad_uploads(server, setup, adapter_dirs, loaded_model, tmp_path):
    """A GGUF LoRA upload is served like the PEFT folder it was made from;
    a bad adapter is refused with the file and the module at fault and
    leaves nothing behind; the quota bounds a user's adapters."""
    from safetensors.torch import load_file, save_file

    from lora_reference import ADAPTERS, write_gguf_lora

    _, _, keys = setup
    c = loaded_model.config
    gguf = write_gguf_lora(adapter_dirs["paris-is-pie"], tmp_path / "pie.gguf", c.num_attention_heads, c.num_key_value_heads)
    assert tartlet(server, keys["bob"], "add", "pie-gguf", str(gguf)).returncode == 0
    assert chat(server, keys["bob"], f"{BASE}:pie-gguf").choices[0].message.content == ADAPTERS["paris-is-pie"]["answer"]

    bad = tmp_path / "bad"
    shutil.copytree(adapter_dirs["paris-is-pie"], bad)
    f = bad / "adapter_model.safetensors"
    t = load_file(str(f))
    save_file({k: (v[:, :-64].contiguous() if "layers.2.self_attn.v_proj.lora_A" in k else v) for k, v in t.items()}, str(f))
    r = tartlet(server, keys["bob"], "add", "bad", str(bad))
    out = r.stderr + r.stdout
    assert r.returncode != 0 and "bad_request" in out and "adapter_model.safetensors" in " ".join(out.split()), out
    assert "model.layers.2.self_attn.v_proj" in " ".join(out.split()) and "/tmp" not in out, out
    r = tartlet(server, keys["bob"], "add", "pie-gguf", str(adapter_dirs["paris-is-pie"]))
    assert r.returncode != 0 and "exists already" in r.stderr + r.stdout
    r = tartlet(server, keys["bob"], "add", "big", str(adapter_dirs["paris-is-tartlet"]))  # 9.3 MiB > 8 MiB
    assert r.returncode != 0 and "max_adapter_mb_per_user" in " ".join((r.stderr + r.stdout).split())
    assert [a["name"] for a in json.loads(tartlet(server, keys["bob"], "list", "--json").stdout)] == ["pie-gguf"]


def test_uploads_survive_a_restart_and_remove(server, setup):
    """After a restart the users' adapters are served again (read from the
    data dir on first use); ``remove`` deletes one and its folder."""
    from lora_reference import ADAPTERS

    d, cfg, keys = setup
    server.stop()
    again = InProcessServer(cfg)
    try:
        assert f"{BASE}:pie" in models(again, keys["alice"]) and f"{BASE}:pie-gguf" in models(again, keys["bob"])
        assert chat(again, keys["alice"], f"{BASE}:pie").choices[0].message.content == ADAPTERS["paris-is-pie"]["answer"]
        folders = list((d / "data" / "adapters").glob("*/*/*"))
        assert len(folders) == 2 and all((p / "adapter_config.json").is_file() for p in folders)
        assert tartlet(again, keys["alice"], "remove", "pie").returncode == 0
        assert f"{BASE}:pie" not in models(again, keys["alice"])
        assert len(list((d / "data" / "adapters").glob("*/*/*"))) == 1
    finally:
        again.stop()
