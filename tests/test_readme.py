"""The README against the code: its commands, options, config keys and presets exist, its test line
is the one CI runs, and it does not contradict what the code does."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
# Dotted names the README uses that are not keys of today's config, each for a stated reason.
NOT_KEYS = {
    "train.guidance", "train.noise_offset", "data.file",  # schema 1's names, quoted where migration is explained
    "memory.swap.prefetch",  # a field of the run record, not of the config
}


def _cli():
    from imglora.cli import main

    return main


def _code_lines() -> list[str]:
    """Every line inside the README's fenced code blocks."""
    lines, inside = [], False
    for line in README.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line)
    return lines


def _invocations() -> list[list[str]]:
    """``imglora ...`` commands as the README writes them: in code blocks and in inline code."""
    found = []
    candidates = [ln.split("#", 1)[0] for ln in _code_lines()] + re.findall(r"`(imglora [^`]+)`", README)
    for text in candidates:
        for part in re.split(r"&&|\||;", text):
            part = part.strip()
            if not part.startswith("imglora "):
                continue
            try:
                found.append(shlex.split(part.replace("…", "").replace("...", "")))
            except ValueError:  # an unbalanced quote in prose
                continue
    return found


def test_the_test_line_is_what_ci_runs() -> None:
    """.ci/run reads the README's line marked "# the tests:" and runs it as written."""
    marked = [ln for ln in README.splitlines() if re.match(r"^pip install .*pytest.*# the tests:", ln)]
    assert len(marked) == 1, "README.md needs exactly one test line marked '# the tests:'"
    command = marked[0].split("#", 1)[0].strip()
    assert 'pip install torch==2.13.0 -e ".[test]"' in command and command.endswith("python -m pytest -q")
    ci = (REPO / ".ci" / "run").read_text()
    assert "# the tests:" in ci and 'eval "$readme_line"' in ci
    extracted = subprocess.run(
        ["bash", "-c", r"""grep -m1 -E '^pip install .*pytest.*# the tests:' README.md | sed -E 's/[[:space:]]+#.*$//'"""],
        cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    assert extracted == command
    assert "IMGLORA_TEST_UNALIGNED=1 python -m pytest -q" in ci and "python -m pytest -q --slow" in ci


def test_every_command_and_option_the_readme_names_exists() -> None:
    import click

    main = _cli()
    seen = 0
    for argv in _invocations():
        if len(argv) < 2 or argv[1].startswith("-") or argv[1].isupper():  # `imglora --help`, `imglora COMMAND`
            continue
        name = argv[1]
        assert name in main.commands, f"README names `imglora {name}`, which is not a command"
        cmd = main.commands[name]
        options = {o for p in cmd.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}
        options |= {"-h", "--help"}
        for arg in argv[2:]:
            if arg.startswith("--"):
                opt = arg.split("=", 1)[0]
                assert opt in options, f"README: `imglora {name}` has no option {opt} ({' '.join(argv)})"
        seen += 1
    assert seen >= 20  # the README shows every command; a parsing slip that finds none must fail


def test_every_config_key_the_readme_names_exists() -> None:
    from imglora import config
    from imglora.families import registry

    keys = {k for k, _, _ in config.field_help(registry)}
    sections = {k.split(".")[0] for k in keys}
    names = set(re.findall(r"`([a-z_0-9]+(?:\.[a-z_0-9]+)+)", README))
    named = [n for n in names if n.split(".")[0] in sections and not re.search(r"\.(py|toml)$", n)]
    assert len(named) > 40
    unknown = sorted(n for n in named if n not in keys and n not in NOT_KEYS
                     and not any(k.startswith(n + ".") for k in keys))
    assert not unknown, f"README names keys the config does not have: {unknown}"
    for old in ("train.guidance", "train.noise_offset", "data.file"):  # quoted as moved: they must be refused now
        assert old not in keys


def test_every_preset_the_readme_names_ships() -> None:
    for name in set(re.findall(r"presets/([a-z0-9_-]+\.toml)", README)):
        assert (REPO / "presets" / name).is_file(), f"README names presets/{name}, which does not exist"
