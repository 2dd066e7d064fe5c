"""Helpers for tests that drive a Tartlet server on loopback: a real
``tartlet serve`` process (:class:`ServerProcess`), or the same server run
in the test process (:class:`InProcessServer`), which skips a Python start,
the imports and a model load per server."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
TARTLET = [sys.executable, "-m", "tartlet.cli.main"]


def cli(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``tartlet ARGS`` as a subprocess; returns the completed process (text)."""
    return subprocess.run(
        TARTLET + list(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})}
    )


def cli_in_process(*args: str) -> subprocess.CompletedProcess:
    """``tartlet ARGS`` run by the same typer app in this process (typer's
    CliRunner): for setup steps (``auth add``, ``install``) whose interpreter
    start and imports (~3 s of CPU each) a test does not check."""
    from typer.testing import CliRunner

    from tartlet.cli.main import app

    r = CliRunner().invoke(app, list(args), env={"COLUMNS": "400", "NO_COLOR": "1"})
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return subprocess.CompletedProcess(["tartlet", *args], r.exit_code, r.stdout, r.stderr)


def write_config(path: Path, data_dir: Path, extra: str = "") -> Path:
    """A small server config: the default model with a 64 MiB page pool."""
    path.write_text(
        f'data_dir = "{data_dir}"\n'
        + textwrap.dedent(extra)
        + '\n[[models]]\nmodel = "smollm2-135m-instruct"\nkv_cache_mb = 64\nthreads = 2\n'
    )
    return path


def add_users(config: Path, *users: str) -> dict[str, str]:
    """``tartlet auth add`` each user; returns ``{user: key}``."""
    keys = {}
    for user in users:
        r = cli_in_process("auth", "add", user, "--config", str(config))
        assert r.returncode == 0, r.stderr
        keys[user] = r.stdout.strip()
    return keys


class _Server:
    """What tests use of a server: ``url``, ``log`` (its log file), GET, pages."""

    url: str
    log: Any

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kw)

    def pages(self, state: str = "used") -> int:
        """KV pages in ``state`` (used, cached, free), read from /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        text = self.get("/metrics").text
        values = [s.value for fam in text_string_to_metric_families(text) if fam.name == "tartlet_kv_pages"
                  for s in fam.samples if s.labels.get("state") == state]
        assert values, text
        return int(values[0])

    def wait_pages_free(self, timeout: float = 30) -> None:
        """Wait until no KV page is in use (every instance ended and freed)."""
        deadline = time.time() + timeout
        while self.pages("used") and time.time() < deadline:
            time.sleep(0.2)
        assert self.pages("used") == 0, "KV pages still in use: a page leaked"


class ServerProcess(_Server):
    """``tartlet serve --port 0`` in a subprocess; ``url`` once it listens.

    ``new_session``: run it in a session (process group) of its own, and
    after its exit kill whatever is left of that group by the group's id
    (``--replicas``: the Ray processes it started). ``env``: variables
    added to this process's environment."""

    def __init__(self, config: Path, *args: str, new_session: bool = False, env: dict[str, str] | None = None,
                 start_timeout: float = 240, stop_timeout: float = 20) -> None:  # fmt: skip
        self.log = open(config.with_suffix(".stderr"), "w")
        self.new_session = new_session
        self.stop_timeout = stop_timeout
        self.proc = subprocess.Popen(
            TARTLET + ["serve", "--config", str(config), "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT, start_new_session=new_session,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        assert self.proc.stdout is not None
        deadline = time.time() + start_timeout
        line = ""
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = re.search(r"serving on (http://[\d.]+:\d+)", line)
            if m:
                self.url = m.group(1)
                return
        self.stop()
        raise RuntimeError(f"server did not start: {line!r}; see {self.log.name}: {Path(self.log.name).read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.new_session:
            try:  # what outlived it in its group
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()


class InProcessServer(_Server):
    """The server ``tartlet serve --config CONFIG --port 0 [--no-auth]`` runs
    (same config file, :func:`~tartlet.server.app.load_state`, Service, app
    and uvicorn settings), on a loopback socket served by a thread of the
    test process. Clients talk real HTTP (the sync OpenAI client, streaming,
    disconnects), as to the subprocess; the ``tartlet`` log lines the
    server's thread writes (access log, warnings, 500 tracebacks) go to
    ``log``, as the subprocess's stderr does."""

    def __init__(self, config: Path, auth: bool = True) -> None:
        from tartlet.server.app import http_server, listen_socket, load_state, run_http
        from tartlet.server.config import load_config
        from tartlet.server.service import Service

        cfg = load_config(config)
        self.log = open(config.with_suffix(".log"), "w")
        self._handler = logging.StreamHandler(self.log)
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        # only the server's records (its event loop thread), not the test's own
        self._handler.addFilter(lambda record: record.thread == getattr(self.__dict__.get("_thread"), "ident", None))
        logging.getLogger("tartlet").addHandler(self._handler)  # warnings and errors (500 tracebacks) ...
        access = logging.getLogger("tartlet.access")
        self._access_level = access.level
        access.setLevel(logging.INFO)  # ... and the access log, as `tartlet serve` writes to stderr
        self.state = load_state(cfg)
        self.service = Service(cfg, self.state, auth=auth)
        sock = listen_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = http_server(cfg, self.service)
        self._thread = threading.Thread(
            target=asyncio.run, args=(run_http(self._server, sock, self.service),), name="tartlet-server", daemon=True
        )
        self._thread.start()
        deadline = time.time() + 60
        while not self._server.started:
            assert self._thread.is_alive() and time.time() < deadline, "the in-process server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        from tartlet.server.app import close_state

        if self._thread.is_alive():
            self._server.should_exit = True
            self._thread.join(30)
        close_state(self.state)
        logging.getLogger("tartlet").removeHandler(self._handler)
        logging.getLogger("tartlet.access").setLevel(self._access_level)
        self.log.close()


def write_inferlet(folder: Path, name: str, code: str) -> Path:
    """An inferlet file ``folder/name.py`` from dedented source."""
    folder.mkdir(parents=True, exist_ok=True)
    f = folder / f"{name}.py"
    f.write_text(textwrap.dedent(code))
    return f
