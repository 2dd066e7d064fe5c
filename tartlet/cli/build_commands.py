"""``tartlet build`` and ``tartlet new``, and the sandboxed side of
``tartlet run`` (``.wasm`` components and ``--sandbox``). Registered on the
main app by :func:`register`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Optional

import typer
from rich.console import Console

if TYPE_CHECKING:
    from ..runtime.program import Program

err = Console(stderr=True)

_MAIN_TEMPLATE = '''"""{name}: {description}

Args:
    prompt (str): the user message.
    max_tokens (int, default 64).

Returns ``{{"text": ...}}``.
"""

from tartlet import Model, Sampler

from tartlet.sdk import session


async def main(args: dict) -> dict:
    prompt = args.get("prompt", "Hello!")
    model = Model.load(args.get("model"))
    with model.new_context() as ctx:
        ctx.user(prompt)
        gen = ctx.generate(Sampler.greedy(), max_tokens=int(args.get("max_tokens", 64)))
        async for step in gen:
            session.send(step.text)
        return {{"text": gen.text}}
'''

_TOML_TEMPLATE = '''name = "{name}"
version = "0.1.0"
description = "{description}"
entry = "main.py"
# host capabilities it needs beyond the model: "http", "store", "messaging", "launch"
permissions = []
# pure-Python modules bundled into `tartlet build` (import names, installed here)
dependencies = []
'''


def _fail(msg: str, code: int = 2) -> NoReturn:
    err.print(f"[bold red]error:[/] {msg}", highlight=False)
    raise typer.Exit(code)


def sandboxed_component(inferlet: str) -> tuple[Program, Path]:
    """The program and component path for ``tartlet run --sandbox`` or a
    ``.wasm`` argument (building a folder, cached). Exits with a message on
    a bad inferlet or a failed build."""
    from ..runtime.builder import BuildError
    from ..runtime.wasm import WasmRuntime
    from ..sdk.errors import ProgramError

    try:
        with err.status(f"building {inferlet}"):
            return WasmRuntime.resolve(inferlet)
    except (ProgramError, BuildError) as e:
        _fail(str(e))
    raise AssertionError("unreachable")


def build_cmd(
    source: Path = typer.Argument(..., help="Inferlet folder (with inferlet.toml) or .py file."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Where to write the component (default NAME.wasm)."),
    force: bool = typer.Option(False, "--force", help="Rebuild even when the build cache has it."),
) -> None:
    """Build an inferlet into a sandboxed WebAssembly component (offline, cached)."""
    from ..runtime.builder import BuildError, build
    from ..runtime.program import load_program
    from ..sdk.errors import ProgramError

    try:
        program = load_program(source)
        out = output or Path(f"{program.name}.wasm")
        with err.status(f"building {program.name}"):
            path = build(program, out, force=force)
    except (ProgramError, BuildError) as e:
        _fail(str(e))
    print(path)


def new_cmd(
    name: str = typer.Argument(..., help="Inferlet name (letters, digits, - and _)."),
    directory: Optional[Path] = typer.Option(None, "--dir", "-d", help="Parent folder (default: current)."),
    description: str = typer.Option("A new Tartlet inferlet.", help="One-line description."),
) -> None:
    """Scaffold an inferlet folder: inferlet.toml and main.py."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", name):
        _fail(f"invalid inferlet name {name!r}: use letters, digits, - and _, starting with a letter")
    if '"' in description or "\\" in description:
        _fail("the description may not contain quotes or backslashes")
    folder = (directory or Path.cwd()) / name
    if folder.exists():
        _fail(f"{folder} already exists")
    folder.mkdir(parents=True)
    (folder / "inferlet.toml").write_text(_TOML_TEMPLATE.format(name=name, description=description))
    (folder / "main.py").write_text(_MAIN_TEMPLATE.format(name=name, description=description))
    print(folder)


def register(app: typer.Typer) -> None:
    """Add ``build`` and ``new`` to ``app``."""
    app.command("build")(build_cmd)
    app.command("new")(new_cmd)
