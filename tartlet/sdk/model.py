"""A model as an inferlet sees it: its tokenizer, chat template and facts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _binding
from .adapter import Adapter
from .errors import AdapterError

if TYPE_CHECKING:
    from .context import Context


class Model:
    """Handle to a model served by the host.

    Attributes:
        name: model name.
        vocab_size: vocabulary size.
        eos_token_ids: ids that end a generation by default.
        page_size: tokens per KV page.
        max_seq_len: longest context, in tokens.
        bos_token_id: the beginning-of-sequence token, or None.
        has_chat_template: the model ships a chat template.
        add_bos_token: the model expects ``bos_token_id`` first in every
            sequence (SentencePiece models such as Gemma and Llama 2);
            :meth:`Context.fill` on an empty context puts it there.
        speculative: the server's speculative decoding for this model
            (``[[models]] speculative``): ``{"method": "ngram", "max_draft",
            "max_ngram", "min_ngram", "max_batch"}``, or None (see
            :func:`tartlet.drafter.served_drafter`).
    """

    def __init__(self, info: dict[str, Any]) -> None:
        self.name: str = info["name"]
        self.vocab_size: int = info["vocab_size"]
        self.eos_token_ids: tuple[int, ...] = tuple(info["eos_token_ids"])
        self.bos_token_id: int | None = info.get("bos_token_id")
        self.page_size: int = info["page_size"]
        self.max_seq_len: int = info["max_seq_len"]
        self.has_chat_template: bool = info.get("has_chat_template", False)
        self.add_bos_token: bool = info.get("add_bos_token", False)
        self.speculative: dict[str, Any] | None = info.get("speculative")

    @classmethod
    def load(cls, name: str | None = None) -> "Model":
        """The served model called ``name`` (default: the host's default).

        Raises:
            ValueError: the host does not serve that model.
        """
        return cls(_binding.host().model_info(name))

    @staticmethod
    def available() -> list[str]:
        """Names of the served models, the default first."""
        return _binding.host().model_names()

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (special-token strings are parsed)."""
        return _binding.host().tokenize(self.name, text)

    def detokenize(self, ids: list[int]) -> str:
        """Text of ``ids``. Raises ValueError for ids outside the vocabulary."""
        return _binding.host().detokenize(self.name, list(ids))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render messages with the model's own chat template, as is (no
        tool-call fallback: :func:`tartlet.tools.render_chat` adds that).

        Args:
            messages: ``{"role", "content"}`` dicts; assistant messages may
                carry ``tool_calls``, tool messages ``tool_call_id``/``name``.
            add_generation_prompt: append the assistant header.
            tools: the template's ``tools`` variable (OpenAI shape).

        Raises:
            ValueError: no chat template, a malformed message, or the
                template rejects the conversation.
        """
        return _binding.host().apply_chat_template(self.name, messages, add_generation_prompt, tools)

    def adapters(self) -> list[str]:
        """Names of the LoRA adapters served for this model, sorted."""
        return _binding.host().adapter_names(self.name)

    def adapter(self, name: str) -> Adapter:
        """The LoRA adapter served as ``name`` for this model.

        Raises:
            AdapterError: the host serves no adapter of that name for this
                model (the message lists those it serves).
        """
        names = self.adapters()
        if name not in names:
            raise AdapterError(f"model {self.name!r} serves no adapter named {name!r} (adapters: {', '.join(names) or 'none'})")
        return Adapter(self, name)

    def new_context(self) -> "Context":
        """An empty context on this model."""
        from .context import Context

        return Context(self)

    def snapshot_names(self) -> list[str]:
        """Names of the snapshots this inferlet's user can open on this
        model: its own and the ``public/`` ones (shared by all users), sorted."""
        return _binding.host().snapshot_names(self.name)

    def kv_stats(self) -> dict[str, int]:
        """The pool's page counts: total, free, cached, used, page_size;
        and the engine's load, ``batch_requests``: the requests of its last
        model call (what :class:`~tartlet.drafter.AdaptiveDrafter` reads)."""
        return _binding.host().kv_stats(self.name)

    def __repr__(self) -> str:
        return f"Model({self.name!r})"
