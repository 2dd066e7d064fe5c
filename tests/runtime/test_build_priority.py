"""A componentize-py build runs at a lower CPU priority than the server
(issue 40: one user's build loop must not take the CPU the model thread and
event loop need for everyone)."""

from __future__ import annotations

import os
import subprocess
import textwrap

from tartlet.runtime import builder

FAKE_COMPONENTIZE = '''
import os, sys

def script():
    out = sys.argv[sys.argv.index("-o") + 1]
    with open(out, "wb") as f:
        f.write(b"\\0asm nice=%d" % os.nice(0))
'''


def test_builds_run_niced(tmp_path, monkeypatch):
    monkeypatch.setenv("TARTLET_CACHE_DIR", str(tmp_path / "cache"))
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "componentize_py.py").write_text(FAKE_COMPONENTIZE)
    real_run = subprocess.run

    def run(cmd, **kw):  # the real build command, with a stand-in componentize-py
        kw["env"] = {**kw["env"], "PYTHONPATH": str(fake)}
        return real_run(cmd, **kw)

    monkeypatch.setattr(builder.subprocess, "run", run)
    src = tmp_path / "hello.py"
    src.write_text(textwrap.dedent("async def main(args):\n    return 1\n"))
    out = builder.build(src, tmp_path / "hello.wasm", force=True)
    nice = int(out.read_bytes().split(b"nice=")[1])
    assert nice == min(19, os.nice(0) + builder.BUILD_NICE)
