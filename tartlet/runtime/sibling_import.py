"""Imports of an inferlet's sibling modules, private to one load.

A native inferlet's entry file may import modules that lie beside it
(``import helper``, ``from helpers.text import clean``), as it can in a
WASM build (where the folder is bundled). Loading must not touch
process-global state: putting the folder on ``sys.path`` while the entry
runs races with every other thread that reads ``sys.path`` (a launch of
another program reading package metadata saw the list change under it), and
registering ``helper`` in ``sys.modules`` would hand one inferlet's
``helper`` to the next inferlet that has a different one.

So each load gets a :class:`SiblingImporter`: an ``__import__`` placed in
the ``__builtins__`` of the entry module (and of every sibling it loads).
A top-level name that is a ``NAME.py`` file or a ``NAME/__init__.py``
package in the inferlet's folder is loaded from there into a module table
of this load only (a fresh module per load, compiled once per text);
every other import goes to the normal import system. ``tartlet`` itself
is never taken from the folder (the SDK wins, as in a WASM build).
``importlib.import_module`` bypasses ``__import__``: it sees only the
normal import system.
"""

from __future__ import annotations

import builtins
import threading
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any, Callable, Mapping, Sequence

#: Top-level names never loaded from an inferlet's folder.
RESERVED = frozenset({"tartlet"})


class SiblingImporter:
    """``__import__`` for the modules of one inferlet load.

    Args:
        root: the inferlet's folder.
        compiled: returns the code object of a ``.py`` file (cached by the
            caller); raises what reading or compiling raises.
    """

    def __init__(self, root: Path, compiled: Callable[[Path], CodeType]) -> None:
        self.root = root
        self.compiled = compiled
        self.modules: dict[str, ModuleType] = {}  # dotted name -> module, this load only
        self._lock = threading.RLock()
        self._builtins = dict(builtins.__dict__, __import__=self)

    def builtins(self) -> dict[str, Any]:
        """The ``__builtins__`` dict to give a module of this load."""
        return self._builtins

    def _locate(self, name: str) -> tuple[Path, bool] | None:
        """The file of dotted ``name`` inside the folder and whether it is
        a package; None when the folder has no such module."""
        parts = name.split(".")
        if parts[0] in RESERVED or not all(p.isidentifier() for p in parts):
            return None
        base = self.root.joinpath(*parts)
        try:
            if (base / "__init__.py").is_file():
                return base / "__init__.py", True
            if base.with_name(parts[-1] + ".py").is_file():
                return base.with_name(parts[-1] + ".py"), False
        except OSError:  # a name too long for the file system, a loop of links
            return None
        return None

    def _load(self, name: str) -> ModuleType | None:
        """Module ``name`` of the folder (loading it and its parents on
        first use), or None when it is not a sibling module."""
        mod = self.modules.get(name)
        if mod is not None:
            return mod
        parent, _, _ = name.rpartition(".")
        if parent and self._load(parent) is None:
            return None
        found = self._locate(name)
        if found is None:
            return None
        path, is_pkg = found
        mod = ModuleType(name)
        mod.__file__ = str(path)
        mod.__package__ = name if is_pkg else parent
        if is_pkg:
            mod.__path__ = [str(path.parent)]
        mod.__dict__["__builtins__"] = self._builtins
        self.modules[name] = mod
        try:
            exec(self.compiled(path), mod.__dict__)
        except BaseException:
            del self.modules[name]
            raise
        if parent:
            setattr(self.modules[parent], name.rpartition(".")[2], mod)
        return mod

    def __call__(
        self, name: str, globals: Mapping[str, Any] | None = None, locals: Mapping[str, Any] | None = None,
        fromlist: Sequence[str] = (), level: int = 0,
    ) -> ModuleType:  # fmt: skip
        """What ``import`` calls (see :func:`builtins.__import__`)."""
        absolute = name
        if level > 0:
            package = (globals or {}).get("__package__") or ""
            if package.partition(".")[0] not in self.modules and package not in self.modules:
                return builtins.__import__(name, globals, locals, fromlist, level)
            bits = package.rsplit(".", level - 1)
            if len(bits) < level:
                raise ImportError("attempted relative import beyond top-level package")
            absolute = f"{bits[0]}.{name}" if name else bits[0]
        top = absolute.partition(".")[0]
        with self._lock:
            if top not in self.modules and self._locate(top) is None:
                return builtins.__import__(name, globals, locals, fromlist, level)
            mod = self._load(absolute)
            if mod is None:
                raise ModuleNotFoundError(f"No module named {absolute!r}", name=absolute)
            for item in fromlist or ():
                if item != "*" and not hasattr(mod, item) and hasattr(mod, "__path__"):
                    self._load(f"{absolute}.{item}")
            if fromlist:
                return mod
            if level > 0:
                return mod
            return self.modules[top]
