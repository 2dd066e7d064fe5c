"""Finding and loading inferlet programs.

An inferlet is either a single ``.py`` file or a folder with a manifest
``inferlet.toml``::

    name = "text-completion"
    version = "0.1.0"
    description = "Complete a prompt with the chat template."
    entry = "main.py"            # file defining async def main(args)
    permissions = []             # host capabilities it needs (http, store, ...)

Names resolve against the bundled ``inferlets/`` folder and any extra search
folders (e.g. the server's program directory).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import itertools
import sys
import threading
import tomllib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any, Callable

from ..sdk.errors import ProgramError

#: The standard inferlets shipped with Tartlet.
BUNDLED_DIR = Path(__file__).resolve().parents[2] / "inferlets"

_module_ids = itertools.count()

#: Compiled entry files by (path, SHA-256 of the source): every launch runs
#: the entry in a fresh module, but compiles it only when its text is new
#: (the OpenAI route's 16 KB entry took ~2.8 ms to compile, on the event
#: loop, before each request's first token). Least recently used dropped
#: past CODE_CACHE_SIZE entries.
CODE_CACHE_SIZE = 64
_code_cache: OrderedDict[tuple[str, bytes], CodeType] = OrderedDict()
_code_lock = threading.Lock()


def _compiled(entry: Path) -> CodeType:
    """The code object of ``entry``'s current text (cached, see
    :data:`CODE_CACHE_SIZE`). Raises what reading or compiling raises
    (``OSError``, ``SyntaxError``, ``ValueError``)."""
    source = entry.read_bytes()
    key = (str(entry), hashlib.sha256(source).digest())
    with _code_lock:
        code = _code_cache.get(key)
        if code is not None:
            _code_cache.move_to_end(key)
            return code
    code = compile(source, str(entry), "exec", dont_inherit=True)  # honours a PEP 263 coding line, as import does
    with _code_lock:
        _code_cache[key] = code
        while len(_code_cache) > CODE_CACHE_SIZE:
            _code_cache.popitem(last=False)
    return code


@dataclass
class Program:
    """A loadable inferlet.

    Attributes:
        name: manifest name (or the file stem).
        root: the folder (or the file's folder).
        entry: the Python file defining ``main``.
        manifest: the parsed ``inferlet.toml`` (empty for a bare file).
    """

    name: str
    root: Path
    entry: Path
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def description(self) -> str:
        description: str = self.manifest.get("description", "")
        return description

    def usage(self) -> str:
        """The inferlet's documentation: its description and the entry
        file's module docstring (which documents its arguments), read
        without importing it; empty when it has neither.

        Raises:
            ProgramError: the entry file cannot be read or parsed.
        """
        import ast

        try:
            doc = ast.get_docstring(ast.parse(self.entry.read_text(encoding="utf-8"))) or ""
        except (OSError, SyntaxError, UnicodeDecodeError) as e:
            raise ProgramError(f"cannot read inferlet {self.name!r}: {type(e).__name__}: {e}") from None
        head = f"{self.name}: {self.description}" if self.description else self.name
        return head + ("\n\n" + doc if doc else "\n\n(no documentation: the entry file has no module docstring)")

    def load_main(self) -> Callable[[dict[str, Any]], Any]:
        """Import the entry file (a fresh module each call, so instances share
        no module state; its code compiled once per version of its text) and
        return its ``main``.

        Raises:
            ProgramError: import fails, or no ``async def main(args)``.
        """
        mod_name = f"_tartlet_inferlet_{next(_module_ids)}"
        spec = importlib.util.spec_from_file_location(mod_name, self.entry, submodule_search_locations=None)
        if spec is None or spec.loader is None:
            raise ProgramError(f"cannot import inferlet {self.name!r} from {self.entry}")
        module: ModuleType = importlib.util.module_from_spec(spec)
        added = str(self.root) not in sys.path
        if added:  # let the inferlet import its sibling modules
            sys.path.insert(0, str(self.root))
        try:
            exec(_compiled(self.entry), module.__dict__)  # what the loader's exec_module does, minus compiling
        except Exception as e:
            raise ProgramError(f"inferlet {self.name!r} failed to import: {type(e).__name__}: {e}") from e
        finally:
            if added:
                sys.path.remove(str(self.root))
        main = getattr(module, "main", None)
        if main is None or not inspect.iscoroutinefunction(main):
            raise ProgramError(f"inferlet {self.name!r} ({self.entry.name}) must define `async def main(args: dict)`")
        loaded: Callable[[dict[str, Any]], Any] = main
        return loaded


def load_program(path: Path) -> Program:
    """A program from a ``.py`` file or a folder with ``inferlet.toml``
    (or a ``main.py``).

    Raises:
        ProgramError: missing path, bad manifest, missing entry file.
    """
    path = Path(path)
    if path.is_file():
        if path.suffix != ".py":
            raise ProgramError(f"{path} is not a Python inferlet (.py file or folder)")
        return Program(path.stem, path.parent, path)
    if not path.is_dir():
        raise ProgramError(f"no inferlet at {path}")
    manifest: dict[str, Any] = {}
    mf = path / "inferlet.toml"
    if mf.exists():
        try:
            manifest = tomllib.loads(mf.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ProgramError(f"{mf}: invalid TOML: {e}") from None
    entry_name = manifest.get("entry", "main.py")
    if (
        not isinstance(entry_name, str) or not entry_name or "\0" in entry_name or "\\" in entry_name
        or Path(entry_name).is_absolute() or ".." in Path(entry_name).parts
    ):  # fmt: skip
        raise ProgramError(f"{mf}: `entry` must be a relative path inside the inferlet folder, got {entry_name!r:.80}")
    name = manifest.get("name", path.name)
    if not isinstance(name, str) or not name:
        raise ProgramError(f"{mf}: `name` must be a non-empty string, got {name!r:.80}")
    entry = path / entry_name
    if not entry.is_file():
        raise ProgramError(f"inferlet folder {path} has no entry file {entry_name}")
    return Program(name, path, entry, manifest)


def find_program(name_or_path: str, search: list[Path] | None = None) -> Program:
    """Resolve an inferlet by path, or by name in ``search`` folders and the
    bundled ones.

    Raises:
        ProgramError: nothing matches; the message lists the known names.
    """
    p = Path(name_or_path).expanduser()
    if p.exists():
        return load_program(p)
    dirs = list(search or []) + [BUNDLED_DIR]
    for d in dirs:
        cand = d / name_or_path
        if cand.is_dir() or cand.with_suffix(".py").is_file():
            return load_program(cand if cand.is_dir() else cand.with_suffix(".py"))
    known = ", ".join(sorted(list_programs(search))) or "none"
    raise ProgramError(f"unknown inferlet {name_or_path!r} (known: {known})")


def list_programs(search: list[Path] | None = None) -> dict[str, Program]:
    """Every inferlet folder found in ``search`` and the bundled folder, by name."""
    out: dict[str, Program] = {}
    for d in [BUNDLED_DIR] + list(search or []):
        if not d.is_dir():
            continue
        for sub in sorted(d.iterdir()):
            if sub.is_dir() and ((sub / "inferlet.toml").exists() or (sub / "main.py").exists()):
                try:
                    prog = load_program(sub)
                except ProgramError:
                    continue
                out[prog.name] = prog
    return out
