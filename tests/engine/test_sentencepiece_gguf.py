"""GGUF SentencePiece (``tokenizer.ggml.model = "llama"``) vocabularies without a download.

A small vocabulary (control tokens, the 256 ``<0xNN>`` byte-fallback tokens,
``▁`` pieces, a whitespace run spelled with real spaces as Gemma files do,
a user-defined token) is written to a metadata-only GGUF and read by
:meth:`Tokenizer.from_gguf`; the oracle is transformers' own GGUF converter
(``convert_gguf_tokenizer``) on the same metadata, for the Llama, Gemma and
Phi-3 variants. The real 262k Gemma vocabulary is checked in ``test_gemma3_270m.py``.
"""

from __future__ import annotations

import gguf
import pytest

from tartlet.engine.loading.gguf_loader import open_gguf
from tartlet.engine.text.tokenizer import Tokenizer

pytest.importorskip("transformers")
from transformers.integrations.gguf import convert_gguf_tokenizer  # noqa: E402

PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "1", "2", "3", "t", "s", "i", "▁h", "he", "ll", "llo", "▁he", "hello",
          "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "12", "▁1", "▁12", "▁t", "is", "▁this", "th", "▁th", "▁▁", "  ",
          "   ", "▁▁▁▁", "x", "<think>"]
TEXTS = ["hello world", " hello  world", "hello   world 123", "this is it", "héllo 🤗 wörld", "  leading",
         "trailing  ", "<think>hi</think>", "x\ny\tz"]


def write_vocab(path, arch: str) -> dict:
    if arch.startswith("gemma"):
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
        bos, eos, unk, pad = 2, 1, 3, 0
    else:
        specials = ["<unk>", "<s>", "</s>"]
        bos, eos, unk, pad = 1, 2, 0, None
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = ([gguf.TokenType.CONTROL] * len(specials) + [gguf.TokenType.BYTE] * 256
             + [gguf.TokenType.USER_DEFINED if t == "<think>" else gguf.TokenType.NORMAL for t in PIECES])
    # Scores not in token order (Gemma's are not either): llama ranks merges by score, Gemma by position.
    scores = [0.0] * (len(specials) + 256) + [-float((i * 7) % len(PIECES)) for i in range(len(PIECES))]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types([int(t) for t in types])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(unk)
    if pad is not None:
        w.add_pad_token_id(pad)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"tokenizer_type": "llama", "tokens": tokens, "scores": scores, "token_type": [int(t) for t in types],
            "bos_token_id": bos, "eos_token_id": eos, "unk_token_id": unk}


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_sentencepiece_vocab_matches_transformers(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    meta = write_vocab(path, arch)
    ours = Tokenizer.from_gguf(open_gguf(path))
    ref, _ = convert_gguf_tokenizer(arch, meta)
    assert ours.vocab_size == ref.get_vocab_size()
    assert ours.add_bos_token and ours.bos_token_id == meta["bos_token_id"]
    for text in TEXTS:
        want = ref.encode(text, add_special_tokens=False).ids
        assert ours.encode(text) == want, (arch, text, [ref.id_to_token(i) for i in want])
        assert ours.encode(text, add_special_tokens=True) == [meta["bos_token_id"], *want]
        assert ours.decode(want) == ref.decode(want, skip_special_tokens=False), (arch, text)
    assert ours.encode("é")[-2:] == [meta["tokens"].index("<0xC3>"), meta["tokens"].index("<0xA9>")]  # byte fallback (after "▁" for llama, phi3)


def test_unsupported_tokenizer_model_is_a_clear_error(tmp_path):
    path = tmp_path / "t5.gguf"
    w = gguf.GGUFWriter(str(path), "t5")
    w.add_tokenizer_model("t5")
    w.add_token_list(["<pad>", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(NotImplementedError, match="'t5' is not supported.*'gpt2'.*'llama'"):
        Tokenizer.from_gguf(open_gguf(path))
