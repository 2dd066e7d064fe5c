"""Model host calls (WIT interface ``model``): served models, their facts,
tokenizer, chat template, streaming detokenizers (:class:`ModelHostMixin`;
the same interface's LoRA adapter calls: :mod:`.adapter_api`)."""

from __future__ import annotations

from typing import Any, Iterator

from ..engine.core.engine import Engine
from ..sdk.errors import InvalidHandleError
from .state import HostState


class ModelHostMixin:
    """The model calls; :class:`~tartlet.host.api.HostApi` sets ``state``,
    ``_ids`` and ``_decoders``."""

    state: HostState
    _ids: Iterator[int]
    _decoders: dict[int, Any]

    def model_names(self) -> list[str]:
        """Names of the served models; the first is the default."""
        names = list(self.state.models)
        d = self.state.default_model
        return [d] + [n for n in names if n != d] if d else names

    def model_info(self, model: str | None) -> dict[str, Any]:
        """Facts about a model: ``name``, ``vocab_size``, ``eos_token_ids``,
        ``bos_token_id``, ``page_size``, ``max_seq_len``,
        ``has_chat_template``, ``add_bos_token`` (the model expects
        ``bos_token_id`` first in every sequence), ``speculative`` (the
        server's ``[[models]] speculative`` settings as a dict, or None).

        Raises:
            ValueError: the model is not served.
        """
        slot = self.state.model(model)
        e = slot.engine
        return {
            "name": model or self.state.default_model,
            "vocab_size": e.config.vocab_size,
            "eos_token_ids": list(e.tokenizer.eos_token_ids),
            "bos_token_id": e.tokenizer.bos_token_id,
            "page_size": e.pool.page_size,
            "max_seq_len": e.scheduler.max_seq_len,
            "has_chat_template": e.tokenizer.chat_template is not None,
            "add_bos_token": e.tokenizer.add_bos_token,
            "speculative": None if slot.speculative is None else dict(slot.speculative),
        }

    def tokenize(self, model: str | None, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings become special tokens."""
        if not isinstance(text, str):
            raise TypeError(f"tokenize takes a str, got {type(text).__name__}")
        return self.state.model(model).engine.tokenizer.encode(text)

    def detokenize(self, model: str | None, ids: list[int]) -> str:
        """Text of token ids (special tokens included).

        Raises:
            ValueError: an id outside the vocabulary.
        """
        e = self.state.model(model).engine
        check_ids(e, ids)
        return e.tokenizer.decode(ids)

    def apply_chat_template(
        self, model: str | None, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` with the model's own chat template (jinja2).

        Args:
            messages: dicts with ``role`` (str) and ``content`` (str or
                None); an assistant message may carry ``tool_calls`` (a list
                of ``{"id", "type": "function", "function": {"name",
                "arguments": dict}}``, the Hugging Face convention), a tool
                message ``tool_call_id`` and ``name`` (str).
            add_generation_prompt: append the assistant header.
            tools: the template's ``tools`` variable (OpenAI shape, see
                :mod:`tartlet.sdk.tools`), or None.

        Raises:
            ValueError: the model has no chat template, a message or the
                tool list has the wrong shape, or the template rejects them.
        """
        tok = self.state.model(model).engine.tokenizer
        if tok.chat_template is None:
            raise ValueError(f"model {model or self.state.default_model!r} has no chat template")
        msgs = [_chat_message(i, m) for i, m in enumerate(messages)]
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools must be a list of dicts (OpenAI shape: {'type': 'function', 'function': {...}})")
        return tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tools=tools)

    def decoder_new(self, model: str | None) -> int:
        """A streaming detokenizer handle (UTF-8 safe, see ``decoder_push``)."""
        h = next(self._ids)
        self._decoders[h] = self.state.model(model).engine.tokenizer.decode_stream()
        return h

    def decoder_push(self, handle: int, ids: list[int]) -> str:
        """Feed token ids; returns the text they complete (possibly empty
        while a multi-byte character is still split)."""
        dec = self._decoders.get(handle)
        if dec is None:
            raise InvalidHandleError(f"no decoder with handle {handle}")
        return "".join(dec.step(i) for i in ids)

    def decoder_free(self, handle: int) -> None:
        self._decoders.pop(handle, None)


def check_ids(e: Engine, ids: list[int]) -> None:
    """Raises ValueError: an id that is not an int in ``[0, vocab_size)``."""
    v = e.config.vocab_size
    for t in ids:
        if not isinstance(t, int) or not 0 <= t < v:
            raise ValueError(f"token id {t!r} outside the vocabulary [0, {v})")


#: Chat message keys besides role and content, with their types.
_MESSAGE_EXTRAS = {"tool_calls": list, "tool_call_id": str, "name": str}


def _chat_message(i: int, m: Any) -> dict[str, Any]:
    """A checked copy of chat message ``i`` (see :meth:`HostApi.apply_chat_template`).

    Raises:
        ValueError: not a dict, no str ``role``, ``content`` neither str nor
            None, an extra key of the wrong type, or an unknown key.
    """
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"messages[{i}]: a chat message is a dict with a str `role` and `content`, got {m!r}")
    content = m.get("content")
    if content is not None and not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a str or None, got {type(content).__name__}")
    out: dict[str, Any] = {"role": m["role"], "content": content}
    for key, value in m.items():
        if key in ("role", "content"):
            continue
        kind = _MESSAGE_EXTRAS.get(key)
        if kind is None:
            raise ValueError(f"messages[{i}]: unknown key {key!r} (known: role, content, {', '.join(_MESSAGE_EXTRAS)})")
        if value is not None and not isinstance(value, kind):
            raise ValueError(f"messages[{i}].{key} must be a {kind.__name__}, got {type(value).__name__}")
        if value is not None:
            out[key] = value
    return out
