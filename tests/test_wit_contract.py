"""The WIT contract (wit/tartlet.wit) and the host API must not drift apart.

Every public method of :class:`tartlet.host.api.HostApi` needs a function of
the same name (kebab-case) in interface ``host``, and every WIT function
needs a HostApi method, except the explicit allow-lists below. The host's
import table (tartlet.runtime.wasm_host.IMPORTS) and the guest binding
(tartlet/_wasm_binding.py, parsed, since it only imports inside a
component) must cover the same functions.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from tartlet.host.api import HostApi

ROOT = Path(__file__).resolve().parents[1]
WIT = ROOT / "wit" / "tartlet.wit"

#: HostApi methods that are not inferlet calls: lifecycle and limit hooks
#: the runtimes call themselves.
NATIVE_ONLY = {
    "close",  # the runtime ends the instance
    "close_io",  # the runtime ends the instance's I/O
}
#: WIT functions with no HostApi method: the WASM transport of futures.
WIT_ONLY = {"wait-any", "future-take", "future-drop"}


def wit_functions() -> set[str]:
    text = WIT.read_text()
    body = text[text.index("interface host {") : text.index("world inferlet")]
    return set(re.findall(r"^\s*([a-z][a-z0-9-]*):\s*func\(", body, re.M))


def host_methods() -> set[str]:
    return {
        name
        for name, member in inspect.getmembers(HostApi)
        if not name.startswith("_") and inspect.isfunction(member)
    }


def test_wit_declares_package_and_world():
    text = WIT.read_text()
    assert "package tartlet:inferlet@0.1.0;" in text
    assert re.search(r"world inferlet \{\s*import host;\s*(///.*\n\s*)*export run: func\(args: string\) -> result<string, string>;", text)


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
    tree = ast.parse((ROOT / "tartlet" / "_wasm_binding.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "WasmHost")
    guest = {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}
    assert guest == host_methods() - NATIVE_ONLY
    for f in cls.body:  # same parameter names as HostApi, so keyword calls work in both modes
        if isinstance(f, ast.FunctionDef) and f.name in guest:
            native = list(inspect.signature(getattr(HostApi, f.name)).parameters)
            assert [a.arg for a in f.args.args] == native, f.name
