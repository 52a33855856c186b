"""docs/commands.md is the reference generated from the command line's own option definitions: it
matches what the generator writes now, and it names every flag each command's --help shows."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from mqinfer import cli_reference
from mqinfer.cli import build_parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "commands.md"
REGENERATE = ".venv/bin/python -m mqinfer.cli_reference"


@pytest.fixture(autouse=True)
def _fixed_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps --help to the terminal's width


def test_reference_is_up_to_date():
    assert DOC.exists(), f"{DOC} is missing: run `{REGENERATE}` to generate it"
    if DOC.read_text(encoding="utf-8") != cli_reference.render():
        pytest.fail(f"{DOC} differs from the option definitions: run `{REGENERATE}` to regenerate it "
                    "(and commit it with the change to the flags)")


def help_text(path: tuple[str, ...]) -> str:
    """What `mqinfer PATH --help` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*path, "--help"])
    return out.getvalue()


def read_help(text: str) -> tuple[set[str], set[str], list[str]]:
    """(the flags, the positional arguments, the sub-commands) that a --help text lists."""
    flags, positionals, commands = set(), set(), []
    section = None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            section = line
        elif line.startswith("  -"):  # an option's invocation, e.g. "  --fresh, --no-fresh   Start..."
            invocation = re.split(r"\s{2,}", line.strip())[0]
            flags.update(part.split()[0] for part in invocation.split(", "))
        elif section == "positional arguments:" and (m := re.match(r"    (\S+)", line)):
            commands.append(m.group(1))
        elif section == "positional arguments:" and (m := re.match(r"  (\S+)", line)):
            positionals.add(m.group(1))
    return flags, positionals, commands


def sections(doc: str) -> dict[str, str]:
    """The text of each `## \\`mqinfer ...\\`` section of the reference, by command."""
    parts = re.split(r"^## ", doc, flags=re.M)
    return {m.group(1): part for part in parts[1:] if (m := re.match(r"`(mqinfer[^`]*)`", part))}


def test_every_flag_of_every_command_is_documented():
    doc = DOC.read_text(encoding="utf-8")
    by_command = sections(doc)
    assert "`--help`" in doc.split("\n## ")[0], "the introduction says every command takes -h/--help"
    missing, seen, queue = [], [], [()]
    while queue:
        path = queue.pop(0)
        name = " ".join(("mqinfer", *path))
        seen.append(name)
        flags, positionals, commands = read_help(help_text(path))
        queue += [(*path, c) for c in commands]
        if name not in by_command:
            missing.append(f"{name}: no section")
            continue
        text = by_command[name]
        missing += [f"{name} {flag}" for flag in sorted(flags - {"-h", "--help"}) if f"`{flag}`" not in text]
        missing += [f"{name} {arg}" for arg in sorted(positionals) if not re.search(rf"\b{re.escape(arg)}\b", text)]
    # The walk really went through the parser: every command, and the sub-commands of jobs and report.
    assert {"mqinfer run", "mqinfer worker", "mqinfer bench", "mqinfer plan", "mqinfer lanes",
            "mqinfer report costs", "mqinfer jobs submit", "mqinfer jobs cancel"} <= set(seen)
    assert set(by_command) == set(seen), "sections for commands the parser does not have"
    assert not missing, (f"missing from {DOC.name}: {', '.join(missing)}; "
                         f"run `{REGENERATE}` to regenerate it")


def test_help_reading_finds_flags_positionals_and_sub_commands():
    """The walk above reads what --help shows; held here to known commands so that it cannot pass
    by reading nothing."""
    flags, positionals, commands = read_help(help_text(("run",)))
    assert {"--out", "--fresh", "--no-fresh", "--max-wait-ms", "--config", "--prefix-cache"} <= flags
    assert positionals == {"INPUT"} and commands == []
    flags, positionals, commands = read_help(help_text(("jobs",)))
    assert flags == {"-h", "--help"} and commands == ["submit", "worker", "status", "list", "cancel"]
    flags, _, _ = read_help(help_text(("bench",)))
    assert {"--workload", "--skip-engine", "--max-wait-ms", "--hf-batch-sizes"} <= flags


def test_a_stale_reference_is_reported_with_the_command_that_regenerates_it(tmp_path, capsys):
    out = tmp_path / "commands.md"
    out.write_text("# stale\n")
    assert cli_reference.main(["--check", "--out", str(out)]) == 1
    assert "python -m mqinfer.cli_reference" in capsys.readouterr().err
    assert cli_reference.main(["--out", str(out)]) == 0
    assert cli_reference.main(["--check", "--out", str(out)]) == 0
    assert out.read_text() == cli_reference.render()
