"""A client that hangs up aborts its OpenAI request, streamed or not, while
tokens are flowing (docs/server.md, "Disconnects"): checked on the engine's
own token counter and the server's instance count, not on wall time."""

from __future__ import annotations

import json
import socket
import time

import pytest

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(noauth_server):
    yield noauth_server
    noauth_server.wait_pages_free()


def tokens_generated(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = server.get("/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == "tartlet_tokens_generated"
               for s in fam.samples if s.name == "tartlet_tokens_generated_total")


def wait_idle(server, timeout: float = 10) -> None:
    deadline = time.time() + timeout
    while server.get("/health").json()["running_instances"] and time.time() < deadline:
        time.sleep(0.05)


def test_non_streaming_request_is_aborted_when_its_client_hangs_up(server):
    """A non-streaming chat request asked for 4000 tokens (EOS ignored):
    the client hangs up once tokens are flowing; the instance ends and the
    engine stops generating long before 4000 tokens."""
    wait_idle(server)
    before = tokens_generated(server)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 4000,
            "ignore_eos": True}
    host, port = server.url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head + data)
        deadline = time.time() + 60
        while tokens_generated(server) - before < 20:  # no answer comes before the end: wait until tokens flow
            assert time.time() < deadline, "no tokens were generated"
            time.sleep(0.05)
    # hung up
    wait_idle(server)
    assert server.get("/health").json()["running_instances"] == 0, "the request kept running after its client left"
    stopped_at = tokens_generated(server) - before
    time.sleep(0.5)
    assert tokens_generated(server) - before == stopped_at  # nothing generates any more
    assert 20 <= stopped_at < 4000
    server.wait_pages_free()
