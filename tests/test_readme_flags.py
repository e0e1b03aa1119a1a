"""README.md's flag tables against `nanoserve serve`'s parser: every row names a serve flag and its default as the
parser has it, and every serve flag has a row. Built without torch (the parser is the control plane's)."""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from scheduler_svc.entrypoints.cli import build_parser

README = Path(__file__).resolve().parent.parent / "README.md"
TABLE_HEADER = re.compile(r"^\|\s*flag\s*\|\s*default\s*\|\s*meaning\s*\|\s*$")
CODE = re.compile(r"`([^`]+)`")


def flag_rows(text: str) -> list[tuple[int, list[str], str]]:
    """(line number, the flags a row names, its default literal) for each row of a `| flag | default | meaning |`
    table. `--[no-]x` names `--x`, the parser's name of a switch."""
    rows, in_table = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if TABLE_HEADER.match(line):
            in_table = True
            continue
        if not in_table or re.match(r"^\|\s*-+", line):
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) >= 3, f"README.md:{n}: a flag row needs three cells (flag, default, meaning): {line}"
        flags = [f.replace("--[no-]", "--") for f in CODE.findall(cells[0])]
        default = CODE.match(cells[1])
        assert flags, f"README.md:{n}: the flag cell names no `--flag`: {line}"
        assert default, f"README.md:{n}: the default cell must start with the default in backticks: {line}"
        rows.append((n, flags, default.group(1)))
    return rows


def documented(value) -> str:
    """How the tables write a parser default."""
    if value is None or value == "":
        return "none"
    if value is True:
        return "on"
    if value is False:
        return "off"
    return str(value)


@pytest.fixture
def serve_parser(monkeypatch) -> argparse.ArgumentParser:
    for name in list(os.environ):
        if name.startswith("NANOSERVE_"):  # they set defaults; the tables state the built-in ones
            monkeypatch.delenv(name)
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def serve_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every visible option string of serve, --help aside."""
    return {opt: action for action in parser._actions
            if action.option_strings and action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
            for opt in action.option_strings if not opt.startswith("--no-")}


def test_flag_rows_parse_switches_aliases_and_defaults():
    text = ("| flag | default | meaning |\n|---|---|---|\n| `--[no-]x` | `on` | a switch |\n"
            "| `--y`, `-y` | `none` (the model's) | an alias |\n\nafter\n| `--z` | `1` | not in a table |\n")
    assert flag_rows(text) == [(3, ["--x"], "on"), (4, ["--y", "-y"], "none")]


def test_every_readme_flag_row_names_a_serve_flag_with_its_default(serve_parser):
    flags = serve_flags(serve_parser)
    rows = flag_rows(README.read_text())
    assert rows, "README.md has no `| flag | default | meaning |` table"
    wrong = []
    for n, names, default in rows:
        for name in names:
            if name not in flags:
                wrong.append(f"README.md:{n}: {name} is not a `nanoserve serve` flag")
                continue
            actual = documented(flags[name].default)
            if default != actual:
                try:
                    if float(default) == float(actual):
                        continue
                except ValueError:
                    pass
                wrong.append(f"README.md:{n}: {name} default is `{actual}` in the parser, `{default}` in the table")
    assert not wrong, "\n".join(wrong)


def test_every_serve_flag_has_a_readme_row(serve_parser):
    named = {name for _, names, _ in flag_rows(README.read_text()) for name in names}
    missing = sorted({action.option_strings[0] for name, action in serve_flags(serve_parser).items()
                      if name.startswith("--") and name not in named})
    assert not missing, ("serve flags with no row in README.md's flag tables (add one to the table of its topic): "
                         + ", ".join(missing))
