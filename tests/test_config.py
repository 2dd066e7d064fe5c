"""Server configuration: defaults, validation errors that name the key, and
the TOML round trip of `tartlet config init`."""

from __future__ import annotations

import pytest

from tartlet.runtime.config import ConfigError, ServerConfig, config_from_dict, load_config, render_config


def test_defaults_sandbox_uploads_and_run_installed_natively():
    cfg = config_from_dict({})
    assert cfg.programs.allow_uploads and cfg.programs.uploaded_runtime == "wasm"
    assert cfg.programs.installed_runtime == "native"
    assert cfg.models and cfg.models[0].model == "smollm2-135m-instruct"


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"programs": {"uploaded_runtime": "docker"}}, ["uploaded_runtime", "docker"]),
        ({"programs": {"installed_runtime": 1}}, ["installed_runtime"]),
        ({"programs": {"sandbox_memory_mb": 8}}, ["sandbox_memory_mb"]),
        ({"programs": {"sandbox_cpu_time_s": "1m"}}, ["sandbox_cpu_time_s"]),
        ({"programs": {"uploads": True}}, ["unknown key", "uploads"]),
        ({"limits": []}, ["[limits]", "table"]),
        ({"port": 70000}, ["port"]),
        ({"models": []}, ["[[models]]"]),
    ],
)
def test_bad_values_name_the_key(raw, words):
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw, "cfg.toml")
    for w in words:
        assert w in str(e.value)


def test_render_round_trips(tmp_path):
    cfg = ServerConfig()
    cfg.programs.uploaded_runtime = "native"
    cfg.limits.max_pages_per_instance = 64
    path = tmp_path / "config.toml"
    path.write_text(render_config(cfg))
    back = load_config(path)
    assert back.programs.uploaded_runtime == "native" and back.limits.max_pages_per_instance == 64
    assert back.models[0].model == cfg.models[0].model


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="no config file"):
        load_config(tmp_path / "nope.toml")
