"""Tartlet: a programmable LLM serving system.

The package root re-exports the inferlet SDK (:mod:`tartlet.sdk`), so an
inferlet writes ``from tartlet import Context, Model, Sampler``. The SDK's
modules also answer to their short names (``tartlet.tools``,
``tartlet.errors``, ``tartlet.constraint``, ...): each is registered in
``sys.modules`` as the same module object as ``tartlet.sdk.<name>``, so
``isinstance`` checks and ``except tartlet.errors.X`` see one class.

The rest of the package is the server side, in layers (DESIGN.md):
``engine`` (model, KV pages, scheduler), ``host`` (what an inferlet's host
calls do), ``runtime`` (native and WASM instances), ``server``, ``cluster``,
``client`` and ``cli``. A WASM build bundles this file and ``tartlet/sdk/``
only.
"""

import importlib as _importlib
import pkgutil as _pkgutil
import sys as _sys

from . import sdk as _sdk
from .sdk import *  # noqa: F403
from .sdk import __all__ as __all__

for _info in _pkgutil.iter_modules(_sdk.__path__):
    if _info.name == "_wasm_binding":  # bundled as sdk/_binding.py in WASM builds; imports the component's bindings
        continue
    _module = _importlib.import_module(f"{__name__}.sdk.{_info.name}")
    _sys.modules[f"{__name__}.{_info.name}"] = _module
    globals()[_info.name] = _module
del _info, _module

__version__ = "0.1.0"
