"""docs/architecture.md's layering holds where it was once broken: the
client does not pull in the server (they share tartlet.protocol)."""

from __future__ import annotations

import subprocess
import sys


def test_client_does_not_import_the_server():
    code = "import sys, tartlet.client; print(sorted(m for m in sys.modules if m.startswith('tartlet.server')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"
