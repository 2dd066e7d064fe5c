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
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError, ValidationInfo
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..protocol import ProtocolError
from ..runtime.instance import Instance
from ..runtime.program import load_program
from .openai_api import await_instances
from .openai_errors import PARAM, ApiError, bad_param, launch_error, validation_error
from .openai_fields import invalid, non_empty_string
from .openai_protocol import read_json_body
from .service import post

if TYPE_CHECKING:
    from .openai_api import OpenAiRoutes

PROGRAM_DIR = Path(__file__).parent / "inferlets" / "openai-embedding"

#: The most inputs one request may carry (OpenAI's limit).
MAX_INPUTS = 2048
#: ``encoding_format`` values.
ENCODINGS = ("float", "base64")

_SHAPE = "'input' must be a string, a list of strings, a list of token ids or a list of token-id lists"


def _inputs(value: Any, info: ValidationInfo) -> list[str | list[int]]:
    """The inputs of ``input``: a string, a list of strings, a list of
    token ids or a list of token-id lists, each non-empty (ids checked
    against the validation context's ``vocab_size``)."""
    vocab_size = (info.context or {}).get("vocab_size")
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_id(t) for t in value):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise invalid(_SHAPE if value != [] else "'input' must not be empty")
    if len(items) > MAX_INPUTS:
        raise invalid(f"'input' holds {len(items)} inputs, more than the {MAX_INPUTS} of one request")
    out: list[str | list[int]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise invalid(f"input[{i}] must not be an empty string")
            out.append(item)
        elif isinstance(item, list) and all(_is_id(t) for t in item):
            if not item:
                raise invalid(f"input[{i}] must not be an empty list of token ids")
            bad = [t for t in item if t < 0 or (vocab_size is not None and t >= vocab_size)]
            if bad:
                raise invalid(f"input[{i}]: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
            out.append(list(item))
        else:
            raise invalid(_SHAPE)
    return out


def _encoding(v: Any) -> str:
    if v is None:
        return "float"
    if v not in ENCODINGS:
        raise invalid(f"{PARAM} must be one of {', '.join(ENCODINGS)}, got {v!r}")
    return str(v)


def _dimensions(v: Any) -> int | None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise invalid(f"{PARAM} must be a positive integer, got {v!r}")
    return v


def _user(v: Any) -> str | None:
    if v is not None and not isinstance(v, str):
        raise invalid(f"{PARAM} must be a string, got {type(v).__name__}")
    return v


class EmbeddingRequest(BaseModel):
    """A ``/v1/embeddings`` body (:mod:`.openai_fields`; any other key is a
    400 ``unsupported_parameter``)."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, non_empty_string("is required (see GET /v1/models)", "missing_required_parameter")] = Field(
        "", validate_default=True,
    )
    #: strings and token-id lists, in order
    input: Annotated[list[str | list[int]], PlainValidator(_inputs)] = Field(None, validate_default=True)
    encoding_format: Annotated[str, PlainValidator(_encoding)] = "float"
    dimensions: Annotated[int | None, PlainValidator(_dimensions)] = None
    user: Annotated[str | None, PlainValidator(_user)] = None


def parse_embedding_request(body: Any, vocab_size: int | None = None) -> dict[str, Any]:
    """Validate an embeddings request body (:class:`EmbeddingRequest`);
    returns ``{"model", "inputs", "encoding_format", "dimensions"}``
    (``inputs``: strings and token-id lists, in order; token ids checked
    against ``vocab_size`` when given).

    Raises:
        ApiError: 400 naming the offending parameter (:func:`.openai_errors.validation_error`):
            an unknown one, a bad ``input`` (any other shape, an empty input,
            an id outside the vocabulary, more than :data:`MAX_INPUTS`),
            ``encoding_format`` or ``dimensions``.
    """
    try:
        req = EmbeddingRequest.model_validate(body, context={"vocab_size": vocab_size})
    except ValidationError as e:
        raise validation_error(e) from None
    return {"model": req.model, "inputs": req.input, "encoding_format": req.encoding_format, "dimensions": req.dimensions}


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
