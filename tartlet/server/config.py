"""Server configuration (TOML), as pydantic models.

``tartlet config init`` writes a commented default file; ``tartlet serve``
reads it with :func:`load_config`. Layout::

    host = "127.0.0.1"
    port = 8080
    data_dir = "..."            # keys file, store, uploaded programs, users' adapters (adapters/, or [adapters] dir)
    program_dir = "..."         # `tartlet install` puts inferlets here
    store_path = "..."          # SQLite file of the key-value store

    [[models]]                  # one table per served model: EngineConfig fields
    model = "smollm2-135m-instruct"
    kv_cache_mb = 1024          # the page budget of this model, MiB
    adapters = { name = "path" }  # LoRA adapters served with it (PEFT folder or GGUF file)
    embedding_pooling = "mean"  # POST /v1/embeddings: "mean" or "last" token (server-side, not an engine field)
    ...

    [limits]   max_pages_per_instance, max_pages_per_user, pool_fraction_per_user,
               max_snapshot_pages_per_user, max_snapshots_per_user,
               max_contexts_per_instance, max_snapshot_disk_mb_per_user,
               max_adapter_mb_per_user, max_wall_time_s, max_instances_per_user,
               max_message_bytes, max_upload_bytes, max_json_depth,
               max_session_message_bytes, max_backlog_bytes,
               max_messaging_bytes_per_user, max_topics_per_user,
               max_builds_per_user, max_store_bytes_per_user,
               max_store_keys_per_user, max_sandbox_memory_mb_per_user, max_sandbox_cpu_per_user,
               max_launches_per_s, max_builds_per_min, max_allocs_per_s,
               max_messages_per_s, rate_burst_s, max_rate_wait_s
               (docs/server.md, "Limits": one table of them all)
    [auth]     enabled, keys_file
    [http]     allow_hosts, max_response_bytes, max_request_bytes, timeout_s
    [programs] allow_uploads, uploaded_runtime ("wasm": sandboxed, the default;
               or "native"), installed_runtime ("native", the default, or
               "wasm"), sandbox_memory_mb, sandbox_cpu_time_s
    [mcp.servers.NAME]  url, headers: an MCP server inferlets may call
    [store]    url: PostgreSQL for the key-value store, API keys and
               messaging shared by replicas (empty: SQLite / files / in-process)
    [snapshots] dir: folder of named snapshot files (default
               ``<data_dir>/snapshots``; a shared folder for replicas)
    [adapters] dir: folder of users' saved and uploaded LoRA adapters
               (default ``<data_dir>/adapters``; a shared folder for replicas)
    [cluster]  replicas, threads_per_replica, ray_address, min_replicas,
               max_replicas, target_ongoing_requests, imbalance_threshold,
               imbalance_ratio, routing

Missing keys take the defaults below. Every table is validated strictly:
unknown keys are an error (a typo must not silently change a limit) and
values must have the TOML type of their key (``kv_cache_mb = "1024"`` is
refused, not converted); the error names the file and the key path
(``[[models]] #1 kv_cache_mb``). The models are mutable and validate
assignments too, so the ``tartlet serve`` flags that override the file are
checked the same way.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, create_model, field_validator, model_validator

from .. import paths
from ..engine.core.engine import EngineConfig
from ..engine.loading.quant_formats import QUANTIZE_TYPES
from ..engine.models.quant_linear import MATMUL_DTYPES
from .limits_config import LimitsConfig, PositiveInt, Seconds
from .limits_config import Table as _Table


class ConfigError(ValueError):
    """An invalid configuration file (the message names the file and key)."""


def default_config_path() -> Path:
    """``$TARTLET_CONFIG``, else ``<user config dir>/config.toml`` (:func:`tartlet.paths.config_path`)."""
    return paths.config_path()


class AuthConfig(_Table):
    """``enabled``: refuse clients without a valid key. ``keys_file``: the
    JSON file of ``tartlet auth`` (default ``<data_dir>/keys.json``)."""

    enabled: bool = True
    keys_file: str = ""


class HttpConfig(_Table):
    """HTTP from inferlets: only hosts in ``allow_hosts`` (``"example.com"``,
    ``"*.example.com"``, ``"127.0.0.1:8000"``); bodies and time bounded."""

    allow_hosts: list[str] = Field(default_factory=list)
    max_response_bytes: PositiveInt = 4 * 2**20
    max_request_bytes: PositiveInt = 2**20
    timeout_s: Seconds = 30.0


Runtime = Literal["native", "wasm"]


class ProgramsConfig(_Table):
    """Which runtime runs which programs.

    Attributes:
        allow_uploads: run programs uploaded by clients at all.
        uploaded_runtime: ``"wasm"`` (default: built into a component and
            run sandboxed) or ``"native"`` (trusted, in-process: only for
            servers whose clients are trusted).
        installed_runtime: the same choice for inferlet folders installed
            in ``program_dir`` and the bundled ones (default ``"native"``).
            ``.wasm`` components always run sandboxed.
        sandbox_memory_mb: linear-memory cap of a sandboxed instance, MiB
            (at least 32).
        sandbox_cpu_time_s: CPU-time limit of a sandboxed instance, seconds
            (time blocked on the model does not count).
    """

    allow_uploads: bool = True
    uploaded_runtime: Runtime = "wasm"
    installed_runtime: Runtime = "native"
    sandbox_memory_mb: Annotated[int, Field(ge=32)] = 512
    sandbox_cpu_time_s: Seconds = 60.0


class CodeConfig(_Table):
    """``[code]``: the code sandbox behind the ``code-run`` host call
    (``tartlet.sdk.sandbox``, ``tartlet/host/code_sandbox.py``).

    Attributes:
        enabled: let inferlets run Python snippets at all.
        max_time_s: largest (and default) wall-time limit of one run, seconds.
        max_memory_mb: largest memory cap of one run, MiB (at least 24).
        default_memory_mb: memory cap of a run that names none, MiB.
        workers: worker processes, i.e. runs executing at once (others queue).
        max_pending_per_user: runs of one user queued or running at once.
        max_running_per_user: runs of one user executing at once (its share
            of the workers; users take turns for free workers).
        max_output_bytes: stdout + stderr kept per run, bytes.
    """

    enabled: bool = True
    max_time_s: Seconds = 10.0
    max_memory_mb: Annotated[int, Field(ge=24)] = 256
    default_memory_mb: Annotated[int, Field(ge=24)] = 64
    workers: PositiveInt = 2
    max_pending_per_user: PositiveInt = 8
    max_running_per_user: PositiveInt = 1
    max_output_bytes: PositiveInt = 65536

    @model_validator(mode="after")
    def _default_within_max(self) -> "CodeConfig":
        if self.default_memory_mb > self.max_memory_mb:
            raise ValueError(f"default_memory_mb ({self.default_memory_mb}) is larger than max_memory_mb ({self.max_memory_mb})")
        return self


class McpServerConfig(_Table):
    """One ``[mcp.servers.NAME]`` table: an MCP server inferlets may call.

    Attributes:
        url: the server's endpoint, ``http://`` or ``https://``.
        headers: HTTP headers sent with every request (an ``Authorization``
            token, for instance).
    """

    url: str
    headers: dict[str, str] = Field(default_factory=dict)

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return v


class McpConfig(_Table):
    """``[mcp]``: ``servers`` maps a name to its :class:`McpServerConfig`."""

    servers: dict[str, McpServerConfig] = Field(default_factory=dict)


class StoreConfig(_Table):
    """``[store]``: where state that every replica must see lives.

    Attributes:
        url: a PostgreSQL connection URL (``postgresql://user@host/db``,
            libpq syntax, read by ``psycopg``). When set, the inferlets'
            key-value store, the API keys and the messaging topics live
            there, shared by every server or replica configured with the same
            URL. Empty (the default): the SQLite file ``store_path``, the
            keys file and in-process messaging, for one server.
    """

    url: str = ""

    @field_validator("url")
    @classmethod
    def _postgres_url(cls, v: str) -> str:
        if v and not v.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL (or empty for the single-server SQLite store)")
        return v


class SnapshotsConfig(_Table):
    """``[snapshots]``: ``dir`` is the folder of named snapshot files
    (default ``<data_dir>/snapshots``). Replicas that share it (NFS or any
    POSIX shared path) open each other's snapshots."""

    dir: str = ""


class AdaptersConfig(_Table):
    """``[adapters]``: ``dir`` is the folder of users' saved and uploaded
    LoRA adapters (default ``<data_dir>/adapters``). Replicas that share it
    (NFS or any POSIX shared path) use each other's."""

    dir: str = ""


class ResponsesConfig(_Table):
    """``[responses]``: stored responses of ``POST /v1/responses`` (``store``
    true), kept in ``<data_dir>/responses`` with a KV snapshot each for
    ``previous_response_id``.

    Attributes:
        ttl_s: seconds a stored response (and its snapshot) lives.
        max_per_user: stored responses kept per user; the oldest go first.
    """

    ttl_s: Seconds = 30 * 24 * 3600.0
    max_per_user: PositiveInt = 1000


class ClusterConfig(_Table):
    """``[cluster]``: how ``tartlet serve --replicas N`` runs on Ray Serve
    (see docs/server.md, "Scaling out").

    Attributes:
        replicas: server replicas on Ray Serve (each one engine, runtime and
            host state, behind one gateway); 0 (the default): the
            single-process server, which imports no Ray.
        threads_per_replica: CPU threads of each replica's engine (and the
            CPUs Ray reserves for it).
        ray_address: the Ray cluster to join (``ray://`` or ``HOST:PORT``);
            empty: ``$RAY_ADDRESS``, else a local Ray instance started by
            ``tartlet serve`` itself.
        min_replicas, max_replicas: autoscaling bounds (both unset: a fixed
            ``replicas``).
        target_ongoing_requests: requests in flight per replica that the
            autoscaler aims for.
        imbalance_threshold: requests in flight by which a replica may lead
            the least loaded one and still be chosen for locality (prefix,
            session or snapshot affinity) ...
        imbalance_ratio: ... or the factor by which it may lead; past both
            the least loaded wins (an idle replica takes the request from
            one holding more than ``imbalance_threshold``; two busy ones a
            few requests apart keep their affinity).
        routing: ``"tartlet"`` (load, then session, snapshot and prefix
            affinity) or ``"power-of-two"`` (load only, as Ray Serve's
            default router: a baseline for comparisons).
    """

    replicas: Annotated[int, Field(ge=0)] = 0
    threads_per_replica: PositiveInt = 1
    ray_address: str = ""
    min_replicas: Annotated[int, Field(ge=0)] | None = None
    max_replicas: PositiveInt | None = None
    target_ongoing_requests: Annotated[float, Field(gt=0)] = 16.0
    imbalance_threshold: Annotated[int, Field(ge=0)] = 4
    imbalance_ratio: Annotated[float, Field(ge=1)] = 1.5
    routing: Literal["tartlet", "power-of-two"] = "tartlet"

    @model_validator(mode="after")
    def _bounds(self) -> "ClusterConfig":
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is larger than max_replicas ({self.max_replicas})")
        return self


_DTYPE = Literal["auto", "float32", "bfloat16", "float16"]
_KV_DTYPE = Literal["auto", "float32", "bfloat16", "float16", "int8"]

#: The [[models]] keys whose values are narrower than EngineConfig's types say.
_MODEL_KEY_TYPES: dict[str, Any] = {
    "dtype": _DTYPE,
    "kv_dtype": _KV_DTYPE,
    "quantize": Literal[tuple(QUANTIZE_TYPES)] | None,
    "page_size": PositiveInt,
    "kv_cache_mb": PositiveInt,
    "max_batch_tokens": PositiveInt,
    "batch_wait_ms": Annotated[float, Field(ge=0)],
    "threads": PositiveInt | None,
    "act_bits": Literal["auto", 8, 16],
    "matmul_dtype": Literal[MATMUL_DTYPES],
}


def _model_table() -> type[_Table]:
    """The ``[[models]]`` table, generated from :class:`EngineConfig` so its
    keys and defaults are defined once (there)."""
    hints = typing.get_type_hints(EngineConfig)
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    assert set(_MODEL_KEY_TYPES) <= set(names), set(_MODEL_KEY_TYPES) - set(names)
    fields: dict[str, Any] = {
        f.name: (_MODEL_KEY_TYPES.get(f.name, hints[f.name]),
                 Field(default_factory=typing.cast("typing.Callable[[], Any]", f.default_factory))
                 if f.default is dataclasses.MISSING else f.default)
        for f in dataclasses.fields(EngineConfig)
    }
    return create_model("ServedModel", __base__=_Table, __doc__=EngineConfig.__doc__, **fields)


class SpeculativeConfig(_Table):
    """``[[models]] speculative = {method = "ngram", ...}``: speculative
    decoding in the OpenAI routes and ``text-completion`` for greedy and
    seeded requests (:func:`tartlet.drafter.served_drafter`; docs/server.md).

    Attributes:
        method: ``"ngram"``: prompt lookup (:class:`tartlet.drafter.NgramDrafter`).
        max_draft: most tokens drafted per pass (1..64).
        max_ngram: longest context suffix looked up (>= min_ngram).
        min_ngram: shortest context suffix looked up (>= 1).
        max_batch: drafting stops for a request once a model call of the
            engine holds more requests than this (vLLM's
            ``speculative_disable_by_batch_size``).
    """

    method: Literal["ngram"] = "ngram"
    max_draft: Annotated[int, Field(ge=1, le=64)] = 8
    max_ngram: PositiveInt = 3
    min_ngram: PositiveInt = 1
    max_batch: PositiveInt = 4

    @model_validator(mode="after")
    def _ngram_range(self) -> "SpeculativeConfig":
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"max_ngram ({self.max_ngram}) must be >= min_ngram ({self.min_ngram})")
        return self


#: The [[models]] keys that are the server's, not :class:`EngineConfig` fields.
SERVER_MODEL_KEYS = ("embedding_pooling", "speculative")


class ServedModel(_model_table()):  # type: ignore[misc]
    """One ``[[models]]`` table: the fields of :class:`EngineConfig` (see
    there for each key), validated, and the server's own ``embedding_pooling``
    (``POST /v1/embeddings``: ``"mean"`` or ``"last"`` token; docs/server.md)
    and ``speculative`` (:class:`SpeculativeConfig`; absent: off)."""

    embedding_pooling: Literal["mean", "last"] = "mean"
    speculative: SpeculativeConfig | None = None

    def speculative_settings(self) -> dict[str, Any] | None:
        """``speculative`` as the host serves it (``model-info``), or None."""
        return None if self.speculative is None else self.speculative.model_dump()

    def engine_config(self) -> EngineConfig:
        """The engine settings of this model."""
        return EngineConfig(**self.model_dump(exclude=set(SERVER_MODEL_KEYS)))


class ServerConfig(_Table):
    """Everything ``tartlet serve`` needs.

    Empty paths are filled from ``data_dir`` (itself defaulting to
    ``$TARTLET_DATA_DIR`` or the user data dir) when the config is built;
    after changing ``data_dir``, clear them and call :meth:`resolve_paths`.

    Raises (when built or assigned):
        pydantic.ValidationError: unknown keys, wrong types, values out of
            range (:func:`config_from_dict` turns it into :class:`ConfigError`).
    """

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    data_dir: str = ""
    program_dir: str = ""
    store_path: str = ""
    models: list[ServedModel] = Field(default_factory=lambda: [ServedModel()], min_length=1)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    programs: ProgramsConfig = Field(default_factory=ProgramsConfig)
    mcp: McpConfig = Field(default_factory=McpConfig)
    code: CodeConfig = Field(default_factory=CodeConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    snapshots: SnapshotsConfig = Field(default_factory=SnapshotsConfig)
    adapters: AdaptersConfig = Field(default_factory=AdaptersConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)

    @model_validator(mode="before")
    @classmethod
    def _fill_paths(cls, data: Any) -> Any:
        """Empty or missing paths of the raw table, filled from ``data_dir``
        (a table that is not a dict is left for validation to refuse)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        dd = data.get("data_dir") or ""
        if not isinstance(dd, str):
            return data
        base = Path(dd).expanduser() if dd else paths.data_dir()
        data["data_dir"] = str(base)
        data["program_dir"] = data.get("program_dir") or str(base / "programs")
        data["store_path"] = data.get("store_path") or str(base / "store.sqlite")
        auth = data.get("auth", {})
        if isinstance(auth, dict) and not auth.get("keys_file"):
            data["auth"] = {**auth, "keys_file": str(base / "keys.json")}
        elif isinstance(auth, AuthConfig) and not auth.keys_file:
            data["auth"] = auth.model_copy(update={"keys_file": str(base / "keys.json")})
        return data

    def resolve_paths(self) -> None:
        """Fill empty paths from ``data_dir`` (default: the user data dir),
        after a change of ``data_dir`` that cleared them."""
        data = Path(self.data_dir).expanduser() if self.data_dir else paths.data_dir()
        self.data_dir = str(data)
        self.program_dir = self.program_dir or str(data / "programs")
        self.store_path = self.store_path or str(data / "store.sqlite")
        self.auth.keys_file = self.auth.keys_file or str(data / "keys.json")

    @property
    def upload_dir(self) -> Path:
        return Path(self.data_dir) / "uploads"

    @property
    def snapshot_dir(self) -> Path:
        """``[snapshots] dir``, else ``<data_dir>/snapshots``."""
        return Path(self.snapshots.dir).expanduser() if self.snapshots.dir else Path(self.data_dir) / "snapshots"

    @property
    def adapter_dir(self) -> Path:
        """``[adapters] dir``, else ``<data_dir>/adapters``."""
        return Path(self.adapters.dir).expanduser() if self.adapters.dir else Path(self.data_dir) / "adapters"


def _where(loc: tuple[int | str, ...], table: bool = False) -> str:
    """A pydantic error location as the TOML reader sees it:
    ``('models', 0, 'kv_cache_mb')`` -> ``[[models]] #1 kv_cache_mb``;
    ``table``: the location is a table (``('limits',)`` -> ``[limits]``)."""
    parts = [str(p) for p in loc]
    if parts[:1] == ["models"] and (len(loc) == 1 or isinstance(loc[1], int)):
        head = "[[models]]" + (f" #{int(loc[1]) + 1}" if len(loc) > 1 else "")
        parts = parts[2:]
    elif table or len(parts) > 1:
        n = len(parts) if table else 3 if parts[0] == "mcp" and len(parts) > 3 else 1  # [mcp.servers.NAME] key
        head, parts = f"[{'.'.join(parts[:n])}]", parts[n:]
    else:
        head = ""
    return " ".join(p for p in (head, ".".join(parts)) if p)


def _table_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The config model of the table at ``loc`` (None: not a table)."""
    t: Any = ServerConfig
    for part in loc:
        if isinstance(t, type) and issubclass(t, BaseModel):
            if not isinstance(part, str) or part not in t.model_fields:
                return None
            t = t.model_fields[part].annotation
            if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:  # an optional table
                t = next((a for a in typing.get_args(t) if a is not type(None)), t)
        elif typing.get_origin(t) in (list, dict):
            t = typing.get_args(t)[-1]
        else:
            return None
    return t if isinstance(t, type) and issubclass(t, BaseModel) else None


def _error_line(err: Any) -> str:
    loc, kind = tuple(err["loc"]), err["type"]
    if kind == "extra_forbidden":
        table = _table_at(loc[:-1])
        known = f" (known: {', '.join(table.model_fields)})" if table else ""
        return f"{_where(loc)}: unknown key{known}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{_where(loc, table=True)}: must be a table, got {type(err['input']).__name__}"
    if kind == "missing":
        return f"{_where(loc)}: missing (required)"
    if loc == ("models",) and kind == "too_short":
        return "[[models]]: must list at least one model"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{_where(loc)}: {msg[:1].lower()}{msg[1:]}, got {err['input']!r}"


def format_errors(e: ValidationError, where: str = "config") -> str:
    """One line per error of ``e``: ``WHERE: [table] key: what is wrong, got VALUE``."""
    return "\n".join(f"{where}: {_error_line(err)}" for err in e.errors())


def config_from_dict(raw: dict[str, Any], where: str = "config") -> ServerConfig:
    """A :class:`ServerConfig` from parsed TOML (``where``: the file, for messages).

    Raises:
        ConfigError: unknown keys, wrong types, values out of range, no
            models; the message names ``where`` and each key path.
    """
    try:
        return ServerConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_errors(e, where)) from None


def load_config(path: Path | str | None = None) -> ServerConfig:
    """Read the TOML config at ``path`` (default :func:`default_config_path`);
    a missing default file gives the defaults.

    Raises:
        ConfigError: an explicit path that does not exist, invalid TOML, bad keys.
    """
    p = Path(path).expanduser() if path else default_config_path()
    if not p.exists():
        if path:
            raise ConfigError(f"no config file at {p} (create one with `tartlet config init`)")
        return ServerConfig()
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from None
    return config_from_dict(raw, str(p))


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    """TOML has no null: drop None values."""
    return {k: (_clean(v) if isinstance(v, dict) else v) for k, v in d.items() if v is not None}


def render_config(cfg: ServerConfig) -> str:
    """``cfg`` as TOML text (round-trips through :func:`config_from_dict`)."""
    import tomli_w

    d = cfg.model_dump()
    d["models"] = [_clean(m) for m in d["models"]]
    if not d["mcp"]["servers"]:
        del d["mcp"]
    header = (
        "# Tartlet server configuration (`tartlet serve --config THIS_FILE`).\n"
        "# Limits left out are unlimited. [programs] uploaded_runtime = \"wasm\" runs\n"
        "# client uploads as sandboxed WebAssembly components.\n\n"
    )
    return header + tomli_w.dumps(_clean(d))
