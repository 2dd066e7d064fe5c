"""Loading an inferlet's entry file: a fresh module per launch, compiled once per text."""

from __future__ import annotations

import pytest

from tartlet.runtime.program import load_program
from tartlet.sdk.errors import ProgramError

ENTRY = '''
from helper import greeting

SEEN = []


async def main(args):
    SEEN.append(args)
    return greeting() + " " + str(len(SEEN))
'''


def write(tmp_path, entry: str = ENTRY):
    (tmp_path / "inferlet.toml").write_text('name = "probe"\nentry = "main.py"\n')
    (tmp_path / "main.py").write_text(entry)
    (tmp_path / "helper.py").write_text("def greeting():\n    return 'hi'\n")
    return load_program(tmp_path)


async def test_each_launch_gets_a_fresh_module_sharing_the_compiled_code(tmp_path):
    program = write(tmp_path)
    a, b = program.load_main(), program.load_main()
    assert a.__globals__ is not b.__globals__  # module state is per launch
    assert a.__code__ is b.__code__  # compiled once
    assert await a({}) == "hi 1"
    assert await a({}) == "hi 2"
    assert await b({}) == "hi 1"  # b's SEEN is its own


async def test_an_edited_entry_is_compiled_again(tmp_path):
    program = write(tmp_path)
    old = program.load_main()
    (tmp_path / "main.py").write_text(ENTRY.replace('" "', '" / "'))
    new = program.load_main()
    assert new.__code__ is not old.__code__
    assert await new({}) == "hi / 1"


def test_a_syntax_error_is_a_program_error_and_a_fix_loads(tmp_path):
    program = write(tmp_path, "async def main(args):\n    return (\n")
    with pytest.raises(ProgramError, match=r"inferlet 'probe' failed to import: SyntaxError"):
        program.load_main()
    (tmp_path / "main.py").write_text(ENTRY)
    assert program.load_main() is not None


def test_an_unreadable_entry_is_a_program_error(tmp_path):
    program = write(tmp_path)
    (tmp_path / "main.py").unlink()
    with pytest.raises(ProgramError, match=r"inferlet 'probe' failed to import: FileNotFoundError"):
        program.load_main()


def _folder(tmp_path, name: str, files: dict[str, str]):
    d = tmp_path / name
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return load_program(d)


async def test_sibling_modules_are_private_to_each_load(tmp_path):
    """Two inferlets with different `helper` modules each get their own, and
    neither lands in sys.modules; packages, relative imports and imports
    made later, inside main, work too."""
    import sys

    entry = "import helper\nasync def main(args):\n    from pkg.sub import twice\n    return helper.NAME + twice(args['x'])\n"
    pkg = {"pkg/__init__.py": "from . import sub\n", "pkg/sub.py": "from .util import k\ndef twice(x):\n    return x * k\n",
           "pkg/util.py": "k = 2\n"}  # fmt: skip
    a = _folder(tmp_path, "a", {"main.py": entry, "helper.py": "NAME = 'a'\n", **pkg})
    b = _folder(tmp_path, "b", {"main.py": entry, "helper.py": "NAME = 'b'\n", **pkg})
    before_path, before_mods = list(sys.path), set(sys.modules)
    main_a, main_b = a.load_main(), b.load_main()
    assert await main_a({"x": "1"}) == "a11" and await main_b({"x": "2"}) == "b22"
    assert sys.path == before_path
    assert not {"helper", "pkg", "pkg.sub", "pkg.util"} & set(sys.modules) and set(sys.modules) - before_mods <= {"asyncio"}


def test_a_missing_sibling_is_a_program_error_naming_the_module(tmp_path):
    prog = _folder(tmp_path, "c", {"main.py": "import no_such_helper_module\nasync def main(args):\n    pass\n"})
    with pytest.raises(ProgramError, match=r"failed to import: ModuleNotFoundError: No module named 'no_such_helper_module'"):
        prog.load_main()


def test_loading_programs_never_changes_sys_path_under_other_threads(tmp_path):
    """The race of issue 40: one thread launches bundled inferlets in a loop
    (each load used to put the folder on sys.path and take it off again)
    while another looks up a build key (package metadata, read by walking
    sys.path): the walk missed site-packages now and then and the launch
    failed with "No package metadata found". Now sys.path never changes."""
    import importlib.metadata
    import sys
    import threading

    from tartlet.runtime import builder
    from tartlet.runtime.program import BUNDLED_DIR

    pytest.importorskip("componentize_py")
    bundled = load_program(BUNDLED_DIR / "text-completion")
    uploaded = _folder(tmp_path, "up", {"main.py": "async def main(args):\n    return 1\n"})
    snapshot = list(sys.path)
    stop = threading.Event()
    errors: list[BaseException] = []
    changed = []

    def launches():
        try:
            while not stop.is_set():
                bundled.load_main()
                uploaded.load_main()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def metadata():
        try:
            for i in range(200):
                if i % 20 == 0:
                    builder.build_key(uploaded)  # what a sandboxed launch does first: reads componentize-py's metadata
                importlib.metadata.version("pytest")
                if sys.path != snapshot:
                    changed.append(list(sys.path))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    loaders = [threading.Thread(target=launches) for _ in range(2)]
    for t in loaders:
        t.start()
    try:
        readers = [threading.Thread(target=metadata) for _ in range(2)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(timeout=120)
    finally:
        stop.set()
        for t in loaders:
            t.join(timeout=60)
    assert not errors, errors
    assert not changed, changed[:1]
