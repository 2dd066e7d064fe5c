"""The WIT contract (wit/tartlet.wit) and the host API must not drift apart.

Every public method of :class:`tartlet.host.api.HostApi` needs a function of
the same name (kebab-case) in one of the WIT's interfaces, and every WIT function
needs a HostApi method, except the explicit allow-lists below. The host's
import table (tartlet.runtime.wasm_host.IMPORTS) and the guest binding
(tartlet/_wasm_binding.py, parsed, since it only imports inside a
component) must cover the same functions.

Types are compared too: each WIT function's parameter and result types,
mapped to Python by :func:`py_type` (the few JSON-text parameters by
:data:`JSON_TEXT`), must equal the annotations of the HostApi method and of
the guest binding's method; the host's result mode (how wasmtime-py is
handed the ``result``) must fit the WIT result type; and the ``error-code``
enum must list :data:`tartlet.sdk.errors.ERROR_CODES` in order.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from tartlet.host.api import HostApi
from tartlet.sdk.errors import ERROR_CODES

ROOT = Path(__file__).resolve().parents[2]
WIT = ROOT / "wit" / "tartlet.wit"

#: HostApi methods that are not inferlet calls: lifecycle and limit hooks
#: the runtimes call themselves.
NATIVE_ONLY = {
    "close",  # the runtime ends the instance
    "close_io",  # the runtime ends the instance's I/O
}
#: WIT functions with no HostApi method: the WASM transport of futures.
WIT_ONLY = {"wait-any", "future-take", "future-drop"}


#: The package's interfaces that hold functions, in the WIT's order; their
#: shared types are interface ``types``.
FUNCTION_INTERFACES = ["model", "context", "inference", "grammar", "io"]


def wit_interfaces() -> dict[str, str]:
    """Interface name -> its body, every interface of the WIT."""
    text = WIT.read_text()
    return {m[1]: m[2] for m in re.finditer(r"^interface ([a-z][a-z0-9-]*) \{(.*?)^\}", text, re.S | re.M)}


def wit_function_interfaces() -> dict[str, str]:
    """WIT function name -> the interface declaring it."""
    out = {}
    for iface, body in wit_interfaces().items():
        for name in re.findall(r"^\s*([a-z][a-z0-9-]*):\s*func\(", body, re.M):
            assert name not in out, f"{name} declared twice"
            out[name] = iface
    return out


def wit_functions() -> set[str]:
    return set(wit_function_interfaces())


def host_methods() -> set[str]:
    return {
        name
        for name, member in inspect.getmembers(HostApi)
        if not name.startswith("_") and inspect.isfunction(member)
    }


def test_wit_declares_package_interfaces_and_world():
    """One package; the shared types in ``types`` (no functions), which every
    other interface takes with ``use types.{...}``; the world imports each
    interface that has functions and exports ``run``."""
    text = WIT.read_text()
    assert "package tartlet:inferlet@0.4.0;" in text
    ifaces = wit_interfaces()
    assert list(ifaces) == ["types", *FUNCTION_INTERFACES]
    assert not re.search(r"func\(", ifaces["types"])
    for name in FUNCTION_INTERFACES:
        assert re.search(r"^\s*use types\.\{[a-z0-9, -]+\};", ifaces[name], re.M), name
    imports = "".join(f"\\s*import {n};" for n in FUNCTION_INTERFACES)
    assert re.search(r"world inferlet \{" + imports + r"\s*(///.*\n\s*)*export run: func\(args: string\) -> result<string, string>;", text)


def test_host_registers_each_function_in_its_interface():
    from tartlet.runtime.wasm_host import INTERFACES

    assert list(INTERFACES) == FUNCTION_INTERFACES
    where = wit_function_interfaces()
    assert {f: i for i, fs in INTERFACES.items() for f in fs} == where


def test_every_host_method_has_a_wit_function_and_back():
    wit = wit_functions()
    methods = {m.replace("_", "-") for m in host_methods() - NATIVE_ONLY}
    missing_in_wit = sorted(methods - wit)
    missing_in_host = sorted(wit - methods - WIT_ONLY)
    assert not missing_in_wit, f"HostApi methods without a WIT function (add them to wit/tartlet.wit): {missing_in_wit}"
    assert not missing_in_host, f"WIT functions without a HostApi method: {missing_in_host}"


def test_allow_lists_name_real_things():
    assert NATIVE_ONLY <= host_methods()
    assert WIT_ONLY <= wit_functions()


def test_host_imports_cover_the_wit():
    from tartlet.runtime.wasm_host import IMPORTS

    assert set(IMPORTS) == wit_functions()


def test_guest_binding_covers_the_host_api():
    tree = ast.parse((ROOT / "tartlet" / "sdk" / "_wasm_binding.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "WasmHost")
    guest = {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}
    assert guest == host_methods() - NATIVE_ONLY
    for f in cls.body:  # same parameter names as HostApi, so keyword calls work in both modes
        if isinstance(f, ast.FunctionDef) and f.name in guest:
            native = list(inspect.signature(getattr(HostApi, f.name)).parameters)
            assert [a.arg for a in f.args.args] == native, f.name


# -- types ------------------------------------------------------------------------------
_SCALARS = {"u8": "int", "u16": "int", "u32": "int", "u64": "int", "s32": "int", "s64": "int",
            "f32": "float", "f64": "float", "bool": "bool", "string": "str"}  # fmt: skip
#: WIT records and variants -> the Python type both HostApi and the guest
#: binding use for them (the transports convert between the two).
NAMED = {
    "output-slot": "OutputSlot",  # tartlet.sdk.forward.OutputSlot
    "sampler-params": "OutputSlot",  # a `sample` slot (Sampler.slot)
    "attention-probe": "AttentionProbe",  # tartlet.sdk.attention_probe.AttentionProbe
    "message": "str | bytes",
    "chat-message": "dict[str, Any]",
    "model-details": "dict[str, Any]",
    "pool-stats": "dict[str, int]",
    "stored-value": "str | None",  # a record only because of wasmtime-py (see the WIT)
    "token-mask": "list[int] | bytes",
    "adapter-module": "dict[str, Any]",  # adapter-info: name, rank, in_features, out_features, scale
    "lora-weights": "tuple[bytes, bytes]",  # adapter-weights: (A, B)
}
#: parameters that cross as JSON text: (function, parameter) -> Python type
JSON_TEXT = {
    ("apply-chat-template", "tools"): "list[dict[str, Any]] | None",
    ("child-launch", "args-json"): "dict[str, Any]",
    ("grammar-new", "spec-json"): "Any",
}
#: parameters where HostApi takes more than the WIT carries, and the guest converts
WIDER = {
    ("http-fetch", "body"): "bytes | str | None",  # a str body is sent UTF-8 encoded
}


def _split(args: str) -> list[str]:
    """Split ``args`` at top-level commas (not inside ``<...>``)."""
    out, depth, cur = [], 0, ""
    for ch in args:
        depth += (ch == "<") - (ch == ">")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [a for a in [*out, cur.strip()] if a]


def py_type(wit: str) -> str:
    """The Python annotation for a WIT type (as HostApi writes it)."""
    wit = wit.strip()
    if wit in _SCALARS:
        return _SCALARS[wit]
    if wit in NAMED:
        return NAMED[wit]
    m = re.fullmatch(r"(option|list)<(.*)>", wit)
    if m and m[1] == "option":
        return f"{py_type(m[2])} | None"
    if m and m[2] == "u8":
        return "bytes"
    if m and m[2] == "tuple<string, string>":
        return "dict[str, str]"
    if m:
        return f"list[{py_type(m[2])}]"
    raise AssertionError(f"no Python type for WIT type {wit!r}: extend NAMED or py_type")


def wit_signatures() -> dict[str, tuple[list[tuple[str, str]], str | None]]:
    """name -> ([(param, WIT type)], WIT result type or None), every interface."""
    body = "\n".join(wit_interfaces().values())
    sigs = {}
    for name, params, result in re.findall(r"^\s*([a-z][a-z0-9-]*):\s*func\((.*)\)(?:\s*->\s*(.*?))?;\s*$", body, re.M):
        sigs[name] = ([tuple(p.split(":", 1)) for p in _split(params)], result or None)  # type: ignore[misc]
    return sigs


def wit_records() -> set[str]:
    text = WIT.read_text()
    return set(re.findall(r"^\s*record ([a-z][a-z0-9-]*) \{", text, re.M))


def expected_signature(name: str, params: list, result: str | None) -> tuple[list[str], str]:
    """The Python (parameter annotations, return annotation) of WIT function ``name``."""
    types = []
    for pname, wtype in params:
        key = (name, pname.strip())
        types.append(JSON_TEXT.get(key) or WIDER.get(key) or py_type(wtype))
    if result is None:
        ret = "None"
    else:
        m = re.fullmatch(r"result<(.*), call-error>", result)
        ok = m[1] if m else result
        ret = "None" if ok == "_" else "Future" if ok == "u64" else py_type(ok)  # u64 results are future handles
    return types, ret


def _norm(annotation: str) -> str:
    """Spaces and ``typing.`` dropped; ``Future[T]`` is ``Future``: a WIT
    future is a handle whatever it resolves to (the host annotates the
    result type for its own type checking)."""
    return re.sub(r"^Future\[.*\]$", "Future", annotation.replace(" ", "").replace("typing.", ""))


def _fits(expected: str, actual: str, default_none: bool) -> bool:
    """``actual`` is ``expected``, or ``expected | None`` for a parameter
    whose default None means "none given" (``outputs``, ``headers``)."""
    e, a = _norm(expected), _norm(actual)
    return a == e or (default_none and a == e + "|None")


def test_host_api_types_match_the_wit():
    sigs = wit_signatures()
    for method in sorted(host_methods() - NATIVE_ONLY):
        name = method.replace("_", "-")
        params, result = sigs[name]
        types, ret = expected_signature(name, params, result)
        sig = inspect.signature(getattr(HostApi, method))
        actual = list(sig.parameters.values())[1:]
        assert len(actual) == len(types), f"{method}: {len(actual)} parameters, the WIT has {len(types)}"
        for p, t in zip(actual, types):
            assert _fits(t, str(p.annotation), p.default is None), f"{method}({p.name}): HostApi says {p.annotation}, the WIT means {t}"
        assert _norm(str(sig.return_annotation)) == _norm(ret), f"{method} returns {sig.return_annotation}, the WIT means {ret}"


def test_guest_binding_types_match_the_host_api():
    tree = ast.parse((ROOT / "tartlet" / "sdk" / "_wasm_binding.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "WasmHost")
    for f in cls.body:
        if not isinstance(f, ast.FunctionDef) or f.name.startswith("_"):
            continue
        native = inspect.signature(getattr(HostApi, f.name))
        guest = [ast.unparse(a.annotation) if a.annotation else "" for a in f.args.args[1:]]
        assert [_norm(g) for g in guest] == [_norm(str(p.annotation)) for p in list(native.parameters.values())[1:]], f.name
        ret = _norm(ast.unparse(f.returns)) if f.returns else ""
        want = _norm(str(native.return_annotation))
        assert ret == ("HostFuture" if want == "Future" else want), f"{f.name}: guest returns {ret}, HostApi {want}"


def test_host_result_modes_fit_the_wit():
    """wasmtime-py lowers a ``result`` untagged when its cases differ by
    Python class; an ok record (like the ``call-error`` record) needs the
    tagged form, so each import's mode must follow the WIT result type."""
    from tartlet.runtime.wasm_host import IMPORTS

    records = wit_records()
    for name, (params, result) in wit_signatures().items():
        mode = IMPORTS[name][1]
        if result is None or not result.startswith("result<"):
            want = "plain"  # cannot fail
        else:
            ok = re.fullmatch(r"result<(.*), call-error>", result)
            assert ok, f"{name}: a call that can fail returns result<T, call-error>, got {result}"
            want = "unit" if ok[1] == "_" else "tagged" if ok[1] in records else "untagged"
        assert mode == want, f"{name}: IMPORTS mode {mode!r}, the WIT result {result} needs {want!r}"


def test_error_codes_are_the_wit_enum():
    text = WIT.read_text()
    enum = re.search(r"enum error-code \{(.*?)\}", text, re.S)
    assert enum, "the WIT declares enum error-code"
    cases = [c.strip() for c in re.sub(r"///.*", "", enum[1]).split(",") if c.strip()]
    assert cases == list(ERROR_CODES)
    assert re.search(r"record call-error \{\s*code: error-code,\s*message: string,\s*\}", text)


def test_a_component_of_another_contract_version_gets_a_rebuild_hint():
    """A component built against an older WIT (0.1.0 imported one interface
    ``host``) fails to instantiate; the error says why and what to do."""
    from tartlet.runtime.wasm import _contract_hint
    from tartlet.runtime.wasm_host import VERSION

    old = "component imports instance `tartlet:inferlet/host@0.1.0`, but a matching implementation was not found"
    assert "built against the WIT contract tartlet:inferlet@0.1.0" in _contract_hint(old)
    assert f"this host serves @{VERSION}" in _contract_hint(old) and "tartlet build" in _contract_hint(old)
    assert _contract_hint(f"component imports instance `tartlet:inferlet/model@{VERSION}`, but ...") == ""
    assert _contract_hint("some other linker error") == ""
