"""State shared by server replicas in PostgreSQL (``[store] url``): the
inferlets' key-value store (``PgStore``, the same behaviour as the SQLite
``Store``: the shared tests run on both) and the API keys (``PgKeyStore``),
on a real PostgreSQL server (tests/pg_harness.py)."""

from __future__ import annotations

import threading

import pytest

from server_harness import cli_in_process, write_config
from tartlet.host.store import MAX_KEY_CHARS, MAX_VALUE_BYTES, Store
from tartlet.sdk.errors import StoreError

pytestmark = pytest.mark.slow  # a PostgreSQL server per session (~2 s), a database per test


@pytest.fixture
def pg_url(postgres) -> str:
    return postgres.new_database()


@pytest.fixture(params=["sqlite", "postgres"])
def open_store(request, tmp_path):
    """``open_store(**quota)`` -> a store on the same data each call (both backends)."""
    opened = []
    if request.param == "sqlite":

        def factory(**kw):
            opened.append(Store(tmp_path / "kv.sqlite", **kw))
            return opened[-1]
    else:
        from tartlet.host.pg_store import PgStore

        url = request.getfixturevalue("postgres").new_database()

        def factory(**kw):
            opened.append(PgStore(url, **kw))
            return opened[-1]

    yield factory
    for s in opened:
        s.close()


# -- the same behaviour on SQLite and PostgreSQL ---------------------------------------


def test_semantics(open_store):
    s = open_store()
    s.set("alice", "a/1", "x")
    s.set("alice", "a/2", "y")
    s.set("alice", "b", "z")
    s.set("bob", "a/1", "bob's")
    assert s.get("alice", "a/1") == "x" and s.get("bob", "a/1") == "bob's" and s.get("carol", "a/1") is None
    assert s.keys("alice", "a/") == ["a/1", "a/2"] and s.keys("bob") == ["a/1"] and s.keys("carol") == []
    s.set("alice", "a/1", "x2")
    assert s.get("alice", "a/1") == "x2"
    assert s.delete("alice", "a/1") and not s.delete("alice", "a/1")
    assert s.get("bob", "a/1") == "bob's"  # another user's key of the same name is untouched
    s.set("alice", "empty", "")
    assert s.get("alice", "empty") == ""
    s.close()
    s2 = open_store()  # durable once the call returned
    assert s2.keys("alice") == ["a/2", "b", "empty"] and s2.get("alice", "b") == "z"


def test_keys_sorted_by_code_point_and_prefix_is_literal(open_store):
    s = open_store()
    names = ["a%b", "a_b", "axb", "a%", "abc", "B", "a", "é", "z", "Zeta", "日本"]
    for k in names:
        s.set("u", k, k.upper())
    assert s.keys("u") == sorted(names)  # code point order, not the database's locale
    assert s.keys("u", "a%") == ["a%", "a%b"]  # % and _ are not wildcards
    assert s.keys("u", "a_") == ["a_b"]
    assert s.keys("u", "%") == [] and s.keys("u", "_") == []
    assert s.keys("u", "a") == sorted(k for k in names if k.startswith("a"))
    assert s.keys("u", "日") == ["日本"] and s.keys("u", "é") == ["é"]


def test_bad_input_and_limits(open_store):
    s = open_store()
    for bad in ["", "k" * (MAX_KEY_CHARS + 1), 3, None, "a\ud800b"]:
        for call in (lambda: s.get("u", bad), lambda: s.set("u", bad, "v"), lambda: s.delete("u", bad)):
            with pytest.raises(StoreError):
                call()
    for bad in [3, b"bytes", None, "\udfff"]:
        with pytest.raises(StoreError):
            s.set("u", "k", bad)
    for bad in [3, None, "\ud800"]:
        with pytest.raises(StoreError):
            s.keys("u", bad)
    s.set("u", "k" * MAX_KEY_CHARS, "v")  # the longest key
    big = "é" * (MAX_VALUE_BYTES // 2)  # exactly the limit in UTF-8 bytes (half as many characters)
    s.set("u", "big", big)
    assert s.get("u", "big") == big
    with pytest.raises(StoreError, match="larger than"):
        s.set("u", "big", big + "x")
    assert s.get("u", "big") == big  # a refused set changes nothing
    assert s.keys("u") == ["big", "k" * MAX_KEY_CHARS]


def test_per_user_bytes_and_keys_are_bounded(open_store):
    """Issue 40: one inferlet wrote 400 values of 1 MB; now a user's store
    holds at most max_bytes_per_user bytes and max_keys_per_user keys.
    A refused set writes nothing; replacing or deleting gives room back;
    other users are not affected."""
    from tartlet.sdk.errors import LimitError

    s = open_store(max_bytes_per_user=3000, max_keys_per_user=3)
    s.set("alice", "a", "x" * 1000)  # 1 + 1000 bytes
    s.set("alice", "b", "é" * 500)  # 1 + 1000 bytes of UTF-8
    assert s.usage("alice") == (2002, 2)
    with pytest.raises(LimitError, match=r"max_store_bytes_per_user = 3000"):
        s.set("alice", "c", "y" * 1000)  # 2002 + 1001 > 3000
    assert s.get("alice", "c") is None and s.usage("alice") == (2002, 2)
    s.set("alice", "a", "x" * 1997)  # a replace counts the difference: 2999
    s.set("alice", "a", "small")  # shrinking is always allowed
    s.set("alice", "c", "z")
    with pytest.raises(LimitError, match=r"max_store_keys_per_user = 3"):
        s.set("alice", "d", "1")
    s.set("alice", "c", "replacing an existing key is not a new key")
    s.set("bob", "d", "y" * 2990)  # bob has his own budget
    assert s.delete("alice", "b")
    s.set("alice", "d", "room again")
    assert s.usage("alice") == (1 + 5 + 1 + 42 + 1 + 10, 3)
    s.close()
    again = open_store(max_bytes_per_user=3000, max_keys_per_user=3)  # usage survives a restart
    assert again.usage("alice") == (60, 3) and again.usage("bob") == (2991, 1) and again.usage("carol") == (0, 0)


def test_usage_of_a_store_written_before_it_was_counted(tmp_path):
    import sqlite3

    db = sqlite3.connect(tmp_path / "old.sqlite")
    db.execute("CREATE TABLE kv (user TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL, PRIMARY KEY (user, key))")
    db.executemany("INSERT INTO kv VALUES (?, ?, ?)", [("alice", "k1", "v" * 100), ("alice", "k2", "日本"), ("bob", "k", "")])
    db.commit()
    db.close()
    s = Store(tmp_path / "old.sqlite", max_keys_per_user=2)
    try:
        assert s.usage("alice") == (2 + 100 + 2 + 6, 2) and s.usage("bob") == (1, 1)
        from tartlet.sdk.errors import LimitError

        with pytest.raises(LimitError):
            s.set("alice", "k3", "v")
    finally:
        s.close()


# -- PostgreSQL only --------------------------------------------------------------------


def test_two_replicas_see_each_others_writes(pg_url):
    from tartlet.host.pg_store import PgStore

    a, b = PgStore(pg_url), PgStore(pg_url)  # two servers configured with the same URL
    try:
        a.set("alice", "k", "from a")
        assert b.get("alice", "k") == "from a"
        b.set("alice", "k", "from b")
        b.set("bob", "k", "bob's")
        assert a.get("alice", "k") == "from b" and a.keys("alice") == ["k"] and a.keys("bob") == ["k"]
        assert a.delete("alice", "k") and b.get("alice", "k") is None and not b.delete("alice", "k")
        assert b.get("bob", "k") == "bob's"
    finally:
        a.close()
        b.close()


def test_concurrent_opens_and_threads(pg_url):
    """Replicas starting together create the table once without an error;
    one store serves many threads."""
    from tartlet.host.pg_store import PgStore

    stores: list[PgStore] = []
    errors: list[BaseException] = []

    def open_one():
        try:
            stores.append(PgStore(pg_url))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(stores) == 4
    s = stores[0]

    def work(i: int) -> None:
        for j in range(20):
            s.set(f"user{i}", f"k{j:02d}", str(i * j))
            assert s.get(f"user{i}", f"k{j:02d}") == str(i * j)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(stores[3].keys(f"user{i}") == [f"k{j:02d}" for j in range(20)] for i in range(6))
    for st in stores:
        st.close()


def test_nul_characters_are_refused(pg_url):
    from tartlet.host.pg_store import PgStore

    s = PgStore(pg_url)
    try:
        for call in (lambda: s.set("u", "a\x00b", "v"), lambda: s.set("u", "k", "v\x00"), lambda: s.get("u", "\x00"),
                     lambda: s.keys("u", "\x00")):  # fmt: skip
            with pytest.raises(StoreError, match="NUL"):
                call()
        assert s.keys("u") == []
    finally:
        s.close()


def test_reconnects_after_the_connection_is_lost(pg_url):
    """The backend of the store's connection is terminated (as by a
    PostgreSQL restart): the next call reconnects and succeeds."""
    import psycopg

    from tartlet.host.pg_store import PgStore

    s = PgStore(pg_url)
    try:
        s.set("u", "k", "before")
        for i in range(2):  # and again on the new connection
            pid = s._db.run(lambda c: c.info.backend_pid)
            with psycopg.connect(pg_url, autocommit=True) as admin:
                assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
            if i == 0:
                assert s.get("u", "k") == "before"
            else:
                s.set("u", "k2", "after")
            assert s._db.run(lambda c: c.info.backend_pid) != pid
        assert s.keys("u") == ["k", "k2"]
    finally:
        s.close()
    with pytest.raises(StoreError, match="closed"):
        s.get("u", "k")


def test_unreachable_server_error_has_no_password(tmp_path):
    from tartlet.host.pg import redact
    from tartlet.host.pg_store import PgStore

    for url in [f"postgresql://tartlet:s3cr%40t@/db?host={tmp_path}", f"postgresql:///db?host={tmp_path}&password=s3cr%40t&user=x"]:
        with pytest.raises(StoreError) as e:
            PgStore(url)
        msg = str(e.value)
        assert "cannot connect to PostgreSQL" in msg and "***" in msg
        assert "s3cr" not in msg, msg
        assert "s3cr" not in redact(url)


def test_wrong_password_error_has_no_password(postgres):
    """A connection the server refuses (here: a missing database; the test
    server trusts its socket, so the password is not checked) is reported
    with the server's URL, password redacted."""
    from tartlet.host.pg_store import PgStore

    url = postgres.url.replace("postgres:@", "postgres:hunter2@").replace("/postgres?", "/no_such_db?")
    with pytest.raises(StoreError, match="no_such_db") as e:
        PgStore(url)
    assert "hunter2" not in str(e.value) and "postgres:***@" in str(e.value)


# -- API keys -------------------------------------------------------------------------


def test_api_keys_in_postgres_shared_by_servers(tmp_path, pg_url):
    """``tartlet auth add --config FILE`` with ``[store] url`` writes to
    PostgreSQL; a second key store (another replica) and the server's
    authenticate see the key without a restart; remove revokes it everywhere."""
    from tartlet.host.state import HostState
    from tartlet.server.auth import AuthError, KeyStore, PgKeyStore, key_store
    from tartlet.server.config import load_config
    from tartlet.server.service import Service

    config = write_config(tmp_path / "config.toml", tmp_path / "data", f'[store]\nurl = "{pg_url}"\n')
    cfg = load_config(config)
    replica = key_store(cfg)  # opened before the key exists
    assert isinstance(replica, PgKeyStore)
    service = Service(cfg, HostState())
    try:
        r = cli_in_process("auth", "add", "alice", "--config", str(config))
        assert r.returncode == 0, r.stderr
        key = r.stdout.strip()
        assert key.startswith("tk_")
        assert replica.user_of(key) == "alice" and service.authenticate(key) == "alice"
        assert not (tmp_path / "data" / "keys.json").exists()  # not in the keys file
        bob = cli_in_process("auth", "add", "bob", "--config", str(config)).stdout.strip()
        listed = cli_in_process("auth", "list", "--config", str(config)).stdout
        assert "alice" in listed and "bob" in listed and key[:7] in listed and key not in listed
        assert sorted(e["user"] for e in replica.list()) == ["alice", "bob"]
        # only hashes are stored
        rows = replica._db.run(lambda c: c.execute("SELECT sha256, username, prefix FROM tartlet_api_keys").fetchall())
        assert key not in str(rows) and bob not in str(rows) and len(rows) == 2
        for k in (None, "", "tk_" + "0" * 32):
            with pytest.raises(AuthError):
                service.authenticate(k)
        assert cli_in_process("auth", "remove", "alice", "--config", str(config)).returncode == 0
        with pytest.raises(AuthError, match="invalid"):
            replica.user_of(key)
        with pytest.raises(AuthError):
            service.authenticate(key)
        assert service.authenticate(bob) == "bob"
        r = cli_in_process("auth", "remove", bob[:7], "--config", str(config))  # by prefix
        assert r.returncode == 0 and "removed 1" in r.stdout
        assert cli_in_process("auth", "remove", "bob", "--config", str(config)).returncode == 1
        assert replica.list() == []
        r = cli_in_process("auth", "add", "bad name", "--config", str(config))
        assert r.returncode == 2 and "user names" in r.stderr
    finally:
        replica.close()
        service.keys.close()
    assert isinstance(key_store(load_config(write_config(tmp_path / "plain.toml", tmp_path / "data"))), KeyStore)


def test_auth_cli_reports_an_unreachable_database(tmp_path):
    config = write_config(tmp_path / "config.toml", tmp_path / "data", f'[store]\nurl = "postgresql://u:pw123@/db?host={tmp_path}"\n')
    for args in (["add", "alice"], ["list"], ["remove", "alice"]):
        r = cli_in_process("auth", *args, "--config", str(config))
        assert r.returncode == 2 and "cannot connect to PostgreSQL" in r.stderr and "pw123" not in r.stderr, r.stderr


STORE = """
from tartlet.sdk import store
async def main(args):
    if args.get("set"):
        for k, v in args["set"].items():
            store.set(k, v)
    return {"keys": store.keys(args.get("prefix", "")), "value": store.get(args.get("get", "none"), "missing")}
"""


async def test_server_on_postgres_shares_store_and_keys(tmp_path, pg_url):
    """A server on ``[store] url`` (load_state opens PgStore, Service a
    PgKeyStore): a key added through another replica's config works, and
    what its inferlets store another replica reads and writes, per user."""
    from server_harness import InProcessServer, write_inferlet
    from tartlet.client import Client
    from tartlet.host.pg_store import PgStore

    configs = [write_config(tmp_path / f"r{i}.toml", tmp_path / f"data{i}", f'[store]\nurl = "{pg_url}"\n') for i in (0, 1)]
    keys = {u: cli_in_process("auth", "add", u, "--config", str(configs[1])).stdout.strip() for u in ("alice", "bob")}
    prog = write_inferlet(tmp_path / "progs", "kv", STORE)

    async def run(server, user, args):
        async with await Client.connect(server.url, keys[user]) as c:
            ex = await (await c.launch(prog, args)).wait()
        assert ex.ok, ex.error
        return ex.result

    server = InProcessServer(configs[0])
    other = PgStore(pg_url)  # the store of a second replica
    try:
        assert isinstance(server.state.store, PgStore)
        r = await run(server, "alice", {"set": {"notes/1": "first", "notes/2": "second"}, "get": "notes/1"})
        assert r == {"keys": ["notes/1", "notes/2"], "value": "first"}
        assert other.keys("alice", "notes/") == ["notes/1", "notes/2"] and other.keys("bob") == []
        other.set("alice", "notes/3", "from the other replica")
        assert (await run(server, "alice", {"prefix": "notes/3", "get": "notes/3"})) == {"keys": ["notes/3"], "value": "from the other replica"}
        assert (await run(server, "bob", {"get": "notes/1"})) == {"keys": [], "value": "missing"}
    finally:
        other.close()
        server.stop()
    assert not (tmp_path / "data0" / "store.sqlite").exists()
