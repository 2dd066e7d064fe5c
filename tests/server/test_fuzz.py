"""Fuzzed input against a real ``tartlet serve`` (benchmarks/fuzz_server.py,
issue 40): a short seeded run gets no ``internal`` error, no 5xx, no server
path or exception class name in an error, and a 1009 close for every
over-size frame; and the base64 fields it found failing (text outside
ASCII raised ``ValueError`` past the handlers: ``internal``) are clean
``bad_request`` errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tartlet.protocol import ProtocolError, decode_b64

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value", ["é9==", "AA\x00A", "!!!!", "A", 5, None, ["AAAA"]])
def test_bad_base64_is_a_bad_request_naming_the_field(value):
    with pytest.raises(ProtocolError) as e:
        decode_b64(value, "`data_b64`")
    assert e.value.code == "bad_request" and "`data_b64`" in str(e.value)


def test_base64_decodes():
    assert decode_b64("aGk=", "x") == b"hi" and decode_b64("", "x") == b""


@pytest.mark.slow
def test_a_seeded_fuzz_run_finds_nothing():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fuzz_server.py"), "--frames", "2000", "--bodies", "300",
                        "--oversize-every", "400", "--seed", "7"], capture_output=True, text=True, cwd=ROOT, timeout=900)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("JSON: ")), None)
    assert line is not None, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(line[len("JSON: "):])
    c = res["counts"]
    assert res["violations"] == [] and r.returncode == 0, res["violations"]
    assert c["ws frames"] == 2000 and c["http bodies"] == 300 and res["server_alive"]
    assert c["ws over-size frames"] == c["ws over-size closed 1009"] == 5
    assert res["tracebacks_in_log"] == 0
