"""The ``[limits]`` table of the server configuration (:class:`LimitsConfig`:
per-instance and per-user bounds, per-user rates) and the base of every
config table (:class:`Table`: strict types, no unknown keys). The other
tables and the file itself are :mod:`tartlet.server.config`."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from ..host.kv_quotas import KvLimits
from ..host.rate_limits import RateLimits


class Table(BaseModel):
    """A TOML table: strict types, no unknown keys, assignments validated."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


PositiveInt = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class LimitsConfig(Table):
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
        max_adapter_mb_per_user: MiB of one user's LoRA adapters per model
            (float32 ``A`` and ``B``, the size of their PEFT safetensors):
            saved and uploaded ones, and the forks its running instances
            hold; past it a fork, save or upload fails with ``LimitError``
            (``limit`` to a client). Served adapters count for nobody.
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
        max_store_bytes_per_user: bytes (UTF-8 keys plus values) one user's
            key-value store entries may hold; a ``store.set`` past it
            raises ``LimitError`` and writes nothing.
        max_store_keys_per_user: keys one user may have in the store; a
            ``store.set`` of a new key past it raises ``LimitError``.
        max_sandbox_memory_mb_per_user: linear memory, MiB, one user's
            running sandboxed (WASM) instances may reserve together; each
            reserves ``[programs] sandbox_memory_mb`` at launch until it
            ends. A launch past it is refused: error ``limit`` to a client,
            ``LimitError`` to a parent launching a child.
        max_sandbox_cpu_per_user: CPU cores one user's running sandboxed
            (WASM) instances may use together (CPU-seconds per second);
            past it their threads sleep until the share comes back, so
            compute-bound guests of one user leave the CPU to the model and
            other users. None: unbounded.
        max_launches_per_s: launches per second one user may start, children
            included (a token bucket, see ``rate_burst_s``). Past it a client
            launch waits for its turn (at most ``max_rate_wait_s``), a child
            launch raises ``LimitError``.
        max_builds_per_min: builds of uploaded programs per minute one user
            may start (a token bucket); past it: launch error ``limit``.
        max_allocs_per_s: host calls that take KV pages or a snapshot slot
            per second per user (context fork, snapshot save, open and take;
            a token bucket); past it the call raises ``LimitError``.
        max_messages_per_s: messaging calls (push, broadcast, subscribe) and
            client ``send`` requests per second per user (a token bucket);
            past it the call raises ``LimitError`` (a client gets ``limit``).
        rate_burst_s: every rate above is a token bucket holding this many
            seconds' worth of tokens (at least one): a user may start
            ``max(1, rate * rate_burst_s)`` at once, and at most ``rate * T``
            plus that burst in any ``T`` seconds (20 launches a second and
            0.5 s: 10 at once, 110 in 5 s).
        max_rate_wait_s: longest a client's launch waits for a token before
            it is refused with ``limit``, seconds. Requests of one
            connection are answered in order, so a user flooding launches
            waits behind its own launches, not other users'.
    """

    max_pages_per_instance: PositiveInt | None = None
    max_pages_per_user: PositiveInt | None = None
    pool_fraction_per_user: Annotated[float, Field(gt=0, le=1)] | None = 0.5
    max_snapshot_pages_per_user: PositiveInt | None = None
    max_snapshots_per_user: PositiveInt | None = 1024
    max_contexts_per_instance: PositiveInt | None = 4096
    max_snapshot_disk_mb_per_user: Annotated[float, Field(gt=0)] | None = 4096.0
    max_adapter_mb_per_user: Annotated[float, Field(gt=0)] | None = 256.0
    max_wall_time_s: Seconds | None = 600.0
    max_instances_per_user: PositiveInt | None = 64
    max_message_bytes: PositiveInt = 8 * 2**20
    max_upload_bytes: PositiveInt = 8 * 2**20
    max_json_depth: PositiveInt = 64
    max_session_message_bytes: PositiveInt = 4 * 2**20
    max_backlog_bytes: PositiveInt = 16 * 2**20
    max_messaging_bytes_per_user: PositiveInt = 64 * 2**20
    max_topics_per_user: PositiveInt = 1024
    max_builds_per_user: PositiveInt = 1
    max_store_bytes_per_user: PositiveInt | None = 64 * 2**20
    max_store_keys_per_user: PositiveInt | None = 100_000
    max_sandbox_memory_mb_per_user: PositiveInt | None = 4096
    max_sandbox_cpu_per_user: PositiveFloat | None = 0.5
    max_launches_per_s: PositiveFloat | None = 20.0
    max_builds_per_min: PositiveFloat | None = 6.0
    max_allocs_per_s: PositiveFloat | None = 200.0
    max_messages_per_s: PositiveFloat | None = 2000.0
    rate_burst_s: PositiveFloat = 0.5
    max_rate_wait_s: Annotated[float, Field(ge=0)] = 5.0

    def rate_limits(self) -> RateLimits:
        """The per-user token buckets of the ``max_*_per_s``/``_per_min`` rates
        (the server applies them with auth on only: without it every request
        is one user's)."""
        return RateLimits(
            {"launch": self.max_launches_per_s, "build": self.max_builds_per_min, "alloc": self.max_allocs_per_s,
             "message": self.max_messages_per_s},
            self.rate_burst_s,
        )  # fmt: skip

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
