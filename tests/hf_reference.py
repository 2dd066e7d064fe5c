"""The transformers references of a GGUF file (its tokenizer, its model
dequantized to float32), converted once and kept between test runs.

transformers converts a GGUF slowly: gguf-py parses the whole vocabulary
field by field (twice: config, then tensors) and dequantizes with numpy,
~30 s of CPU for SmolLM2-135M and minutes for Gemma-3-270M. What it builds
is saved (tokenizer: its ``save_pretrained``; model: the float32 tensors,
config and generation config) under ``cache_dir()/test-references`` and
read back in about a second. A folder is keyed by the file (path, size,
mtime) and the transformers, gguf and torch versions, so a new file or
library converts again. The run that converts also uses what it read back,
so a save/load round trip that changed anything fails the tests at once.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable


def saved_reference(gguf_path: Path, what: str, convert: Callable[[], Any], save: Callable[[Any, str], None],
                    load: Callable[[str], Any]) -> Any:
    """``load(folder)`` of the folder kept for ``(gguf_path, what)``, first
    filled with ``save(convert(), folder)`` when missing."""
    from tartlet.paths import cache_dir

    st = gguf_path.stat()
    versions = "|".join(md.version(p) for p in ("transformers", "gguf", "torch"))
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{versions}".encode()).hexdigest()[:16]
    folder = cache_dir() / "test-references" / f"{gguf_path.stem}-{what}-{key}"
    if not folder.is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
        try:
            save(convert(), str(tmp))
            os.rename(tmp, folder)  # atomic: a concurrent run saving the same folder wins or loses whole
        except OSError:
            pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return load(str(folder))


def save_dequantized(model: Any, folder: str) -> None:
    """A model transformers loaded from a GGUF (float32 tensors, but marked
    GGUF-quantized, which its ``save_pretrained`` refuses): the tensors
    (safetensors, tied ones once), the config without the mark, the
    generation config."""
    from safetensors.torch import save_model

    save_model(model, f"{folder}/model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    Path(folder, "config.json").write_text(json.dumps(cfg, indent=2))
    model.generation_config.save_pretrained(folder)


def hf_tokenizer(gguf_path: Path) -> Any:
    """transformers' tokenizer of ``gguf_path`` (``gguf_file=``)."""
    import transformers

    return saved_reference(
        gguf_path, "tokenizer",
        lambda: transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name),
        lambda tok, folder: tok.save_pretrained(folder),
        transformers.AutoTokenizer.from_pretrained,
    )  # fmt: skip


def hf_model(gguf_path: Path) -> Any:
    """transformers' model of ``gguf_path`` dequantized to float32, in eval mode."""
    import torch
    import transformers

    auto = transformers.AutoModelForCausalLM
    return saved_reference(
        gguf_path, "model",
        lambda: auto.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32),
        save_dequantized,
        lambda folder: auto.from_pretrained(folder, dtype=torch.float32),
    ).eval()  # fmt: skip
