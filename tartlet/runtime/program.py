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
import threading
import tomllib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any, Callable

from ..sdk.errors import ProgramError
from .sibling_import import SiblingImporter

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
        return its ``main``. Modules beside the entry file are imported
        privately for this load (:mod:`.sibling_import`): ``sys.path`` and
        ``sys.modules`` are left alone, so loads on several threads never
        disturb each other or other readers of those.

        Raises:
            ProgramError: import fails, or no ``async def main(args)``.
        """
        mod_name = f"_tartlet_inferlet_{next(_module_ids)}"
        spec = importlib.util.spec_from_file_location(mod_name, self.entry, submodule_search_locations=None)
        if spec is None or spec.loader is None:
            raise ProgramError(f"cannot import inferlet {self.name!r}")
        module: ModuleType = importlib.util.module_from_spec(spec)
        module.__dict__["__builtins__"] = SiblingImporter(self.root, _compiled).builtins()
        try:
            exec(_compiled(self.entry), module.__dict__)  # what the loader's exec_module does, minus compiling
        except Exception as e:
            raise ProgramError(f"inferlet {self.name!r} failed to import: {type(e).__name__}: {e}") from e
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


#: Longest inferlet name looked up by name, characters (names longer than
#: a file name may be, 255 bytes, used to reach the file system and fail there
#: with an ``OSError`` naming the server's folder).
MAX_NAME_CHARS = 128


def check_name(name: object) -> str:
    """``name`` if it is a plain inferlet name: a non-empty ``str`` of at
    most :data:`MAX_NAME_CHARS` characters, no path separator, no leading
    ``.``, no NUL or other control character.

    Raises:
        ProgramError: anything else (the message quotes at most 80 characters).
    """
    if not isinstance(name, str) or not name:
        raise ProgramError(f"an inferlet name is a non-empty string like 'text-completion', got {name!r:.80}")
    if len(name) > MAX_NAME_CHARS:
        raise ProgramError(f"an inferlet name has at most {MAX_NAME_CHARS} characters, got {len(name)}: {name!r:.80}")
    if "/" in name or "\\" in name or name.startswith(".") or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ProgramError(f"an inferlet name is a plain name like 'text-completion' (no path), got {name!r:.80}")
    return name


def find_in(name: str, dirs: list[Path]) -> Program | None:
    """The inferlet ``name`` (checked with :func:`check_name`) in the first
    of ``dirs`` that has it as a folder or a ``.py`` file, else None.

    Raises:
        ProgramError: a bad name, or a folder that holds it but cannot be
            read (the message names no server path).
    """
    check_name(name)
    for d in dirs:
        cand = Path(d) / name
        try:
            if cand.is_dir():
                return load_program(cand)
            if cand.with_suffix(".py").is_file():
                return load_program(cand.with_suffix(".py"))
        except OSError as e:
            raise ProgramError(f"cannot look up inferlet {name!r:.80}: {e.strerror or type(e).__name__}") from None
    return None


def find_program(name_or_path: str, search: list[Path] | None = None) -> Program:
    """Resolve an inferlet by path, or by name in ``search`` folders and the
    bundled ones.

    Raises:
        ProgramError: nothing matches (the message lists the known names), or
            the path cannot be read.
    """
    p = Path(name_or_path).expanduser()
    try:
        exists = p.exists()
    except OSError as e:  # a name too long for the file system
        raise ProgramError(f"cannot read inferlet {name_or_path!r:.80}: {e.strerror or type(e).__name__}") from None
    if exists:
        return load_program(p)
    try:
        found = find_in(name_or_path, list(search or []) + [BUNDLED_DIR])
    except ProgramError:
        found = None
    if found is not None:
        return found
    known = ", ".join(sorted(list_programs(search))) or "none"
    raise ProgramError(f"unknown inferlet {name_or_path!r:.80} (known: {known})")


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
