"""The docs cannot drift from the CLI: every `brisk ...` command line in README.md, BENCHMARKS.md and docs/*.md
parses against the real click CLI (without running it), and the docs name no absolute path, no numbered diary
entry and no issue number."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from brisk.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
# docs/history.md records past runs with the commands of their day; it is checked for paths and numbering only.
COMMAND_DOCS = [p for p in DOCS if p.name != "history.md"]


def _command_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, command) for every `brisk ...` line of a fenced block and every inline `brisk ...` span."""
    out, fenced, pending = [], False, ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            text = pending + re.split(r"\s#\s", line)[0].strip()
            if text.endswith("\\"):
                pending = text[:-1] + " "
                continue
            pending = ""
            if text.startswith("brisk "):
                out.append((number, text))
        else:  # inline: a full command, or a reference to one by name (`brisk quantize`)
            out += [(number, m) for m in re.findall(r"`(brisk [^`]+)`", line)]
    return out


def _resolve(args: list[str]) -> tuple[click.Command, list[str], list[str]]:
    command, path = main, []
    while isinstance(command, click.Group) and args and args[0] in command.commands:
        path.append(args[0])
        command = command.commands[args[0]]
        args = args[1:]
    return command, path, args


def _without_existence_checks(command: click.Command) -> None:
    # The docs name files they create first (./smollm2-int4, MODEL.gguf, ...): parse, do not look for them.
    for param in command.params:
        if isinstance(param.type, click.Path):
            param.type.exists = False


CASES = [(p.relative_to(ROOT).as_posix(), n, c) for p in COMMAND_DOCS for n, c in _command_lines(p)]


@pytest.mark.parametrize("doc,number,line", CASES, ids=[f"{d}:{n}" for d, n, _ in CASES])
def test_documented_command_parses(doc: str, number: int, line: str) -> None:
    args = shlex.split(line.replace("$(cat passage.txt)", "PASSAGE"))[1:]
    # "[--api-key KEY]" marks an optional part; "gptq|awq" a choice, parsed as its first alternative
    args = [a.split("|")[0] for a in args if not (a.startswith("[") or a.endswith("]"))]
    command, path, rest = _resolve(args)
    if rest in ([], ["..."]) and path:
        return  # a reference to a command by name: it exists
    if isinstance(command, click.Group):
        pytest.fail(f"{doc}:{number}: `{line}` names no subcommand of brisk {' '.join(path)}")
    _without_existence_checks(command)
    try:
        command.make_context(" ".join(["brisk", *path]), rest, resilient_parsing=False)
    except (click.UsageError, click.BadParameter) as e:
        pytest.fail(f"{doc}:{number}: `{line}` does not parse: {e.format_message()}")


def test_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 200


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_docs_speak_of_brisk_only(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    for pattern, what in [(r"(?<![\w.~])/(?:work|tmp|home|usr|root)/", "an absolute path"),
                          (r"\.\./shared", "a path outside the repository"),
                          (r"\b[Ss]essions? \d+", "diary numbering"),
                          (r"\b[Ii]ssues? #?\d+|#\d{1,4}\b", "an issue number")]:
        match = re.search(pattern, text)
        assert match is None, f"{path.name} contains {what}: {text[max(0, match.start() - 40):match.end() + 40]!r}"
