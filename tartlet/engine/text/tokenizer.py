"""Text <-> token ids, built on Hugging Face ``tokenizers``.

Two sources are supported:

* a GGUF file's ``tokenizer.ggml.*`` metadata (GGUF spec,
  https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, "Tokenizer"), for
  byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) and
  SentencePiece BPE vocabularies (``"llama"``: Llama 2, Mistral v0.1, Gemma,
  Phi-3; ``"▁"`` for spaces, ``<0xNN>`` byte-fallback tokens, merges rebuilt
  from the scores or, for Gemma, the token order). The construction follows
  ``transformers.integrations.gguf.gguf_tokenizer_mapping`` (5.x) and the
  ``LlamaTokenizer``/``GemmaTokenizer`` backends so ids match
  ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``;
* a Hugging Face folder with ``tokenizer.json`` and ``tokenizer_config.json``.

Special-token strings that appear in text (``<|im_start|>``) are always parsed
as their single special token, as ``tokenizers`` does for added tokens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream as _HFDecodeStream

from tartlet.engine.text.chat_template import render_chat_template

if TYPE_CHECKING:
    import gguf

log = logging.getLogger(__name__)

# GGUF token types (gguf.TokenType / llama.cpp llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Texts of tokens that end a turn or a document. A *special* token with one of
# these texts counts as end-of-sequence in addition to the declared eos id;
# this is llama.cpp's "end of generation" rule (llama-vocab.cpp, special_eog_ids).
END_OF_GENERATION_TEXTS = frozenset({
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
    "<|end|>", "<end_of_turn>", "<EOT>", "<|return|>", "<end_of_utterance>",
})

# Pre-tokenizer split regexes by ``tokenizer.ggml.pre`` (llama.cpp llama-vocab.cpp
# and transformers' GGUF_PRE_TOKENIZER_SPLITS).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# GPT-2 regex after splitting every digit on its own (StarCoder / SmolLM tokenizer.json).
_INDIVIDUAL_DIGITS = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_GPT2_DEFAULT = frozenset({"default", "gpt-2", "gpt2"})


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (openai/gpt-2 encoder.py)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _gguf_value(reader: "gguf.GGUFReader", key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer for a GGUF ``tokenizer.ggml.pre`` name."""
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre in _INDIVIDUAL_DIGITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre is not None and pre not in _GPT2_DEFAULT:
        log.warning("unknown tokenizer.ggml.pre %r: using the GPT-2 pre-tokenizer", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


#: GGUF architectures whose ``"llama"`` vocabulary is built like ``GemmaTokenizer``.
_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})


def _sentencepiece_merges(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary, best first.

    Every split of every token into two vocabulary entries is a merge ranked
    by the token's ``ranks`` value (higher merges first; ties: longer left,
    then longer right piece, then the order found). Same result as
    ``transformers.tokenization_utils_base.generate_merges(vocab, ranks)``.

    Args:
        vocab: token -> id.
        ranks: token -> score, iterated in its own order (a token missing
            from ``vocab`` contributes nothing).
    """
    found: list[tuple[str, str, float]] = []
    for token, score in ranks.items():
        local = []
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        if len(local) > 1:
            local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found += local
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _sentencepiece_backend(
    arch: str | None, tokens: list[str], scores: list[float] | None, unk: str | None
) -> tuple[_HFTokenizer, bool]:
    """A ``tokenizers`` BPE for a GGUF ``"llama"`` (SentencePiece) vocabulary.

    * Gemma (``arch`` in :data:`_GEMMA_ARCHS`), as ``GemmaTokenizer``: tokens
      made only of two or more spaces are respelled with ``"▁"``; merges are
      ranked by position in the file (Gemma's scores do not follow its merge
      order); normalizer ``" " -> "▁"``, no prefix space.
    * Phi-3: merges by score; normalizer prepends ``"▁"`` and replaces spaces.
    * Others (Llama 2, Mistral v0.1, ...), as ``LlamaTokenizer``: merges by
      score; ``Metaspace`` pre-tokenizer adding ``"▁"`` before the first word;
      the decoder strips that one leading space again.

    All use byte fallback (``<0xNN>`` tokens) and fuse unknown pieces.

    Returns:
        ``(backend, leading_space_stripped)``.
    """
    from tokenizers import normalizers

    gemma = arch in _GEMMA_ARCHS
    if gemma:
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if gemma:
        ranks: dict[str, float] = {t: -i for i, t in enumerate(tokens)}
    else:
        if not scores or len(scores) != len(tokens):
            raise ValueError("GGUF SentencePiece vocabulary lacks tokenizer.ggml.scores")
        ranks = dict(zip(tokens, scores))
    unk = unk if unk in vocab else None
    bpe = models.BPE(vocab=vocab, merges=_sentencepiece_merges(vocab, ranks), unk_token=unk,
                     fuse_unk=True, byte_fallback=True, dropout=None)
    backend = _HFTokenizer(bpe)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    strip = False
    if gemma:
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif arch == "phi3":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        steps.append(decoders.Strip(" ", 1, 0))
        strip = True
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        steps.append(decoders.Strip(" ", 1, 0))
        strip = True
    backend.decoder = decoders.Sequence(steps)
    return backend, strip


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A byte-level BPE (or any ``tokenizer.json``) tokenizer plus its special ids and chat template.

    Build one with :meth:`from_gguf` or :meth:`from_hf_folder`.

    ``eos_token_ids`` rule: the declared eos id first (GGUF
    ``tokenizer.ggml.eos_token_id``; for folders ``generation_config.json``,
    ``config.json`` and ``tokenizer_config.json``), then every *special* token
    whose text is in :data:`END_OF_GENERATION_TEXTS` (``<|im_end|>``,
    ``<|endoftext|>``, ``<|eot_id|>``, ...), ascending by id. This is
    llama.cpp's end-of-generation set; a chat model ending a turn with
    ``<|im_end|>`` stops even when its metadata names another eos.

    ``add_bos_token``: the model expects ``bos_token_id`` first in every
    sequence (GGUF ``tokenizer.ggml.add_bos_token``, default True for
    SentencePiece vocabularies; ``add_bos_token`` of ``tokenizer_config.json``).
    :meth:`encode` adds it only with ``add_special_tokens=True``; the SDK's
    ``Context.fill`` puts it before the first text of an empty context.
    """

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        pad_token_id: int | None,
        unk_token_id: int | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self._tok = backend
        self.bos_token_id = bos_token_id
        self.add_bos_token = bool(add_bos_token) and bos_token_id is not None
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        declared = [i for i in eos_token_ids if i is not None]
        by_text = sorted(
            i for i in self.special_token_ids if backend.id_to_token(i) in END_OF_GENERATION_TEXTS
        )
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(declared + by_text))

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_gguf(cls, reader: "gguf.GGUFReader") -> "Tokenizer":
        """Build from GGUF ``tokenizer.ggml.*`` metadata.

        Uses ``model`` (``"gpt2"``: byte-level BPE with ``merges``;
        ``"llama"``: SentencePiece BPE, see :func:`_sentencepiece_backend`),
        ``tokens``, ``scores``, ``merges``, ``token_type`` (3 = CONTROL ->
        special token, 4 = USER_DEFINED -> plain added token), ``bos/eos/
        padding/unknown_token_id``, ``add_bos_token`` (default True for
        ``"llama"`` vocabularies, as llama.cpp and transformers), ``add_eos_token``,
        ``pre`` (split regex, byte-level only), ``general.architecture``
        (Gemma and Phi-3 SentencePiece variants) and ``tokenizer.chat_template``.

        Raises:
            NotImplementedError: ``tokenizer.ggml.model`` is neither ``"gpt2"``
                nor ``"llama"`` (e.g. ``"t5"`` Unigram, ``"bert"``).
            ValueError: the metadata has no token list, or no merges
                (``"gpt2"``) / no scores (``"llama"``, except Gemma).
        """
        kind = _gguf_value(reader, "tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise NotImplementedError(
                f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') "
                "and SentencePiece BPE ('llama') are"
            )
        tokens: list[str] = _gguf_value(reader, "tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("GGUF metadata lacks tokenizer.ggml.tokens")
        types: list[int] = _gguf_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        bos = _gguf_value(reader, "tokenizer.ggml.bos_token_id")
        eos = _gguf_value(reader, "tokenizer.ggml.eos_token_id")
        unk = _gguf_value(reader, "tokenizer.ggml.unknown_token_id")

        if kind == "gpt2":
            merges: list[str] = _gguf_value(reader, "tokenizer.ggml.merges")
            if not merges:
                raise ValueError("GGUF metadata lacks tokenizer.ggml.merges")
            # Some converters store tokens as raw UTF-8 instead of GPT-2's byte alphabet: respell those.
            spelling = _bytes_to_unicode()
            alphabet = set(spelling.values())
            spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()) for t in tokens]
            vocab = {t: i for i, t in enumerate(spelled)}
            bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)  # type: ignore[misc]  # "a b": pairs
            backend = _HFTokenizer(bpe)
            backend.pre_tokenizer = _byte_level_pre_tokenizer(_gguf_value(reader, "tokenizer.ggml.pre"))
            backend.decoder = decoders.ByteLevel()
            # A CONTROL token spelled outside the byte alphabet is a llama.cpp mislabel (transformers skips it too).
            controls = [t for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_CONTROL and set(t) <= alphabet]
            add_bos_default = False
        else:
            arch = _gguf_value(reader, "general.architecture")
            scores = _gguf_value(reader, "tokenizer.ggml.scores")
            unk_text = tokens[unk] if unk is not None and 0 <= unk < len(tokens) else "<unk>"
            backend, _ = _sentencepiece_backend(arch, tokens, scores, unk_text)
            vocab = backend.get_vocab(with_added_tokens=False)
            controls = [t for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_CONTROL]
            add_bos_default = True
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in controls])
        backend.add_tokens([
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_USER_DEFINED and t in vocab
        ])

        add_bos = bool(_gguf_value(reader, "tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
        add_eos = bool(_gguf_value(reader, "tokenizer.ggml.add_eos_token", False)) and eos is not None
        if add_bos or add_eos:
            head = [(tokens[bos], bos)] if add_bos else []
            tail = [(tokens[eos], eos)] if add_eos else []
            single = [t for t, _ in head] + ["$A"] + [t for t, _ in tail]
            backend.post_processor = processors.TemplateProcessing(
                single=single, pair=single + ["$B:1"], special_tokens=head + tail
            )
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=[eos] if eos is not None else [],
            pad_token_id=_gguf_value(reader, "tokenizer.ggml.padding_token_id"),
            unk_token_id=unk,
            chat_template=_gguf_value(reader, "tokenizer.chat_template"),
            add_bos_token=add_bos,
        )

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> "Tokenizer":
        """Build from a Hugging Face model folder.

        Reads ``tokenizer.json`` (required), ``tokenizer_config.json``
        (special tokens, ``chat_template``), ``chat_template.jinja``, and the
        ``eos_token_id``/``bos_token_id``/``pad_token_id`` of
        ``generation_config.json`` and ``config.json`` when present.

        Raises:
            FileNotFoundError: ``tokenizer.json`` is missing.
        """
        path = Path(path)
        backend = _HFTokenizer.from_file(str(path / "tokenizer.json"))

        def read(name: str) -> dict[str, Any]:
            f = path / name
            return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}

        tcfg, gen, cfg = read("tokenizer_config.json"), read("generation_config.json"), read("config.json")

        def token_id(key: str) -> int | None:
            text = _token_text(tcfg.get(key))
            return backend.token_to_id(text) if text is not None else None

        def first(*values: Any) -> Any:
            return next((v for v in values if v is not None), None)

        eos: list[int] = []
        for v in (gen.get("eos_token_id"), cfg.get("eos_token_id"), token_id("eos_token")):
            eos += v if isinstance(v, list) else [v] if v is not None else []
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(
            backend,
            bos_token_id=first(token_id("bos_token"), gen.get("bos_token_id"), cfg.get("bos_token_id")),
            eos_token_ids=eos,
            pad_token_id=first(token_id("pad_token"), gen.get("pad_token_id"), cfg.get("pad_token_id")),
            unk_token_id=token_id("unk_token"),
            chat_template=template,
            add_bos_token=bool(tcfg.get("add_bos_token", False)),
        )

    # ------------------------------------------------------------------ encoding
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``.

        Special-token strings inside ``text`` become their special ids.
        ``add_special_tokens=True`` adds what the model's post-processor adds
        (e.g. BOS when ``add_bos_token`` is set); chat prompts rendered by a
        template already contain their special tokens, so the default is False.
        """
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``. Incomplete UTF-8 sequences decode to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry spelled as stored (byte-level: ``"Ġthe"``), or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary entry of ``token_id`` as stored, or None when out of range."""
        return self._tok.id_to_token(token_id)

    def decode_stream(self, skip_special_tokens: bool = False) -> "DecodeStream":
        """A new :class:`DecodeStream` over this tokenizer."""
        return DecodeStream(self, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat
    def special_tokens_map(self) -> dict[str, str | None]:
        """``bos_token``/``eos_token``/``pad_token``/``unk_token`` texts, as passed to chat templates."""
        def text(i: int | None) -> str | None:
            return self._tok.id_to_token(i) if i is not None else None
        return {
            "bos_token": text(self.bos_token_id),
            "eos_token": text(self.eos_token_ids[0] if self.eos_token_ids else None),
            "pad_token": text(self.pad_token_id),
            "unk_token": text(self.unk_token_id),
        }

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation to prompt text with the model's chat template.

        Same output as ``transformers``' ``apply_chat_template(..., tokenize=False)``.

        Raises:
            ValueError: the model has no chat template.
            ChatTemplateError: the template failed (see :mod:`tartlet.engine.text.chat_template`).
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt,
            special_tokens=self.special_tokens_map(), **kwargs,
        )


class DecodeStream:
    """Incremental detokenizer: feed ids one at a time, get text deltas.

    A delta never ends in a broken UTF-8 sequence: bytes of a character split
    over several tokens are held back until the character is complete. The
    deltas of :meth:`step` followed by :meth:`flush` concatenate to exactly
    ``tokenizer.decode(all_ids)``. Built on ``tokenizers.decoders.DecodeStream``
    (tokenizers >= 0.21).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._emitted = 0  # characters returned so far
        self._stream = _HFDecodeStream(skip_special_tokens=skip_special_tokens)

    @property
    def ids(self) -> list[int]:
        """All ids fed so far."""
        return list(self._ids)

    def step(self, token_id: int) -> str:
        """Add one id; return the newly completed text (possibly ``""``)."""
        self._ids.append(token_id)
        delta = self._stream.step(self._tokenizer.backend, token_id) or ""
        self._emitted += len(delta)
        return delta

    def flush(self) -> str:
        """End the stream: return text still held back (``""`` unless the last
        character is unfinished, which decodes to U+FFFD). Call once, after the last :meth:`step`."""
        rest = self._tokenizer.decode(self._ids, self._skip)[self._emitted:]
        self._emitted += len(rest)
        return rest
