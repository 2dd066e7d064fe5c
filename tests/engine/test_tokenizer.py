"""The tokenizer built from GGUF metadata behaves exactly like transformers' for the same file."""

from __future__ import annotations

import json

import gguf
import pytest

from tartlet.engine.text.tokenizer import DecodeStream, Tokenizer

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "     ",
    "Ünïcödé: naïve café, 日本語のテキスト, текст, مرحبا بالعالم",
    "emoji 😀👍🏽🇫🇷 and symbols ∑∫√ ©®",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    "12345 + 67890 = 80235, pi=3.14159, 1e-10, 2024-11-22",
    "don't you'll I'm we've they're",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<file_sep><repo_name>tartlet",
    "<|im_start|",
    "",
]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke.\nA short one."},
    ],
}


@pytest.fixture(scope="module")
def tok(loaded_model) -> Tokenizer:
    return loaded_model.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(tok, hf_tokenizer, text):
    assert tok.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_token_strings_are_single_tokens(tok):
    assert tok.encode("<|im_start|>") == [tok.token_to_id("<|im_start|>")]
    assert tok.decode(tok.encode("a<|im_end|>"), skip_special_tokens=True) == "a"


def test_special_ids(tok, hf_tokenizer):
    assert tok.vocab_size == len(hf_tokenizer)
    assert tok.bos_token_id == hf_tokenizer.bos_token_id
    assert tok.pad_token_id == hf_tokenizer.pad_token_id
    assert tok.eos_token_ids[0] == hf_tokenizer.eos_token_id
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids
    assert tok.token_to_id("<|endoftext|>") in tok.eos_token_ids
    assert set(hf_tokenizer.all_special_ids) <= tok.special_token_ids
    assert tok.id_to_token(tok.token_to_id("Hello")) == "Hello"
    # add_bos_token is false in this file: nothing is added.
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


def _stream(tok, ids):
    stream = DecodeStream(tok)
    deltas = [stream.step(i) for i in ids]
    return deltas, stream.flush()


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_stream_decode_equals_full_decode(tok, text):
    ids = tok.encode(text)
    deltas, rest = _stream(tok, ids)
    assert "".join(deltas) + rest == tok.decode(ids)
    assert rest == ""
    assert not any("\ufffd" in d for d in deltas)


def test_stream_holds_back_split_characters(tok):
    ids = tok.encode("🇫🇷")
    assert len(ids) > 1 and tok.decode(ids[:1]).endswith("\ufffd")  # the flag really is split
    deltas, rest = _stream(tok, ids)
    assert deltas[0] == "" and "".join(deltas) == "🇫🇷" and rest == ""


def test_stream_flush_returns_unfinished_bytes(tok):
    ids = tok.encode("🇫🇷")[:1]
    deltas, rest = _stream(tok, ids)
    assert deltas == [""] and rest == tok.decode(ids)


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tokenizer, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref


def test_from_hf_folder_matches_gguf_tokenizer(tok, tmp_path):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "chat_template": tok.chat_template,
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    folder = Tokenizer.from_hf_folder(tmp_path)
    for text in TEXTS:
        assert folder.encode(text) == tok.encode(text)
    assert (folder.bos_token_id, folder.eos_token_ids, folder.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id)
    messages = CONVERSATIONS["multi_turn"]
    assert folder.apply_chat_template(messages) == tok.apply_chat_template(messages)


def test_sentencepiece_gguf_without_scores_is_an_error(tmp_path):
    """A Llama-style SentencePiece vocabulary needs its scores to rank merges (see test_sentencepiece_gguf.py)."""
    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="lacks tokenizer.ggml.scores"):
        Tokenizer.from_gguf(gguf.GGUFReader(path))
