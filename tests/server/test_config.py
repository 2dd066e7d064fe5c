"""Server configuration: defaults, validation errors that name the key path,
the `[mcp.servers.NAME]` tables, command-line overrides validated like the
file, and the TOML round trip of `tartlet config init`."""

from __future__ import annotations

import dataclasses

import pytest

from tartlet.engine.core.engine import EngineConfig
from tartlet.server.config import (
    SERVER_MODEL_KEYS,
    ConfigError,
    McpServerConfig,
    ServedModel,
    ServerConfig,
    config_from_dict,
    load_config,
    render_config,
)


def test_defaults_sandbox_uploads_and_run_installed_natively():
    cfg = config_from_dict({})
    assert cfg.programs.allow_uploads and cfg.programs.uploaded_runtime == "wasm"
    assert cfg.programs.installed_runtime == "native"
    assert cfg.models and cfg.models[0].model == "smollm2-135m-instruct"
    assert cfg.mcp.servers == {}


def test_models_table_has_every_engine_field_and_default():
    assert cfg_engine() == EngineConfig()
    assert list(ServedModel.model_fields) == [f.name for f in dataclasses.fields(EngineConfig)] + list(SERVER_MODEL_KEYS)


def cfg_engine() -> EngineConfig:
    return config_from_dict({}).models[0].engine_config()


def test_paths_filled_from_data_dir(tmp_path):
    cfg = config_from_dict({"data_dir": str(tmp_path), "auth": {"enabled": False}})
    assert cfg.program_dir == str(tmp_path / "programs") and cfg.store_path == str(tmp_path / "store.sqlite")
    assert cfg.auth.keys_file == str(tmp_path / "keys.json") and not cfg.auth.enabled
    explicit = config_from_dict({"data_dir": str(tmp_path), "auth": {"keys_file": "/k.json"}})
    assert explicit.auth.keys_file == "/k.json"


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"programs": {"uploaded_runtime": "docker"}}, ["[programs] uploaded_runtime", "docker"]),
        ({"programs": {"installed_runtime": 1}}, ["installed_runtime"]),
        ({"programs": {"sandbox_memory_mb": 8}}, ["sandbox_memory_mb", "32"]),
        ({"programs": {"sandbox_cpu_time_s": "1m"}}, ["sandbox_cpu_time_s"]),
        ({"programs": {"uploads": True}}, ["[programs] uploads: unknown key", "allow_uploads"]),
        ({"limits": []}, ["[limits]", "table"]),
        ({"limits": {"max_json_depth": 0}}, ["[limits] max_json_depth", "greater than or equal to 1"]),
        ({"limits": {"max_pages_per_user": True}}, ["[limits] max_pages_per_user"]),
        ({"limits": {"pool_fraction_per_user": 1.5}}, ["pool_fraction_per_user"]),
        ({"port": 70000}, ["port"]),
        ({"hots": "x"}, ["hots: unknown key"]),
        ({"models": []}, ["[[models]]", "at least one"]),
        ({"models": [{"kv_cache_mb": "1024"}]}, ["[[models]] #1 kv_cache_mb", "integer", "'1024'"]),
        ({"models": [{}, {"modle": "x"}]}, ["[[models]] #2 modle: unknown key"]),
        ({"models": [{"dtype": "float64"}]}, ["[[models]] #1 dtype"]),
        ({"models": [{"quantize": "q9"}]}, ["quantize", "q8_0"]),
        ({"models": [{"act_bits": 4}]}, ["act_bits"]),
        ({"models": [{"matmul_dtype": "float16"}]}, ["matmul_dtype", "bfloat16"]),
        ({"models": [{"speculative": {"method": "eagle"}}]}, ["[[models]] #1 speculative.method", "'ngram'", "'eagle'"]),
        ({"models": [{"speculative": {"max_draft": 0}}]}, ["[[models]] #1 speculative.max_draft", "greater than or equal to 1"]),
        ({"models": [{"speculative": {"max_draft": 65}}]}, ["speculative.max_draft", "less than or equal to 64"]),
        ({"models": [{"speculative": {"min_ngram": 3, "max_ngram": 2}}]},
         ["[[models]] #1 speculative", "max_ngram (2) must be >= min_ngram (3)"]),
        ({"models": [{"speculative": {"max_batch": "4"}}]}, ["speculative.max_batch", "integer"]),
        ({"models": [{"speculative": {"n": 3}}]}, ["speculative.n: unknown key", "max_draft, max_ngram, min_ngram, max_batch"]),
        ({"models": [{"speculative": "ngram"}]}, ["[[models]] #1 speculative", "table"]),
        ({"mcp": {"servers": {"gh": {}}}}, ["[mcp.servers.gh] url: missing"]),
        ({"mcp": {"servers": {"gh": {"url": "ftp://x"}}}}, ["[mcp.servers.gh] url", "http"]),
        ({"mcp": {"servers": {"gh": {"url": "http://x", "token": "t"}}}}, ["[mcp.servers.gh] token: unknown key"]),
        ({"mcp": {"servers": {"gh": {"url": "http://x", "headers": {"A": 1}}}}}, ["[mcp.servers.gh] headers.A"]),
    ],
)
def test_bad_values_name_the_key(raw, words):
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw, "cfg.toml")
    assert str(e.value).startswith("cfg.toml: ")
    for w in words:
        assert w in str(e.value)


def test_mcp_servers():
    cfg = config_from_dict({"mcp": {"servers": {
        "github": {"url": "https://mcp.example.com/mcp", "headers": {"Authorization": "Bearer t"}},
        "local": {"url": "http://127.0.0.1:9000/mcp"},
    }}})
    assert cfg.mcp.servers["github"].headers == {"Authorization": "Bearer t"}
    assert cfg.mcp.servers["local"].url == "http://127.0.0.1:9000/mcp" and cfg.mcp.servers["local"].headers == {}


def test_assignments_are_validated():
    cfg = ServerConfig()
    cfg.port = 0
    with pytest.raises(ValueError, match="port"):
        cfg.port = -1
    with pytest.raises(ValueError, match="kv_cache_mb"):
        cfg.models[0].kv_cache_mb = "64"


def test_serve_flags_are_validated_like_the_file(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from tartlet.cli.main import app

    (tmp_path / "config.toml").write_text("")
    monkeypatch.setenv("TARTLET_CONFIG", str(tmp_path / "config.toml"))
    for flags, words in ((["--port", "70000"], "command line: port"),
                         (["--kv-cache-mb", "0"], "command line: kv_cache_mb")):
        r = CliRunner().invoke(app, ["serve", *flags, "--data-dir", str(tmp_path)])
        assert r.exit_code == 2 and words in " ".join(r.output.split())


def test_render_round_trips(tmp_path):
    cfg = ServerConfig()
    cfg.programs.uploaded_runtime = "native"
    cfg.limits.max_pages_per_instance = 64
    cfg.mcp.servers["gh"] = McpServerConfig(url="https://x/mcp")
    path = tmp_path / "config.toml"
    path.write_text(render_config(cfg))
    back = load_config(path)
    assert back.programs.uploaded_runtime == "native" and back.limits.max_pages_per_instance == 64
    assert back.models[0].model == cfg.models[0].model
    assert back == cfg


def test_speculative_table_defaults_round_trip_and_stay_out_of_the_engine(tmp_path):
    """``[[models]] speculative``: absent is off; an inline table gets the
    defaults for the keys it leaves out, survives `config init`'s rendering
    and is the server's, not an :class:`EngineConfig` field."""
    assert config_from_dict({}).models[0].speculative_settings() is None
    path = tmp_path / "config.toml"
    path.write_text('[[models]]\nmodel = "smollm2-135m-instruct"\nspeculative = { method = "ngram", max_draft = 6, min_ngram = 2 }\n')
    cfg = load_config(path)
    want = {"method": "ngram", "max_draft": 6, "max_ngram": 3, "min_ngram": 2, "max_batch": 4}
    assert cfg.models[0].speculative_settings() == want
    assert cfg.models[0].engine_config() == EngineConfig()
    path.write_text(render_config(cfg))
    assert load_config(path) == cfg


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="no config file"):
        load_config(tmp_path / "nope.toml")


def test_memory_warning_when_users_at_their_maxima_exceed_the_ram():
    from tartlet.server.memory_budget import MIB, memory_warnings, per_user_bytes

    cfg = config_from_dict({"limits": {"max_sandbox_memory_mb_per_user": 1024, "max_instances_per_user": 64}})
    parts = per_user_bytes(cfg)
    one = sum(n for n in parts.values() if n)
    assert parts["sandboxed instances (max_sandbox_memory_mb_per_user)"] == 1024 * MIB  # smaller than 512 MiB x 64
    assert memory_warnings(cfg, users=4, ram=4 * one) == []
    (warning,) = memory_warnings(cfg, users=5, ram=4 * one)
    assert warning.startswith("5 user(s) at their [limits] maxima") and "max_sandbox_memory_mb_per_user" in warning
    unbounded = config_from_dict({"limits": {"max_sandbox_memory_mb_per_user": None, "max_instances_per_user": None}})
    assert any("unbounded per user" in w for w in memory_warnings(unbounded, users=1, ram=2**40))
