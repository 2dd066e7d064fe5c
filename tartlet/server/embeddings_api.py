"""OpenAI embeddings: ``POST /v1/embeddings``.

Each request runs the bundled ``openai-embedding`` inferlet (next to this
file, like the chat route's ``openai-completion``): one context per input,
all their forward passes submitted together so the engine runs them as one
batch (and batches them with every other inferlet's work), each asking for
the final hidden state (after the model's final norm) of the tokens it
pools; each context is closed, its KV pages freed, as soon as its vector is
read (:mod:`tartlet.sdk.embedding`).

Request (OpenAI's shape): ``input`` a string, a list of strings, a list of
token ids or a list of token-id lists (at most :data:`MAX_INPUTS`; none
empty); ``model`` (required; ``BASE:ADAPTER`` runs a LoRA adapter);
``encoding_format`` ``"float"`` (default) or ``"base64"`` (the vector's
little-endian float32 bytes, base64-encoded, as OpenAI's); ``dimensions``,
accepted only when it equals the model's hidden size: the vectors of a
causal LM's pooled hidden states were not trained to be truncated
(Matryoshka representation learning, which OpenAI's v3 models have), so a
shorter one is refused rather than silently degraded; ``user`` (ignored).

Pooling: per served model, ``[[models]] embedding_pooling`` (``"mean"``
over every input token, the default, or ``"last"`` token), then L2
normalisation. Text is tokenized as :meth:`Context.fill` would (BOS first
where the model wants one); token ids are used as given.

Response: ``{"object": "list", "data": [{"object": "embedding", "index":
i, "embedding": [...] or "base64..."}], "model", "usage": {"prompt_tokens",
"total_tokens"}}``; floats are float32 values, and the base64 form decodes
to exactly them. Errors are OpenAI-shaped: 400 naming the ``param`` (an
unknown parameter, a bad ``input``, ``encoding_format`` or ``dimensions``,
an input longer than the model's context: ``context_length_exceeded``),
401, 404 (model), 429 (launch rate, KV quota), 503 (KV cache full), as on
the other ``/v1`` routes; a client that disconnects aborts its request.
"""

from __future__ import annotations

import asyncio
import base64
import sys
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..protocol import ProtocolError
from ..runtime.instance import Instance
from ..runtime.program import load_program
from .openai_api import await_instances
from .openai_errors import ApiError, bad_param, launch_error
from .openai_protocol import read_json_body
from .service import post

if TYPE_CHECKING:
    from .openai_api import OpenAiRoutes

PROGRAM_DIR = Path(__file__).parent / "inferlets" / "openai-embedding"

#: The parameters of an embeddings request (OpenAI's API reference).
EMBEDDING_PARAMS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})
#: The most inputs one request may carry (OpenAI's limit).
MAX_INPUTS = 2048
#: ``encoding_format`` values.
ENCODINGS = ("float", "base64")

_SHAPE = "'input' must be a string, a list of strings, a list of token ids or a list of token-id lists"


def parse_embedding_request(body: Any, vocab_size: int | None = None) -> dict[str, Any]:
    """Validate an embeddings request body; returns ``{"model", "inputs",
    "encoding_format", "dimensions"}`` (``inputs``: strings and token-id
    lists, in order; token ids checked against ``vocab_size`` when given).

    Raises:
        ApiError: 400 naming the offending parameter.
    """
    if not isinstance(body, dict):
        raise bad_param("the request body must be a JSON object")
    for key in body:
        if key not in EMBEDDING_PARAMS:
            raise bad_param(f"unsupported parameter '{key}'", key, "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_param("'model' is required (see GET /v1/models)", "model", "missing_required_parameter")
    inputs = parse_inputs(body.get("input"), vocab_size)
    fmt = body.get("encoding_format")
    if fmt is None:
        fmt = "float"
    if fmt not in ENCODINGS:
        raise bad_param(f"'encoding_format' must be one of {', '.join(ENCODINGS)}, got {fmt!r}", "encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise bad_param(f"'dimensions' must be a positive integer, got {dims!r}", "dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_param(f"'user' must be a string, got {type(user).__name__}", "user")
    return {"model": model, "inputs": inputs, "encoding_format": fmt, "dimensions": dims}


def parse_inputs(value: Any, vocab_size: int | None) -> list[str | list[int]]:
    """The inputs of ``input``: a string, a list of strings, a list of
    token ids or a list of token-id lists, each non-empty.

    Raises:
        ApiError: 400 (``param`` ``input``) for any other shape, an empty
            input, an id outside the vocabulary or more than :data:`MAX_INPUTS`.
    """
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_id(t) for t in value):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise bad_param(_SHAPE if value != [] else "'input' must not be empty", "input")
    if len(items) > MAX_INPUTS:
        raise bad_param(f"'input' holds {len(items)} inputs, more than the {MAX_INPUTS} of one request", "input")
    out: list[str | list[int]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise bad_param(f"input[{i}] must not be an empty string", "input")
            out.append(item)
        elif isinstance(item, list) and all(_is_id(t) for t in item):
            if not item:
                raise bad_param(f"input[{i}] must not be an empty list of token ids", "input")
            bad = [t for t in item if t < 0 or (vocab_size is not None and t >= vocab_size)]
            if bad:
                raise bad_param(f"input[{i}]: token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "input")
            out.append(list(item))
        else:
            raise bad_param(_SHAPE, "input")
    return out


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def input_ids(tokenizer: Any, inputs: list[str | list[int]]) -> list[list[int]]:
    """Each input's token ids: a string's tokens with BOS first where the
    model wants one (as :meth:`Context.fill` fills it), token ids as given."""
    bos = tokenizer.bos_token_id
    add_bos = bool(getattr(tokenizer, "add_bos_token", False)) and bos is not None
    out = []
    for item in inputs:
        if isinstance(item, str):
            ids = list(tokenizer.encode(item))
            if add_bos and ids[:1] != [bos]:
                ids.insert(0, bos)
            item = ids
        out.append(item)
    return out


def check_lengths(token_lists: list[list[int]], max_seq_len: int) -> None:
    """Raises ApiError 400 ``context_length_exceeded`` (``param`` ``input``)
    for an input longer than the model's context."""
    for i, ids in enumerate(token_lists):
        if len(ids) > max_seq_len:
            which = f"input[{i}]" if len(token_lists) > 1 else "your input"
            raise ApiError(
                400, f"This model's maximum context length is {max_seq_len} tokens, however {which} has {len(ids)} tokens. "
                "Please reduce the length of the input.", "input", "context_length_exceeded",
            )


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """``vector`` as float32 values (a list), or for ``base64`` their
    little-endian float32 bytes base64-encoded (OpenAI's format)."""
    values = array("f", vector)
    if encoding_format == "float":
        return values.tolist()
    if sys.byteorder != "little":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


class EmbeddingsRoutes:
    """``POST /v1/embeddings`` next to ``oa`` (auth, models)."""

    def __init__(self, oa: "OpenAiRoutes") -> None:
        self.oa = oa
        self.service = oa.service
        self.program = load_program(PROGRAM_DIR)

    def _pooling(self, served: str) -> str:
        """``[[models]] embedding_pooling`` of the served model (mean when
        it has no table: a model added outside the config)."""
        for m in self.service.cfg.models:
            if m.model == served:
                return str(m.embedding_pooling)
        return "mean"

    async def create(self, request: Request) -> Response:
        inst: Instance | None = None
        try:
            user = self.oa._user(request)
            body = await read_json_body(request, self.service.cfg.limits)
            model = body.get("model") if isinstance(body, dict) else None
            served, adapter = self.oa._resolve(model) if isinstance(model, str) else (None, None)
            state = self.service.state
            engine = state.model(served).engine
            req = parse_embedding_request(body, engine.config.vocab_size)
            hidden = engine.config.hidden_size
            if req["dimensions"] is not None and req["dimensions"] != hidden:
                raise bad_param(f"'dimensions' must be {hidden}, this model's embedding size: its pooled vectors "
                           "cannot be shortened", "dimensions", "unsupported_value")
            token_lists = await asyncio.to_thread(input_ids, engine.tokenizer, req["inputs"])
            check_lengths(token_lists, engine.scheduler.max_seq_len)
            name = served or state.default_model or ""
            args = {"inputs": token_lists, "pooling": self._pooling(name), "model": name}
            if adapter is not None:
                args["adapter"] = adapter
            try:
                await self.service.admit_launch(user)  # [limits] max_launches_per_s: one token per request
                inst = self.service.launch(user, self.program, args)
            except ProtocolError as e:
                raise launch_error(e) from None
        except ApiError as e:
            return e.response()
        loop = asyncio.get_running_loop()
        ended: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()
        assert inst.task is not None  # launched
        inst.task.add_done_callback(lambda _t: post(loop, ended.put_nowait, (0, None)))
        refused = await await_instances(request, [inst], ended)
        if refused is not None:
            return refused
        vectors = inst.result["embeddings"]
        fmt = req["encoding_format"]
        data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, fmt)} for i, v in enumerate(vectors)]
        n = sum(len(ids) for ids in token_lists)
        return JSONResponse({"object": "list", "data": data, "model": req["model"],
                             "usage": {"prompt_tokens": n, "total_tokens": n}})
