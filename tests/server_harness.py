"""Helpers for tests that drive a real ``tartlet serve`` process on loopback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TARTLET = [sys.executable, "-m", "tartlet.cli.main"]


def cli(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``tartlet ARGS`` as a subprocess; returns the completed process (text)."""
    return subprocess.run(
        TARTLET + list(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})}
    )


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
        r = cli("auth", "add", user, "--config", str(config))
        assert r.returncode == 0, r.stderr
        keys[user] = r.stdout.strip()
    return keys


class ServerProcess:
    """``tartlet serve --port 0`` in a subprocess; ``url`` once it listens."""

    def __init__(self, config: Path, *args: str) -> None:
        self.log = open(config.with_suffix(".stderr"), "w")
        self.proc = subprocess.Popen(
            TARTLET + ["serve", "--config", str(config), "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT,
        )
        assert self.proc.stdout is not None
        deadline = time.time() + 240
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

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def write_inferlet(folder: Path, name: str, code: str) -> Path:
    """An inferlet file ``folder/name.py`` from dedented source."""
    folder.mkdir(parents=True, exist_ok=True)
    f = folder / f"{name}.py"
    f.write_text(textwrap.dedent(code))
    return f
