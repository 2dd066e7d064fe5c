"""The README's command table names every command `tartlet --help` lists
(subcommands of groups such as `model`, `config` and `auth` included)."""

from __future__ import annotations

from pathlib import Path

import typer

from tartlet.cli.main import app

README = Path(__file__).resolve().parents[2] / "README.md"


def _commands(group: typer.core.TyperGroup, prefix: str = "tartlet") -> list[str]:
    out = []
    for name, cmd in group.commands.items():
        if isinstance(cmd, typer.core.TyperGroup):
            out += _commands(cmd, f"{prefix} {name}")
        else:
            out.append(f"{prefix} {name}")
    return out


def test_readme_lists_every_command():
    commands = _commands(typer.main.get_command(app))
    assert len(commands) >= 20
    text = README.read_text()
    missing = [c for c in commands if f"`{c}" not in text]
    assert not missing, f"README command table lacks {missing}"
