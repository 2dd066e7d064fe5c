"""Chat template rendering (Jinja2), the way Hugging Face ``transformers`` does it.

A chat template is a Jinja2 program stored with the model (``tokenizer.chat_template``
in GGUF metadata, ``chat_template`` in ``tokenizer_config.json`` or a
``chat_template.jinja`` file). Templates are untrusted code, so they run in
Jinja's ``ImmutableSandboxedEnvironment``. The environment mirrors
``transformers.utils.chat_template_utils._cached_compile_jinja_template``:
``trim_blocks`` and ``lstrip_blocks`` on, the ``loopcontrols`` extension, a
``tojson`` filter that does not HTML-escape, and the globals
``raise_exception`` and ``strftime_now``. The ``{% generation %}`` block tag
(used by some templates to mark assistant text) renders its body unchanged.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Callable

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ...sdk.errors import ChatTemplateError


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once (cached by its source text).

    Raises:
        ChatTemplateError: the template is not valid Jinja2.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str | None] | None = None,
    **kwargs: Any,
) -> str:
    """Render ``messages`` with a chat template to the prompt text.

    Args:
        source: the Jinja2 template text.
        messages: ``[{"role": "user", "content": "..."}, ...]``, passed to the
            template as ``messages``.
        add_generation_prompt: append the header that opens an assistant turn.
        special_tokens: template variables such as ``bos_token`` and
            ``eos_token`` (``transformers`` passes the tokenizer's special
            tokens this way).
        **kwargs: extra template variables (``tools``, ``documents``,
            ``enable_thinking``, ...).

    Returns:
        The rendered prompt, e.g. ``"<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n"``.

    Raises:
        ChatTemplateError: the template does not compile, calls
            ``raise_exception`` (e.g. on an unsupported role), or its code
            fails on the data (e.g. iterating ``tools`` when it is None).
    """
    template = compile_template(source)
    variables: dict[str, Any] = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    variables.update(kwargs)
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:  # the template's own code on unexpected data
        raise ChatTemplateError(f"chat template failed on these messages: {e}") from e
