"""One error hierarchy (tartlet/sdk/errors.py) for the engine, the host and the SDK.

An inferlet catches the class a host call raises by importing it from the
SDK; the engine and host modules raise that very object, and the WASM
transport carries it as a WIT ``error-code`` that maps back to it.
"""

from __future__ import annotations

import pytest

import tartlet
from tartlet.sdk import errors
from tartlet.sdk.errors import ERROR_CODES, error_code, error_from_code


def test_engine_and_host_raise_the_sdk_classes():
    from tartlet.engine.core import admission, kv_accounting, kv_cache, sampler, scheduler
    from tartlet.engine.text import chat_template
    from tartlet.host import grammar, http, messaging, store
    from tartlet.runtime import program

    assert kv_cache.KvCacheFullError is errors.KvCacheFullError
    assert kv_accounting.KvQuotaError is errors.KvQuotaError
    assert scheduler.SequenceFreedError is errors.SequenceFreedError
    assert admission.ContextLengthError is errors.ContextLengthError
    assert sampler.SamplingError is errors.SamplingError
    assert chat_template.ChatTemplateError is errors.ChatTemplateError
    assert http.HttpError is errors.HttpError
    assert grammar.GrammarError is errors.GrammarError
    assert messaging.MessagingError is errors.MessagingError
    assert store.StoreError is errors.StoreError
    assert program.ProgramError is errors.ProgramError


def test_the_sdk_exports_every_error_class():
    for cls in ERROR_CODES.values():
        if cls.__module__ == "tartlet.sdk.errors":
            assert getattr(tartlet, cls.__name__) is cls
            assert cls.__name__ in tartlet.__all__


def test_bases_keep_coarse_catches_working():
    assert issubclass(errors.SnapshotError, ValueError) and issubclass(errors.SnapshotError, errors.HostError)
    assert issubclass(errors.InvalidHandleError, ValueError)
    assert issubclass(errors.KvQuotaError, errors.KvCacheFullError) and issubclass(errors.KvCacheFullError, RuntimeError)
    assert issubclass(errors.HttpError, RuntimeError)


def test_sdk_sampler_checks_raise_sampling_error():
    with pytest.raises(errors.SamplingError, match="top_p"):
        tartlet.Sampler(top_p=0.0)


@pytest.mark.parametrize("cls", [c for c in ERROR_CODES.values() if c is not Exception])
def test_every_class_survives_the_code_round_trip(cls):
    code, msg = error_code(cls("boom"))
    back = error_from_code(code, msg)
    assert type(back) is cls
    assert str(back) == str(cls("boom"))


def test_a_subclass_without_a_code_travels_as_its_nearest_base():
    class Odd(errors.SnapshotError):
        pass

    assert error_code(Odd("x")) == ("snapshot-error", "Odd: x")
    assert error_code(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"))[0] == "value-error"
    assert error_code(KeyboardInterrupt()) == ("other", "KeyboardInterrupt: ")


def test_an_unknown_code_is_a_host_error_naming_it():
    e = error_from_code("from-a-newer-host", "hello")
    assert type(e) is errors.HostError and "from-a-newer-host" in str(e)


def test_codes_are_the_kebab_case_class_names():
    import re

    for code, cls in ERROR_CODES.items():
        if cls is not Exception:
            assert code == re.sub(r"(?<!^)(?=[A-Z][a-z])", "-", cls.__name__).lower()
    assert list(ERROR_CODES)[-1] == "other"
