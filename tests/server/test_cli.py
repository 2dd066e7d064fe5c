"""The ``tartlet`` console script, run as a user runs it, and its argument parser.

Only three subprocesses load the model (each takes ~10 s); the others fail
or finish before any model is loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tartlet.cli.args import ArgsError, infer_value, parse_inferlet_args

TARTLET = Path(sys.executable).with_name("tartlet")
QUESTION = "What is the capital of France?"


def tartlet(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the console script; wide COLUMNS keeps rich from wrapping messages."""
    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}
    return subprocess.run([str(TARTLET), *argv], capture_output=True, text=True, timeout=timeout, env=env)


def flat(text: str) -> str:
    return " ".join(text.split())


def test_console_script_is_installed():
    assert TARTLET.is_file() and os.access(TARTLET, os.X_OK)


@pytest.mark.slow
def test_run_text_completion():
    p = tartlet("run", "text-completion", "--stats", "--", "--prompt", QUESTION, "--max-tokens", "16")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "The capital of France is Paris."
    stats = flat(p.stderr)  # --stats: the weights as held and how they multiply, peak memory
    from tartlet.engine.kernels import quant_kernels

    kern = quant_kernels.load()
    products = ("integer products at every row count (16-row layout)" if kern is not None and kern.best_isa == 3
                else "float32 products from 8 rows")
    assert f"weights 92.1 MiB (Q4_1 x 120, Q8_0 x 1; {products})" in stats, stats
    assert "peak RSS" in stats and "model loaded in" in stats and "KV pool float16" in stats, stats  # kv_dtype auto: float16 pages for quantized weights


@pytest.mark.slow
def test_run_json_output():
    p = tartlet("run", "text-completion", "--json", "--", "--prompt", QUESTION, "--max-tokens", "16")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0] == "The capital of France is Paris."  # streamed first
    res = json.loads(lines[-1])
    assert res["text"] == "The capital of France is Paris."
    assert res["finish_reason"] == "eos"
    assert res["tokens"] and all(isinstance(t, int) for t in res["tokens"])


@pytest.mark.slow
def test_run_failing_inferlet_exits_1():
    p = tartlet("run", "text-completion", "--", "--prompt", QUESTION, "--temperature", "-1")
    assert p.returncode == 1, (p.stdout, p.stderr)
    err = flat(p.stderr)
    assert "inferlet text-completion failed" in err and "temperature must be >= 0" in err


@pytest.mark.slow
def test_unknown_inferlet_exits_2():
    p = tartlet("run", "no-such-inferlet", "--", "--prompt", "hi")
    assert p.returncode == 2
    err = flat(p.stderr)
    assert "unknown inferlet 'no-such-inferlet'" in err and "text-completion" in err


@pytest.mark.slow
def test_bad_inferlet_args_exit_2():
    p = tartlet("run", "text-completion", "--", "prompt", "hi")
    assert p.returncode == 2
    assert "expected --key, got 'prompt'" in flat(p.stderr)
    p = tartlet("run", "text-completion", "--", "--stop", "[oops")
    assert p.returncode == 2
    assert "looks like JSON but does not parse" in flat(p.stderr)


@pytest.mark.slow
def test_unknown_model_exits_2():
    p = tartlet("run", "text-completion", "--model", "no-such-model", "--", "--prompt", "hi")
    assert p.returncode == 2
    err = flat(p.stderr)
    assert "unknown model 'no-such-model'" in err and "smollm2-135m-instruct" in err


@pytest.mark.slow
def test_model_list_shows_default_model_downloaded():
    p = tartlet("model", "list")
    assert p.returncode == 0, p.stderr
    row = next((line for line in p.stdout.splitlines() if "smollm2-135m-instruct" in line), None)
    assert row is not None, p.stdout
    assert "yes" in row.split() or "│ yes" in row


@pytest.mark.slow
def test_inferlets_lists_text_completion():
    p = tartlet("inferlets")
    assert p.returncode == 0, p.stderr
    names = [line.split()[0] for line in p.stdout.splitlines() if line.strip()]
    assert "text-completion" in names


@pytest.mark.slow
def test_inferlet_arguments_are_documented_without_loading_a_model():
    """`tartlet run NAME -- --help` and `tartlet inferlets NAME` print the
    inferlet's documented arguments; every bundled inferlet documents them
    and takes its main input as `prompt`."""
    p = tartlet("run", "text-completion", "--", "--help")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("text-completion: Answer a prompt") and "prompt (str, required)" in p.stdout
    from tartlet.runtime.program import list_programs

    for name, prog in list_programs().items():
        doc = prog.usage()
        assert "Args:" in doc, name
        if name not in ("chat", "prefix-cache", "adapter-tune"):  # turns / system + questions / examples are their inputs
            assert "prompt (str, required)" in doc, name
    p = tartlet("inferlets", "json-output")
    assert p.returncode == 0 and "alias: ``question``" in p.stdout
    p = tartlet("inferlets", "no-such-inferlet")
    assert p.returncode == 2 and "unknown inferlet 'no-such-inferlet'" in p.stderr


# -- argument parsing ----------------------------------------------------------------


def test_parse_values():
    args = parse_inferlet_args([
        "--max-tokens", "32", "--temperature", "0.7", "--stream", "true", "--raw", "False",
        "--stop", '["\\n", "END"]', "--meta", '{"a": [1, 2]}', "--prompt", "Hello world", "--none", "null",
    ])
    assert args == {
        "max_tokens": 32, "temperature": 0.7, "stream": True, "raw": False,
        "stop": ["\n", "END"], "meta": {"a": [1, 2]}, "prompt": "Hello world", "none": None,
    }
    assert type(args["max_tokens"]) is int and type(args["temperature"]) is float


def test_parse_flags_and_equals():
    assert parse_inferlet_args(["--verbose", "--k=5", "--name=a=b", "--last"]) == {
        "verbose": True, "k": 5, "name": "a=b", "last": True}
    assert parse_inferlet_args(["--empty="]) == {"empty": ""}
    assert parse_inferlet_args([]) == {}


def test_parse_negative_numbers_and_empty_values():
    assert parse_inferlet_args(["--offset", "-3", "--temperature", "-0.5", "--x", "-1e-3"]) == {
        "offset": -3, "temperature": -0.5, "x": -0.001}
    assert parse_inferlet_args(["--system", "", "--prompt", "hi"]) == {"system": "", "prompt": "hi"}


def test_words_that_look_numeric_stay_strings():
    for word in ("nan", "inf", "-Infinity", "1_000", " 3", "0x10", "3 apples", "v1.2"):
        assert infer_value(word) == word, word
    assert infer_value("1e3") == 1000.0 and infer_value(".5") == 0.5 and infer_value("+7") == 7


@pytest.mark.parametrize(("words", "msg"), [
    (["prompt", "hi"], "expected --key, got 'prompt'"),
    (["--", "x"], "expected --key, got '--'"),
    (["--a", "1", "2"], "expected --key, got '2'"),
    (["--stop", "[1, 2"], "looks like JSON but does not parse"),
    (["--cfg={bad"], "looks like JSON but does not parse"),
])
def test_parse_errors(words, msg):
    with pytest.raises(ArgsError, match=msg.replace("[", r"\[")):
        parse_inferlet_args(words)
