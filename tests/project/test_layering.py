"""docs/architecture.md's layering holds where it was once broken: the
client does not pull in the server (they share tartlet.protocol)."""

from __future__ import annotations

import subprocess
import sys


def test_client_does_not_import_the_server():
    code = "import sys, tartlet.client; print(sorted(m for m in sys.modules if m.startswith('tartlet.server')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"


def test_single_process_server_does_not_import_psycopg_or_ray(tmp_path):
    """psycopg (``[store] url``) and Ray (``--replicas``) are imported only
    on their paths: the server modules, the CLI and a Service with the
    default config (SQLite store, keys file) import neither."""
    code = (
        "import sys\n"
        "import tartlet.cli.main, tartlet.server.app, tartlet.server.auth, tartlet.host.api, tartlet.host.store\n"
        "from tartlet.host.state import HostState\n"
        "from tartlet.server.config import ServerConfig\n"
        "from tartlet.server.service import Service\n"
        f"Service(ServerConfig(data_dir={str(tmp_path)!r}), HostState()).keys.list()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('psycopg', 'psycopg_c', 'psycopg_binary', 'ray')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
