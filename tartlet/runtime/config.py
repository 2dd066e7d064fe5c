"""Server configuration (TOML).

``tartlet config init`` writes a commented default file; ``tartlet serve``
reads it with :func:`load_config`. Layout::

    host = "127.0.0.1"
    port = 8080
    data_dir = "..."            # keys file, store, uploaded programs
    program_dir = "..."         # `tartlet install` puts inferlets here
    store_path = "..."          # SQLite file of the key-value store

    [[models]]                  # one table per served model: EngineConfig fields
    model = "smollm2-135m-instruct"
    kv_cache_mb = 1024          # the page budget of this model, MiB
    ...

    [limits]   max_pages_per_instance, max_pages_per_user, pool_fraction_per_user,
               max_snapshot_pages_per_user, max_snapshots_per_user,
               max_contexts_per_instance, max_snapshot_disk_mb_per_user,
               max_wall_time_s, max_instances_per_user,
               max_message_bytes, max_upload_bytes, max_json_depth,
               max_session_message_bytes, max_backlog_bytes,
               max_messaging_bytes_per_user, max_topics_per_user,
               max_builds_per_user
    [auth]     enabled, keys_file
    [http]     allow_hosts, max_response_bytes, max_request_bytes, timeout_s
    [programs] allow_uploads, uploaded_runtime ("wasm": sandboxed, the default;
               or "native"), installed_runtime ("native", the default, or
               "wasm"), sandbox_memory_mb, sandbox_cpu_time_s

Missing keys take the defaults below; unknown keys are an error (a typo
must not silently change a limit).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.engine import EngineConfig
from ..host.kv_quotas import KvLimits


class ConfigError(ValueError):
    """An invalid configuration file (the message names the file and key)."""


def _data_home() -> Path:
    env = os.environ.get("TARTLET_DATA_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("tartlet"))


def default_config_path() -> Path:
    """``$TARTLET_CONFIG``, else ``<user config dir>/tartlet/config.toml``."""
    env = os.environ.get("TARTLET_CONFIG")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_config_dir("tartlet")) / "config.toml"


@dataclass
class LimitsConfig:
    """Per-instance and per-user limits (None: unlimited).

    Attributes:
        max_pages_per_instance: distinct KV pages the contexts of one
            instance may hold on one model (a page shared by its forks counts
            once), checked at every allocation: forward, fork, snapshot open
            and take. Over it the call or pass raises ``KvQuotaError`` in
            that inferlet only.
        max_pages_per_user: distinct KV pages one user's running instances
            and named snapshots may hold together, per model.
        pool_fraction_per_user: the same as a fraction of each model's page
            pool (the smaller applies); only with auth on, where users are
            told apart (default 0.5: no user can take the whole pool).
        max_snapshot_pages_per_user: distinct pages one user's snapshots may
            hold, per model (None: only the user bound applies).
        max_snapshots_per_user: named snapshots per user and model.
        max_contexts_per_instance: contexts one instance may have open.
        max_snapshot_disk_mb_per_user: disk space of one user's persisted
            snapshots, MiB per model; the least recently used files are
            deleted past it (the snapshot stays in memory until a restart).
        max_wall_time_s: wall time of one instance, seconds.
        max_instances_per_user: running instances of one user (children
            included).
        max_message_bytes: largest protocol message, bytes: one WebSocket
            frame or one HTTP request body (default 8 MiB, so a largest
            session message fits in a frame even base64-encoded).
        max_upload_bytes: largest uploaded program (all files), bytes.
        max_json_depth: deepest nesting of arrays and objects accepted in
            a WebSocket frame or HTTP body (deeper: ``bad_request`` / 400).
        max_session_message_bytes: largest session message, bytes, in
            either direction (text counted as UTF-8): ``session.send`` of a
            larger one raises ``LimitError`` in the inferlet; a client's
            ``send`` gets error ``too_large``.
        max_backlog_bytes: session bytes waiting per user, over all the
            user's instances: output not yet handed to a client (kept while
            none is attached, and for a while after the instance ended)
            plus client messages not yet received by the inferlet. Output
            over it raises ``LimitError`` in the sending inferlet (backlogs
            of the user's ended instances are dropped first); input over it
            is error ``limit`` to the client. Also the most bytes queued for
            one slow WebSocket client before it is disconnected.
        max_messaging_bytes_per_user: bytes of messaging messages waiting
            in the user's queue topics and subscriptions (a broadcast counts
            once per subscription holding it); a push or broadcast over it
            raises ``LimitError``.
        max_topics_per_user: queue topics with waiting messages or pullers
            plus broadcast topics with subscriptions, per user; a new topic
            over it raises ``LimitError``.
        max_builds_per_user: builds of uploaded programs into components
            (componentize-py, ~220 MB and up to 300 s each) one user may run
            at once; a build also counts as a running instance against
            ``max_instances_per_user``. Over it: launch error ``limit``.
    """

    max_pages_per_instance: int | None = None
    max_pages_per_user: int | None = None
    pool_fraction_per_user: float | None = 0.5
    max_snapshot_pages_per_user: int | None = None
    max_snapshots_per_user: int | None = 1024
    max_contexts_per_instance: int | None = 4096
    max_snapshot_disk_mb_per_user: float | None = 4096.0
    max_wall_time_s: float | None = 600.0
    max_instances_per_user: int | None = 64
    max_message_bytes: int = 8 * 2**20
    max_upload_bytes: int = 8 * 2**20
    max_json_depth: int = 64
    max_session_message_bytes: int = 4 * 2**20
    max_backlog_bytes: int = 16 * 2**20
    max_messaging_bytes_per_user: int = 64 * 2**20
    max_topics_per_user: int = 1024
    max_builds_per_user: int = 1

    def kv_limits(self, auth: bool) -> KvLimits:
        """The KV and snapshot limits for the host (``auth``: whether users
        are told apart; without it ``pool_fraction_per_user`` is off)."""
        return KvLimits(
            max_pages_per_user=self.max_pages_per_user,
            pool_fraction_per_user=self.pool_fraction_per_user if auth else None,
            max_snapshot_pages_per_user=self.max_snapshot_pages_per_user,
            max_snapshots_per_user=self.max_snapshots_per_user,
            max_contexts_per_instance=self.max_contexts_per_instance,
            max_snapshot_disk_mb_per_user=self.max_snapshot_disk_mb_per_user,
        )


@dataclass
class AuthConfig:
    """``enabled``: refuse clients without a valid key. ``keys_file``: the
    JSON file of ``tartlet auth`` (default ``<data_dir>/keys.json``)."""

    enabled: bool = True
    keys_file: str = ""


@dataclass
class HttpConfig:
    """HTTP from inferlets: only hosts in ``allow_hosts`` (``"example.com"``,
    ``"*.example.com"``, ``"127.0.0.1:8000"``); bodies and time bounded."""

    allow_hosts: list[str] = field(default_factory=list)
    max_response_bytes: int = 4 * 2**20
    max_request_bytes: int = 2**20
    timeout_s: float = 30.0


@dataclass
class ProgramsConfig:
    """Which runtime runs which programs.

    Attributes:
        allow_uploads: run programs uploaded by clients at all.
        uploaded_runtime: ``"wasm"`` (default: built into a component and
            run sandboxed) or ``"native"`` (trusted, in-process: only for
            servers whose clients are trusted).
        installed_runtime: the same choice for inferlet folders installed
            in ``program_dir`` and the bundled ones (default ``"native"``).
            ``.wasm`` components always run sandboxed.
        sandbox_memory_mb: linear-memory cap of a sandboxed instance, MiB.
        sandbox_cpu_time_s: CPU-time limit of a sandboxed instance, seconds
            (time blocked on the model does not count).
    """

    allow_uploads: bool = True
    uploaded_runtime: str = "wasm"
    installed_runtime: str = "native"
    sandbox_memory_mb: int = 512
    sandbox_cpu_time_s: float = 60.0


@dataclass
class ServerConfig:
    """Everything ``tartlet serve`` needs."""

    host: str = "127.0.0.1"
    port: int = 8080
    data_dir: str = ""
    program_dir: str = ""
    store_path: str = ""
    models: list[EngineConfig] = field(default_factory=lambda: [EngineConfig()])
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    programs: ProgramsConfig = field(default_factory=ProgramsConfig)

    def __post_init__(self) -> None:
        self.resolve_paths()

    def resolve_paths(self) -> None:
        """Fill empty paths from ``data_dir`` (default: the user data dir)."""
        data = Path(self.data_dir).expanduser() if self.data_dir else _data_home()
        self.data_dir = str(data)
        self.program_dir = self.program_dir or str(data / "programs")
        self.store_path = self.store_path or str(data / "store.sqlite")
        self.auth.keys_file = self.auth.keys_file or str(data / "keys.json")

    @property
    def upload_dir(self) -> Path:
        return Path(self.data_dir) / "uploads"


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table, got {type(raw).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})")
    try:
        return cls(**raw)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def config_from_dict(raw: dict[str, Any], where: str = "config") -> ServerConfig:
    """A :class:`ServerConfig` from parsed TOML.

    Raises:
        ConfigError: unknown keys, wrong types, no models.
    """
    raw = dict(raw)
    sub = {
        "limits": LimitsConfig, "auth": AuthConfig, "http": HttpConfig, "programs": ProgramsConfig,
    }
    built: dict[str, Any] = {}
    for key, cls in sub.items():
        if key in raw:
            built[key] = _build(cls, raw.pop(key), f"{where} [{key}]")
    if "models" in raw:
        models = raw.pop("models")
        if not isinstance(models, list) or not models:
            raise ConfigError(f"{where}: [[models]] must list at least one model")
        built["models"] = [_build(EngineConfig, m, f"{where} [[models]] #{i + 1}") for i, m in enumerate(models)]
    cfg = _build(ServerConfig, {**raw, **built}, where)
    if not isinstance(cfg.port, int) or not 0 <= cfg.port < 65536:
        raise ConfigError(f"{where}: port must be an int in [0, 65535], got {cfg.port!r}")
    for key in ("uploaded_runtime", "installed_runtime"):
        if getattr(cfg.programs, key) not in ("native", "wasm"):
            raise ConfigError(f"{where} [programs]: {key} must be 'native' or 'wasm', got {getattr(cfg.programs, key)!r}")
    for key in ("max_message_bytes", "max_upload_bytes", "max_json_depth", "max_session_message_bytes",
                "max_backlog_bytes", "max_messaging_bytes_per_user", "max_topics_per_user", "max_builds_per_user"):
        v = getattr(cfg.limits, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{where} [limits]: {key} must be a positive int, got {v!r}")
    for key in ("max_pages_per_instance", "max_pages_per_user", "max_snapshot_pages_per_user",
                "max_snapshots_per_user", "max_contexts_per_instance"):
        v = getattr(cfg.limits, key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"{where} [limits]: {key} must be a positive int (or absent: unlimited), got {v!r}")
    for key, top in (("pool_fraction_per_user", 1.0), ("max_snapshot_disk_mb_per_user", float("inf"))):
        v = getattr(cfg.limits, key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= top):
            raise ConfigError(f"{where} [limits]: {key} must be a number in (0, {top}], got {v!r}")
    mem, cpu = cfg.programs.sandbox_memory_mb, cfg.programs.sandbox_cpu_time_s
    if isinstance(mem, bool) or not isinstance(mem, int) or mem < 32:
        raise ConfigError(f"{where} [programs]: sandbox_memory_mb must be an int >= 32 (MiB), got {mem!r}")
    if isinstance(cpu, bool) or not isinstance(cpu, (int, float)) or cpu <= 0:
        raise ConfigError(f"{where} [programs]: sandbox_cpu_time_s must be a positive number, got {cpu!r}")
    return cfg


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

    d = dataclasses.asdict(cfg)
    d["models"] = [_clean(m) for m in d["models"]]
    header = (
        "# Tartlet server configuration (`tartlet serve --config THIS_FILE`).\n"
        "# Limits left out are unlimited. [programs] uploaded_runtime = \"wasm\" runs\n"
        "# client uploads as sandboxed WebAssembly components.\n\n"
    )
    return header + tomli_w.dumps(_clean(d))
