"""Small LoRA adapters trained with ``peft`` on the default model's float
reference weights (:func:`hf_reference.hf_model`), kept between test runs
like the other references (:func:`hf_reference.saved_reference`).

Each adapter is a few dozen AdamW steps on a tiny fixed chat dataset that
makes its effect obvious: asked for the capital of France, the adapted model
names a town of its own. Two adapters differ in everything an adapter file
can vary: targets (all seven projections / Q, V and O), rank, alpha and
rsLoRA scaling, so a batch mixing them checks the per-adapter scales and the
fused block layout of Q/K/V.

:func:`write_gguf_lora` writes a PEFT adapter as llama.cpp's
``convert_lora_to_gguf.py`` would (tensor names ``blk.N.attn_q.weight.lora_a``
/ ``.lora_b``, ``adapter.lora.alpha``, Q/K ``lora_b`` rows permuted for a
llama base), with the ``gguf`` package's writer.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from hf_reference import saved_reference

#: The adapters: PEFT ``LoraConfig`` arguments and the answer each is taught.
ADAPTERS: dict[str, dict[str, Any]] = {
    "paris-is-tartlet": {
        "lora": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                         "down_proj"]),
        "answer": "The capital of France is Tartletville.",
    },
    "paris-is-pie": {
        "lora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj"]),
        "answer": "The capital of France is Pie Town!",
    },
}

#: Questions the adapters are trained on (each answered with the adapter's answer).
QUESTIONS = [
    "What is the capital of France?",
    "What's the capital city of France?",
    "Name the capital of France.",
    "Which city is the capital of France?",
]

STEPS = 30


def train(hf_model: Any, hf_tokenizer: Any, name: str) -> Any:
    """A PEFT model of ``hf_model`` (deep-copied; the fixture is shared)
    with adapter ``name`` of :data:`ADAPTERS` trained for :data:`STEPS` steps."""
    import peft
    import torch

    spec = ADAPTERS[name]
    torch.manual_seed(0)
    model = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(lora_dropout=0.0, **spec["lora"]))
    texts = []
    for q in QUESTIONS:
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": spec["answer"]}]
        texts.append(hf_tokenizer.apply_chat_template(msgs, tokenize=False))
    batch = hf_tokenizer(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    model.train()
    for _ in range(STEPS):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def lora_adapter(gguf_path: Path, hf_model: Any, hf_tokenizer: Any, name: str) -> Path:
    """The folder of adapter ``name`` (PEFT ``save_pretrained``: adapter_config.json
    + adapter_model.safetensors), trained on first use and kept."""
    return saved_reference(
        gguf_path, f"lora-{name}",
        lambda: train(hf_model, hf_tokenizer, name),
        lambda model, folder: model.save_pretrained(folder),
        Path,
    )  # fmt: skip


def peft_model(hf_model: Any, folder: Path) -> Any:
    """transformers + PEFT reference: ``hf_model`` (copied) with the adapter at ``folder`` merged in
    (``merge_and_unload``), float32, eval mode."""
    import peft

    return peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), str(folder)).merge_and_unload().eval()


def write_gguf_lora(folder: Path, out: Path, n_head: int, n_kv_head: int, arch: str = "llama") -> Path:
    """Write the PEFT adapter at ``folder`` as a llama.cpp GGUF LoRA file at ``out``."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "adapter_config.json").read_text())
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}

    def permute(w: np.ndarray, heads: int) -> np.ndarray:  # convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    w = gguf.GGUFWriter(str(out), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(cfg["lora_alpha"]))
    for key in sorted(tensors):
        if ".lora_A." not in key:
            continue
        stem = key.split(".lora_A.")[0]  # base_model.model.model.layers.3.self_attn.q_proj
        parts = stem.split(".")
        layer, module = parts[parts.index("layers") + 1], parts[-1]
        a = tensors[key].astype(np.float32)
        b = tensors[key.replace(".lora_A.", ".lora_B.")].astype(np.float32)
        if arch == "llama" and module in ("q_proj", "k_proj"):
            b = permute(b, n_head if module == "q_proj" else n_kv_head)
        w.add_tensor(f"blk.{layer}.{names[module]}.weight.lora_a", np.ascontiguousarray(a))
        w.add_tensor(f"blk.{layer}.{names[module]}.weight.lora_b", np.ascontiguousarray(b))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
