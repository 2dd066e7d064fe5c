"""Inferlet messaging shared by server replicas, on PostgreSQL (``[store] url``).

:class:`PgMessageBus` has the interface, validation (:func:`~tartlet.host.messaging.check`),
errors and limits of the in-process :class:`~tartlet.host.messaging.MessageBus`;
buses in different processes configured with one database share their
topics. Imported only when a URL is configured (it imports psycopg).

Longer than this package's 650-line bound on purpose: the queue claims, the
broadcast log, the listener thread and the local waiters share one lock and
one set of invariants (below), which one class in one file keeps checkable
together; about a third of the file is this explanation.

How it works
------------
*Queue topics.* A push that finds no puller waiting in its own process
stores the message as a row of ``tartlet_msg_queue`` (text as UTF-8 in a
BYTEA column, with an ``is_bytes`` flag so bytes come back as bytes) and
sends ``NOTIFY tartlet_msg, 'q<hash of user and topic>'`` (the payload names
the topic, never the message: NOTIFY payloads are limited to 8000 bytes, a
message may be 1 MiB). A puller is registered locally first, then the bus
tries to claim the oldest row in a transaction::

    DELETE FROM tartlet_msg_queue WHERE id = (SELECT id ... ORDER BY id
        FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING ...

and hands it to its oldest live waiter before committing; with no live
waiter left it rolls back (the row is back in place) and notifies again so
the other processes' pullers retry. Each process has one listener
connection (``LISTEN tartlet_msg``) on a background thread; a ``q``
notification makes it claim for its local waiters of that topic. Because
the waiter is registered before the first claim and the listener works
under the same lock, a push committed at any moment wakes it: a message is
delivered to exactly one puller in any process (a row is deleted by exactly
one committed claim; the future is completed after that commit). A push in
the puller's own process hands the message over directly, without the
database (waiting pullers first, as in-process).

*Broadcast topics.* Subscriptions are registered in ``tartlet_msg_subs``
(their ids are that table's, so unique across processes) but their
mailboxes live in the process that opened them. A broadcast reads the
registered subscriptions of the topic in its transaction (so "every
subscription open at the time of the send", in every process, and the count
it returns are exact), delivers to its own process's ones at once, and, for
the others, stores the message once in ``tartlet_msg_broadcasts`` with the
list of recipient subscription ids and processes, and notifies ``b<id>``.
Each listener delivers the row to its local recipients still open and
decrements the row's ``pending`` count; the last one deletes the row. Rows
of processes that never answered (crashed) are deleted after ``stale_s``.
Registering subscriptions in the database rather than only in memory is
what makes the count, the per-user topic limit and the "open at the time of
the send" rule hold across processes, at one row per subscription.

*Liveness.* Each bus has a row in ``tartlet_msg_buses`` that its listener
refreshes every ``heartbeat_s``; a bus not seen for ``stale_s`` is deleted
by any other bus, and with it (``ON DELETE CASCADE``) its registered
subscriptions, waiting pullers and held bytes. The listener also re-claims
for its waiting pullers at each heartbeat (a safety net should a
notification be lost while its connection was reopened).

Limits: what is exact, what is approximate
------------------------------------------
Every call that can add state (push, pull that must wait, subscribe,
broadcast) checks in one transaction holding a per-user advisory lock, and
counts in SQL over all processes:

* topics per user (``max_user_topics``): exact across processes. A topic
  has state while it has queued rows (``tartlet_msg_topics``), pullers
  waiting in any process (``tartlet_msg_pullers``) or subscriptions
  (``tartlet_msg_subs``).
* bytes per user (``max_user_bytes``): queued messages (exact: counted in
  ``tartlet_msg_topics`` in the push/claim transactions) plus the messages
  held in subscriptions' mailboxes of every process (``tartlet_msg_held``,
  written by each process as its mailboxes change). A push to a queue topic
  whose pullers wait in another process is stored first, so it needs the
  room for a moment (in-process it would not). A broadcast counts one copy
  for each subscription in another process (it cannot see whether one of
  them waits in ``next``: stricter than in-process) and for each local one
  without a waiter; the copies for other processes are charged when their
  listeners deliver them, a few milliseconds later, so broadcasts racing in
  that window may pass the limit by those copies.
* backlogs (:data:`~tartlet.host.messaging.MAX_BACKLOG`): exact per queue
  topic; per subscription, checked where the mailbox lives.

Ordering: a queue topic is FIFO by push order (row id); when a claim is
rolled back (its waiter went away) while another process claimed the next
row with ``SKIP LOCKED``, those two may be delivered out of order. Among
waiting pullers, those of one process are served oldest first; across
processes, whichever claims first wins. A broadcast reaches each
subscription in send order of one sender.

Errors: a database failure (unreachable, connection lost) raises
:class:`~tartlet.sdk.errors.MessagingError` with a message that names the server
without its password; the next call reconnects. PostgreSQL text cannot hold
NUL characters, so a user or topic with one is a MessagingError here.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import LiteralString, TypeVar

import psycopg

from ..sdk.errors import LimitError, MessagingError, StoreError
from .messaging import MAX_BACKLOG, MAX_USER_BYTES, MAX_USER_TOPICS, Message, _Mailbox, check
from .pg import Conn, connect, create_tables, describe, redact

log = logging.getLogger(__name__)
T = TypeVar("T")
Key = tuple[str, str]

#: The LISTEN/NOTIFY channel of every bus on a database.
CHANNEL = "tartlet_msg"
#: First key of the per-user advisory locks (two-int form: this, hashtext(user)).
USER_LOCK = 0x746D

_SCHEMA: tuple[LiteralString, ...] = (
    """CREATE TABLE IF NOT EXISTS tartlet_msg_buses (
        bus TEXT PRIMARY KEY,
        seen TIMESTAMPTZ NOT NULL DEFAULT now())""",
    """CREATE TABLE IF NOT EXISTS tartlet_msg_queue (
        id BIGSERIAL PRIMARY KEY,
        usr TEXT COLLATE "C" NOT NULL,
        topic TEXT COLLATE "C" NOT NULL,
        is_bytes BOOLEAN NOT NULL,
        body BYTEA NOT NULL,
        size INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS tartlet_msg_queue_topic ON tartlet_msg_queue (usr, topic, id)",
    """CREATE TABLE IF NOT EXISTS tartlet_msg_topics (
        usr TEXT COLLATE "C" NOT NULL,
        topic TEXT COLLATE "C" NOT NULL,
        waiting INTEGER NOT NULL,
        bytes BIGINT NOT NULL,
        PRIMARY KEY (usr, topic))""",
    """CREATE TABLE IF NOT EXISTS tartlet_msg_pullers (
        bus TEXT NOT NULL REFERENCES tartlet_msg_buses (bus) ON DELETE CASCADE,
        usr TEXT COLLATE "C" NOT NULL,
        topic TEXT COLLATE "C" NOT NULL,
        n INTEGER NOT NULL,
        PRIMARY KEY (bus, usr, topic))""",
    "CREATE INDEX IF NOT EXISTS tartlet_msg_pullers_topic ON tartlet_msg_pullers (usr, topic)",
    """CREATE TABLE IF NOT EXISTS tartlet_msg_subs (
        sid BIGSERIAL PRIMARY KEY,
        bus TEXT NOT NULL REFERENCES tartlet_msg_buses (bus) ON DELETE CASCADE,
        usr TEXT COLLATE "C" NOT NULL,
        topic TEXT COLLATE "C" NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS tartlet_msg_subs_topic ON tartlet_msg_subs (usr, topic)",
    "CREATE INDEX IF NOT EXISTS tartlet_msg_subs_bus ON tartlet_msg_subs (bus)",
    """CREATE TABLE IF NOT EXISTS tartlet_msg_held (
        bus TEXT NOT NULL REFERENCES tartlet_msg_buses (bus) ON DELETE CASCADE,
        usr TEXT COLLATE "C" NOT NULL,
        bytes BIGINT NOT NULL,
        PRIMARY KEY (bus, usr))""",
    "CREATE INDEX IF NOT EXISTS tartlet_msg_held_usr ON tartlet_msg_held (usr)",
    """CREATE TABLE IF NOT EXISTS tartlet_msg_broadcasts (
        id BIGSERIAL PRIMARY KEY,
        usr TEXT COLLATE "C" NOT NULL,
        topic TEXT COLLATE "C" NOT NULL,
        is_bytes BOOLEAN NOT NULL,
        body BYTEA NOT NULL,
        size INTEGER NOT NULL,
        sids BIGINT[] NOT NULL,
        buses TEXT[] NOT NULL,
        pending INTEGER NOT NULL,
        created TIMESTAMPTZ NOT NULL DEFAULT now())""",
)

_CLAIM: LiteralString = """DELETE FROM tartlet_msg_queue WHERE id = (
    SELECT id FROM tartlet_msg_queue WHERE usr = %s AND topic = %s
    ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1)
    RETURNING is_bytes, body, size"""

_TOPIC_STATE: LiteralString = """SELECT count(*) FILTER (WHERE topic = %(t)s), count(*) FROM (
    SELECT topic FROM tartlet_msg_topics WHERE usr = %(u)s
    UNION SELECT topic FROM tartlet_msg_pullers WHERE usr = %(u)s
    UNION SELECT topic FROM tartlet_msg_subs WHERE usr = %(u)s) t"""

_USER_BYTES: LiteralString = """SELECT
    (SELECT coalesce(sum(bytes), 0) FROM tartlet_msg_topics WHERE usr = %(u)s)
    + (SELECT coalesce(sum(bytes), 0) FROM tartlet_msg_held WHERE usr = %(u)s)"""


def _topic_hash(key: Key) -> str:
    """The NOTIFY payload naming a queue topic (bounded whatever its length)."""
    return "q" + hashlib.sha1(json.dumps(key).encode()).hexdigest()


def _no_nul(user: str, topic: str) -> None:
    if "\x00" in user or "\x00" in topic:
        raise MessagingError("a user or topic of messaging on PostgreSQL cannot contain NUL characters")


def _encode(msg: Message) -> tuple[bytes, bool]:
    return (msg, True) if isinstance(msg, bytes) else (msg.encode(), False)


def _decode(is_bytes: bool, body: bytes) -> Message:
    return bytes(body) if is_bytes else bytes(body).decode()


class _Sub:
    """A subscription opened on this bus: its key and mailbox."""

    __slots__ = ("key", "box")

    def __init__(self, key: Key) -> None:
        self.key = key
        self.box = _Mailbox()


class PgMessageBus:
    """The topics of every server configured with the database at ``url``
    (tables ``tartlet_msg_*``, created when missing); see the module doc
    for the design and which limits are exact.

    Methods and semantics are those of :class:`~tartlet.host.messaging.MessageBus`
    (push/pull queue topics, subscribe/broadcast/next/unsubscribe broadcast
    topics, per-user scoping, str and bytes messages), across processes.
    Thread-safe.

    Args:
        url: libpq connection URL of the shared database.
        max_user_bytes: bytes of waiting messages one user may hold, counted
            over every bus on the database (None: unlimited).
        max_user_topics: topics with state one user may have, over every bus
            (None: unlimited).
        heartbeat_s: how often the listener marks this bus alive, deletes
            buses not seen for ``stale_s`` and re-claims for waiting pullers.
        stale_s: after how long without a heartbeat a bus (a crashed
            replica) is deleted with its subscriptions, pullers and held
            bytes; also the age after which a broadcast row is dropped.

    Raises:
        MessagingError: the database cannot be reached or the tables created
            (the message has no password). Every method raises
            MessagingError on a database failure and after :meth:`close`,
            besides the errors of the in-process bus.
    """

    def __init__(self, url: str, max_user_bytes: int | None = MAX_USER_BYTES, max_user_topics: int | None = MAX_USER_TOPICS,
                 *, heartbeat_s: float = 5.0, stale_s: float = 60.0) -> None:
        self.max_user_bytes = max_user_bytes
        self.max_user_topics = max_user_topics
        self.bus_id = uuid.uuid4().hex
        self._url = url
        self._heartbeat_s = heartbeat_s
        self._stale_s = stale_s
        self._lock = threading.RLock()  # local state and the work connection
        self._closed = False
        self._waiters: dict[Key, collections.deque[Future[Message]]] = {}  # queue pullers waiting here
        self._hashes: dict[str, Key] = {}  # NOTIFY payload -> key, for keys in _waiters
        self._subs: dict[int, _Sub] = {}
        self._held: dict[str, int] = collections.defaultdict(int)  # bytes in this bus's mailboxes, per user
        self._lost_sids: set[int] = set()  # unsubscribed while the database failed: rows to delete
        self._conn: Conn | None = self._connect()
        self._listen_conn: Conn | None = None
        try:
            create_tables(self._conn, *_SCHEMA)
            self._conn.execute("INSERT INTO tartlet_msg_buses (bus) VALUES (%s)", (self.bus_id,))
            self._listen_conn = self._open_listener()
        except psycopg.Error as e:
            self._conn.close()
            raise MessagingError(f"messaging on PostgreSQL at {redact(url)}: {describe(url, e)}") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen_loop, name="tartlet-pg-messaging", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"PgMessageBus({redact(self._url)!r}, bus_id={self.bus_id!r})"

    # -- connections -------------------------------------------------------------------
    def _connect(self) -> Conn:
        try:
            return connect(self._url)
        except StoreError as e:
            raise MessagingError(str(e).replace("cannot connect", "messaging cannot connect", 1)) from None

    def _open_listener(self) -> Conn:
        conn = self._connect()
        conn.execute("LISTEN tartlet_msg")  # CHANNEL
        return conn

    def _db(self, fn: Callable[[Conn], T]) -> T:
        """``fn(work connection)`` (the caller holds the lock); a broken
        connection is replaced first. Not retried after a failure inside
        ``fn`` (a commit may have happened): that raises MessagingError."""
        if self._closed:
            raise MessagingError("the message bus is closed")
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                conn.close()
            self._conn = conn = None
            self._conn = conn = self._connect()
        try:
            return fn(conn)
        except psycopg.OperationalError as e:
            conn.close()
            self._conn = None
            raise MessagingError(f"messaging on PostgreSQL at {redact(self._url)}: {describe(self._url, e)}") from None
        except psycopg.Error as e:
            raise MessagingError(f"messaging on PostgreSQL: {describe(self._url, e)}") from None

    # -- checks (inside a transaction) ---------------------------------------------------
    @staticmethod
    def _lock_user(c: Conn, user: str) -> None:
        c.execute("SELECT pg_advisory_xact_lock(29805, hashtext(%s))", (user,))

    def _check_topic(self, c: Conn, user: str, topic: str) -> None:
        """LimitError if ``topic`` has no state yet and the user is at ``max_user_topics``."""
        if self.max_user_topics is None:
            return
        row = c.execute(_TOPIC_STATE, {"u": user, "t": topic}).fetchone()
        assert row is not None
        if not row[0] and row[1] >= self.max_user_topics:
            raise LimitError(
                f"user {user or '(local)'!r} already has {row[1]} messaging topics in use, the limit "
                "([limits] max_topics_per_user); let pullers drain queues or close subscriptions"
            )

    def _check_bytes(self, c: Conn, user: str, n: int) -> None:
        """LimitError if ``n`` more bytes would pass the user's ``max_user_bytes``."""
        if self.max_user_bytes is None or n <= 0:
            return
        row = c.execute(_USER_BYTES, {"u": user}).fetchone()
        have = int(row[0]) if row else 0
        if have + n > self.max_user_bytes:
            raise LimitError(
                f"messages waiting for user {user or '(local)'!r} would take {have + n} bytes, more than the limit "
                f"of {self.max_user_bytes} ([limits] max_messaging_bytes_per_user); let pullers and subscribers catch up"
            )

    def _write_held(self, c: Conn, user: str) -> None:
        n = self._held.get(user, 0)
        if n > 0:
            c.execute("INSERT INTO tartlet_msg_held (bus, usr, bytes) VALUES (%s, %s, %s) "
                      "ON CONFLICT (bus, usr) DO UPDATE SET bytes = EXCLUDED.bytes", (self.bus_id, user, n))
        else:
            self._held.pop(user, None)
            c.execute("DELETE FROM tartlet_msg_held WHERE bus = %s AND usr = %s", (self.bus_id, user))

    # -- local pullers ----------------------------------------------------------------------
    def _live(self, key: Key) -> int:
        """Waiting (not cancelled) pullers of ``key`` here; forgets the key at 0."""
        q = self._waiters.get(key)
        if q is None:
            return 0
        while q and q[0].cancelled():
            q.popleft()
        n = sum(1 for f in q if not f.cancelled())
        if not n:
            q.clear()
            del self._waiters[key]
            self._hashes.pop(_topic_hash(key), None)
        return n

    def _pop_live(self, key: Key) -> Future[Message] | None:
        """The oldest waiting puller of ``key``, now running (not cancellable)."""
        q = self._waiters.get(key)
        while q:
            fut = q.popleft()
            if fut.set_running_or_notify_cancel():
                return fut
        return None

    def _write_pullers(self, c: Conn, key: Key) -> None:
        n = self._live(key)
        if n:
            c.execute("INSERT INTO tartlet_msg_pullers (bus, usr, topic, n) VALUES (%s, %s, %s, %s) "
                      "ON CONFLICT (bus, usr, topic) DO UPDATE SET n = EXCLUDED.n", (self.bus_id, *key, n))
        else:
            c.execute("DELETE FROM tartlet_msg_pullers WHERE bus = %s AND usr = %s AND topic = %s", (self.bus_id, *key))

    def _sync_pullers(self, key: Key) -> None:
        """Write the count of ``key``'s waiting pullers; a failure is logged
        (it is only accounting; the next write of the key repairs it)."""
        try:
            self._db(lambda c: self._write_pullers(c, key))
        except MessagingError as e:
            log.warning("messaging: cannot record the pullers of a topic: %s", e)

    def _dispatch(self, key: Key) -> None:
        """Claim queued messages of ``key`` for its waiting pullers here,
        oldest first, until either runs out (under the lock)."""
        while self._live(key):
            taken: list[Future[Message]] = []  # the waiter served, once popped

            def claim(c: Conn) -> Message | None:
                with c.transaction():
                    row = c.execute(_CLAIM, key).fetchone()
                    if row is None:
                        return None
                    fut = self._pop_live(key)
                    if fut is None:
                        raise psycopg.Rollback()  # nobody here wants it any more: leave it queued
                    taken.append(fut)
                    is_bytes, body, size = row
                    c.execute("UPDATE tartlet_msg_topics SET waiting = waiting - 1, bytes = bytes - %s "
                              "WHERE usr = %s AND topic = %s", (size, *key))
                    c.execute("DELETE FROM tartlet_msg_topics WHERE usr = %s AND topic = %s AND waiting <= 0", key)
                    self._write_pullers(c, key)
                    msg = _decode(is_bytes, body)
                if not taken:  # rolled back: others skipped the locked row, let them retry
                    c.execute("SELECT pg_notify(%s, %s)", (CHANNEL, _topic_hash(key)))
                    self._write_pullers(c, key)
                return msg if taken else None

            try:
                got = self._db(claim)
            except BaseException as e:
                for fut in taken:  # claimed, then the commit failed: the row is back, this pull fails
                    fut.set_exception(e if isinstance(e, Exception) else MessagingError("messaging was interrupted"))
                raise
            if got is None:
                return
            taken[0].set_result(got)

    # -- queue topics -----------------------------------------------------------------------
    def push(self, user: str, topic: str, msg: Message) -> None:
        """Queue ``msg`` on ``topic`` for exactly one puller, in any process
        (a puller waiting in this process gets it at once).

        Raises:
            MessagingError: bad topic/message, the topic already holds
                :data:`~tartlet.host.messaging.MAX_BACKLOG` messages, a
                database failure, a closed bus.
            LimitError: the user's waiting messages would pass
                ``max_user_bytes``, or a new topic would pass ``max_user_topics``.
        """
        size = check(topic, msg)
        _no_nul(user, topic)
        key = (user, topic)
        body, is_bytes = _encode(msg)
        with self._lock:
            if self._closed:
                raise MessagingError("the message bus is closed")
            fut = self._pop_live(key)
            if fut is not None:
                fut.set_result(msg)
                self._sync_pullers(key)
                return

            def insert(c: Conn) -> None:
                with c.transaction():
                    self._lock_user(c, user)
                    row = c.execute("SELECT waiting FROM tartlet_msg_topics WHERE usr = %s AND topic = %s", key).fetchone()
                    if row is None:
                        self._check_topic(c, user, topic)
                    elif row[0] >= MAX_BACKLOG:
                        raise MessagingError(f"queue topic {topic!r} already holds {MAX_BACKLOG} undelivered messages")
                    self._check_bytes(c, user, size)
                    c.execute("INSERT INTO tartlet_msg_queue (usr, topic, is_bytes, body, size) VALUES (%s, %s, %s, %s, %s)",
                              (user, topic, is_bytes, body, size))
                    c.execute("INSERT INTO tartlet_msg_topics (usr, topic, waiting, bytes) VALUES (%s, %s, 1, %s) "
                              "ON CONFLICT (usr, topic) DO UPDATE SET waiting = tartlet_msg_topics.waiting + 1, "
                              "bytes = tartlet_msg_topics.bytes + EXCLUDED.bytes", (user, topic, size))
                    c.execute("SELECT pg_notify(%s, %s)", (CHANNEL, _topic_hash(key)))

            self._db(insert)

    def pull(self, user: str, topic: str) -> Future[Message]:
        """A future of the next message pushed on ``topic`` by any process
        (FIFO); it resolves at once when one is queued.

        Raises:
            MessagingError: bad topic, a database failure, a closed bus.
            LimitError: a new topic would pass ``max_user_topics``.
        """
        check(topic, "")
        _no_nul(user, topic)
        key = (user, topic)
        fut: Future[Message] = Future()
        with self._lock:
            if self._closed:
                raise MessagingError("the message bus is closed")
            self._waiters.setdefault(key, collections.deque()).append(fut)
            self._hashes[_topic_hash(key)] = key
            try:
                self._dispatch(key)
                if not fut.done():

                    def register(c: Conn) -> None:
                        with c.transaction():
                            self._lock_user(c, user)
                            self._check_topic(c, user, topic)
                            self._write_pullers(c, key)

                    self._db(register)
            except Exception:
                if fut.done():
                    return fut  # it got its message; the failure was about others
                q = self._waiters.get(key)
                if q is not None and fut in q:
                    q.remove(fut)
                self._live(key)
                raise
            return fut

    def cancel_pull(self, fut: Future[Message]) -> None:
        """Forget a pending pull (its instance ended) so no message is lost to it."""
        with self._lock:
            for key, q in list(self._waiters.items()):
                if fut in q:
                    q.remove(fut)
                    if not self._closed:
                        self._sync_pullers(key)
        fut.cancel()

    # -- broadcast topics -------------------------------------------------------------------
    def subscribe(self, user: str, topic: str) -> int:
        """Open a subscription; it receives every later broadcast on ``topic``
        from any process. Its id is unique across processes.

        Raises:
            MessagingError: bad topic, a database failure, a closed bus.
            LimitError: a new topic would pass ``max_user_topics``.
        """
        check(topic, "")
        _no_nul(user, topic)

        def insert(c: Conn) -> int:
            with c.transaction():
                self._lock_user(c, user)
                self._check_topic(c, user, topic)
                row = c.execute("INSERT INTO tartlet_msg_subs (bus, usr, topic) VALUES (%s, %s, %s) RETURNING sid",
                                (self.bus_id, user, topic)).fetchone()
                assert row is not None
                return int(row[0])

        with self._lock:
            sid = self._db(insert)
            self._subs[sid] = _Sub((user, topic))
            return sid

    def _deliver(self, sids: Iterable[int], key: Key, msg: Message, size: int) -> int:
        """Give ``msg`` to this bus's open subscriptions among ``sids`` (of
        ``key``); returns the bytes now held in their mailboxes."""
        held = 0
        for sid in sids:
            sub = self._subs.get(sid)
            if sub is None or sub.key != key:
                continue
            if sub.box.hand_over(msg):
                continue
            if len(sub.box.items) >= MAX_BACKLOG:
                continue  # a subscriber that never reads loses messages, others don't
            sub.box.items.append((msg, size))
            held += size
        return held

    def broadcast(self, user: str, topic: str, msg: Message) -> int:
        """Deliver ``msg`` to every subscription of ``topic`` open (in any
        process) when it is sent; returns how many there were (a
        subscription already holding
        :data:`~tartlet.host.messaging.MAX_BACKLOG` messages misses it).
        This process's subscriptions have it on return, the others' a
        moment later (their listeners deliver it). Should the database
        fail during the call, this process's subscriptions may have it
        while the others do not.

        Raises:
            MessagingError: bad topic/message, a database failure, a closed bus.
            LimitError: the copies that would wait in subscriptions would
                pass ``max_user_bytes`` (then no subscription gets it).
        """
        size = check(topic, msg)
        _no_nul(user, topic)
        key = (user, topic)
        body, is_bytes = _encode(msg)

        def send(c: Conn) -> int:
            with c.transaction():
                self._lock_user(c, user)
                rows = c.execute("SELECT sid, bus FROM tartlet_msg_subs WHERE usr = %s AND topic = %s", key).fetchall()
                if not rows:
                    return 0
                local = [int(sid) for sid, bus in rows if bus == self.bus_id]
                remote = [(int(sid), str(bus)) for sid, bus in rows if bus != self.bus_id]
                boxes = [self._subs[sid].box for sid in local if sid in self._subs]
                holding = sum(1 for b in boxes if not b.waiters and len(b.items) < MAX_BACKLOG)
                self._check_bytes(c, user, size * (holding + len(remote)))
                if remote:
                    buses = sorted({bus for _, bus in remote})
                    row = c.execute(
                        "INSERT INTO tartlet_msg_broadcasts (usr, topic, is_bytes, body, size, sids, buses, pending) "
                        "VALUES (%s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
                        (user, topic, is_bytes, body, size, [sid for sid, _ in remote], buses, len(buses)),
                    ).fetchone()
                    assert row is not None
                    c.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"b{row[0]}"))
                held = self._deliver(local, key, msg, size)
                if held:
                    self._held[user] += held
                    self._write_held(c, user)
                return len(rows)

        with self._lock:
            return self._db(send)

    def _receive(self, bid: int) -> None:
        """Deliver broadcast row ``bid`` to this bus's recipients (listener)."""

        def fetch(c: Conn) -> None:
            with c.transaction():
                row = c.execute("SELECT usr, topic, is_bytes, body, size, sids FROM tartlet_msg_broadcasts "
                                "WHERE id = %s AND %s = ANY(buses)", (bid, self.bus_id)).fetchone()
                if row is None:
                    return
                user, topic, is_bytes, body, size, sids = row
                held = self._deliver(sids, (user, topic), _decode(is_bytes, body), size)
                if held:
                    self._held[user] += held
                    self._write_held(c, user)
                left = c.execute("UPDATE tartlet_msg_broadcasts SET pending = pending - 1 WHERE id = %s RETURNING pending",
                                 (bid,)).fetchone()
                if left is not None and left[0] <= 0:
                    c.execute("DELETE FROM tartlet_msg_broadcasts WHERE id = %s", (bid,))

        self._db(fetch)

    def next(self, sid: int) -> Future[Message]:
        """A future of the subscription's next message.

        Raises:
            MessagingError: unknown (or closed) subscription of this bus, a
                database failure (recording the bytes it frees).
        """
        with self._lock:
            sub = self._subs.get(sid)
            if sub is None:
                raise MessagingError(f"no open subscription {sid}")
            fut: Future[Message] = Future()
            box = sub.box
            if box.items:
                user = sub.key[0]
                msg, size = box.items[0]
                self._held[user] -= size
                try:
                    self._db(lambda c: self._write_held(c, user))
                except MessagingError:
                    self._held[user] += size
                    raise
                box.items.popleft()
                fut.set_result(msg)
            else:
                box.waiters.append(fut)
            return fut

    def unsubscribe(self, sid: int) -> None:
        """Close a subscription: its waiting messages are dropped and its
        pending ``next`` calls raise EOFError. Never raises: a database
        failure is logged and the row deleted at a later heartbeat."""
        with self._lock:
            sub = self._subs.pop(sid, None)
            if sub is None:
                return
            user = sub.key[0]
            self._held[user] -= sum(size for _, size in sub.box.items)
            sub.box.items.clear()
            if not self._closed:

                def delete(c: Conn) -> None:
                    with c.transaction():
                        c.execute("DELETE FROM tartlet_msg_subs WHERE sid = %s", (sid,))
                        self._write_held(c, user)

                try:
                    self._db(delete)
                except MessagingError as e:
                    self._lost_sids.add(sid)
                    log.warning("messaging: cannot close subscription %d in the database (retried later): %s", sid, e)
        sub.box.fail_waiters(EOFError(f"subscription {sid} was closed"))

    # -- inspection -------------------------------------------------------------------------
    def usage(self, user: str) -> dict[str, int]:
        """``bytes`` of waiting messages and ``topics`` with state of ``user``,
        over every bus on the database.

        Raises:
            MessagingError: a database failure, a closed bus.
        """

        def q(c: Conn) -> dict[str, int]:
            b = c.execute(_USER_BYTES, {"u": user}).fetchone()
            t = c.execute(_TOPIC_STATE, {"u": user, "t": ""}).fetchone()
            return {"bytes": int(b[0]) if b else 0, "topics": int(t[1]) if t else 0}

        with self._lock:
            return self._db(q)

    def counts(self) -> dict[str, int]:
        """``topics`` (queue topics with queued messages or waiting pullers)
        and ``subscriptions`` open, over every bus on the database.

        Raises:
            MessagingError: a database failure, a closed bus.
        """

        def q(c: Conn) -> dict[str, int]:
            row = c.execute("""SELECT
                (SELECT count(*) FROM (SELECT usr, topic FROM tartlet_msg_topics
                                       UNION SELECT usr, topic FROM tartlet_msg_pullers) t),
                (SELECT count(*) FROM tartlet_msg_subs)""").fetchone()
            assert row is not None
            return {"topics": int(row[0]), "subscriptions": int(row[1])}

        with self._lock:
            return self._db(q)

    # -- the listener thread ----------------------------------------------------------------
    def _on_notify(self, payload: str) -> None:
        with self._lock:
            if self._closed:
                return
            if payload.startswith("q"):
                key = self._hashes.get(payload)
                if key is not None:
                    self._dispatch(key)
            elif payload.startswith("b") and payload[1:].isdigit():
                self._receive(int(payload[1:]))

    def _heartbeat(self) -> None:
        """Mark this bus alive (registering it again if it was taken for
        dead), delete dead buses and old broadcast rows, retry failed
        unsubscribes, and claim for the waiting pullers."""

        def beat(c: Conn) -> None:
            with c.transaction():
                cur = c.execute("UPDATE tartlet_msg_buses SET seen = now() WHERE bus = %s", (self.bus_id,))
                if cur.rowcount == 0:
                    log.warning("messaging: bus %s was taken for dead (no heartbeat for %ss); registering it again",
                                self.bus_id, self._stale_s)
                    c.execute("INSERT INTO tartlet_msg_buses (bus) VALUES (%s)", (self.bus_id,))
                    for sid, sub in self._subs.items():
                        c.execute("INSERT INTO tartlet_msg_subs (sid, bus, usr, topic) VALUES (%s, %s, %s, %s) "
                                  "ON CONFLICT (sid) DO NOTHING", (sid, self.bus_id, *sub.key))
                    for user in list(self._held):
                        self._write_held(c, user)
                    for key in list(self._waiters):
                        self._write_pullers(c, key)
                c.execute("DELETE FROM tartlet_msg_buses WHERE seen < now() - make_interval(secs => %s)", (self._stale_s,))
                c.execute("DELETE FROM tartlet_msg_broadcasts WHERE created < now() - make_interval(secs => %s)", (self._stale_s,))
                if self._lost_sids:
                    c.execute("DELETE FROM tartlet_msg_subs WHERE sid = ANY(%s)", (sorted(self._lost_sids),))
            self._lost_sids.clear()

        with self._lock:
            if self._closed:
                return
            self._db(beat)
            for key in list(self._waiters):
                self._dispatch(key)

    def _listen_loop(self) -> None:
        next_beat = time.monotonic() + self._heartbeat_s
        while not self._stop.is_set():
            try:
                conn = self._listen_conn
                if conn is None or conn.closed or conn.broken:
                    if conn is not None:
                        conn.close()
                    self._listen_conn = conn = None
                    self._listen_conn = conn = self._open_listener()
                    next_beat = 0.0  # notifications may have been missed: claim for the waiting pullers now
                for n in conn.notifies(timeout=0.2):
                    if self._stop.is_set():
                        break
                    try:
                        self._on_notify(n.payload)
                    except Exception as e:
                        log.warning("messaging: handling notification %r failed: %s", n.payload[:40], e)
                if time.monotonic() >= next_beat and not self._stop.is_set():
                    next_beat = time.monotonic() + self._heartbeat_s
                    self._heartbeat()
            except Exception as e:
                log.warning("messaging: the PostgreSQL listener failed (retrying): %s", describe(self._url, e))
                self._stop.wait(1.0)
        if self._listen_conn is not None:
            self._listen_conn.close()
            self._listen_conn = None

    # -- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the listener thread, remove this bus's subscriptions, pullers
        and held bytes from the database (best effort) and close the
        connections. Waiting ``pull`` and ``next`` futures fail with
        MessagingError; later calls raise MessagingError. Messages already
        queued on queue topics stay for the other processes. Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        with self._lock:
            if self._closed:
                return
            try:
                self._db(lambda c: c.execute("DELETE FROM tartlet_msg_buses WHERE bus = %s", (self.bus_id,)))
            except MessagingError as e:
                log.warning("messaging: cannot remove bus %s from the database (other buses will after %ss): %s",
                            self.bus_id, self._stale_s, e)
            self._closed = True
            err = MessagingError("the message bus was closed (the server is shutting down)")
            waiters = [f for q in self._waiters.values() for f in q]
            self._waiters.clear()
            self._hashes.clear()
            subs = list(self._subs.values())
            self._subs.clear()
            self._held.clear()
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        for fut in waiters:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(err)
        for sub in subs:
            sub.box.fail_waiters(err)
