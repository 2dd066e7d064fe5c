"""Loading an inferlet's entry file: a fresh module per launch, compiled once per text."""

from __future__ import annotations

import pytest

from tartlet.sdk.errors import ProgramError
from tartlet.runtime.program import load_program

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
