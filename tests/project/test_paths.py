"""tartlet.paths: every folder Tartlet uses comes from one module, the
environment variable first, and the model cache follows TARTLET_CACHE_DIR."""

from __future__ import annotations

import pytest

from tartlet import paths


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("TARTLET_CACHE_DIR", "TARTLET_MODELS_DIR", "TARTLET_DATA_DIR", "TARTLET_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_cache_dir_moves_models_kernels_and_builds(clean_env, tmp_path):
    from tartlet.engine.kernels import c_build
    from tartlet.engine.loading import model_store
    from tartlet.runtime import builder, wasm_engine

    clean_env.setenv("TARTLET_CACHE_DIR", str(tmp_path))
    assert paths.cache_dir() == tmp_path
    assert paths.models_dir() == model_store.models_dir() == tmp_path / "models"
    assert paths.kernels_dir() == tmp_path / "kernels"
    # the modules that cache files read the same function, not a copy of it
    assert builder.cache_dir is wasm_engine.cache_dir is paths.cache_dir
    assert c_build.kernels_dir is paths.kernels_dir


def test_models_dir_variable_wins(clean_env, tmp_path):
    clean_env.setenv("TARTLET_CACHE_DIR", str(tmp_path / "cache"))
    clean_env.setenv("TARTLET_MODELS_DIR", str(tmp_path / "models"))
    assert paths.models_dir() == tmp_path / "models"


def test_data_dir_and_config_path(clean_env, tmp_path):
    from tartlet.server.config import ServerConfig, default_config_path

    clean_env.setenv("TARTLET_DATA_DIR", str(tmp_path / "data"))
    clean_env.setenv("TARTLET_CONFIG", "~/x.toml")
    assert ServerConfig().data_dir == str(paths.data_dir()) == str(tmp_path / "data")
    assert default_config_path() == paths.config_path() and paths.config_path().name == "x.toml"
    assert "~" not in str(paths.config_path())


def test_platform_defaults(clean_env):
    import platformdirs

    assert paths.cache_dir() == platformdirs.user_cache_path("tartlet")
    assert paths.data_dir() == platformdirs.user_data_path("tartlet")
    assert paths.models_dir() == platformdirs.user_cache_path("tartlet") / "models"


def test_not_bundled_into_wasm_builds():
    from tartlet.runtime.builder import sdk_files

    files = sdk_files()
    assert "paths.py" not in files and "sdk/model.py" in files and "__init__.py" in files
    assert all(name == "__init__.py" or name.startswith("sdk/") for name in files)
