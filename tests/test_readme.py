"""The README and the pages under docs/ against the code: the commands, options, config keys and
presets they name exist, every relative link leads to a file and a heading that exist, the README
stays a short front door to the pages, its test line is the one CI runs, and it does not contradict
what the code does."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = sorted((REPO / "docs").glob("*.md"))
# Every page the rules read: the README first, then each topic page.
PAGES: dict[Path, str] = {REPO / "README.md": README, **{p: p.read_text() for p in DOCS}}
README_MAX_LINES = 200
# Dotted names the pages use that are not keys of today's config, each for a stated reason.
NOT_KEYS = {
    "train.guidance", "train.noise_offset", "data.file",  # schema 1's names, quoted where migration is explained
    "memory.swap.prefetch",  # a field of the run record, not of the config
    "memory.offload_checkpoints.host_memory",  # a field of the run record (docs/benchmarks.md), not of the config
    "lora.keep_input_dtype",  # a function (then lora.py, now imglora.adapters.inject), in docs/benchmarks.md's history
}


def _cli():
    from imglora.cli import main

    return main


def _code_lines(text: str) -> list[str]:
    """Every line inside a page's fenced code blocks."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line)
    return lines


def _prose(text: str) -> str:
    """A page without its fenced code blocks and inline code spans (where `](` or `#` mean nothing)."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside:
            lines.append(re.sub(r"`[^`\n]*`", "", line))
    return "\n".join(lines)


def _invocations() -> list[tuple[str, list[str]]]:
    """``imglora ...`` commands as the pages write them, in code blocks and in inline code, each with
    the name of the page that writes it."""
    found = []
    for path, text in PAGES.items():
        candidates = [ln.split("#", 1)[0] for ln in _code_lines(text)] + re.findall(r"`(imglora [^`]+)`", text)
        for candidate in candidates:
            for part in re.split(r"&&|\||;", candidate):
                part = part.strip()
                if not part.startswith("imglora "):
                    continue
                try:
                    found.append((path.name, shlex.split(part.replace("…", "").replace("...", ""))))
                except ValueError:  # an unbalanced quote in prose
                    continue
    return found


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation other than '-' and '_'
    dropped, each space a '-'; a repeated heading gets '-1', '-2', ... after the first."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    inside = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        m = None if inside else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_github_anchors_follow_githubs_rule() -> None:
    page = "# Title\n## `imglora plan`: predicted against measured\n```\n# not a heading\n```\n## Outputs (`runs/<run.name>/`)\n## Tests\n### Tests\n"
    assert github_anchors(page) == {"title", "imglora-plan-predicted-against-measured", "outputs-runsrunname",
                                    "tests", "tests-1"}


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
    for page in PAGES.values():  # the marked line is the README's alone: a second one elsewhere could drift
        assert page is README or "# the tests:" not in page


def test_the_readme_is_a_front_door() -> None:
    """The README stays short and leads to every topic page."""
    lines = len(README.splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to a page under docs/"
    assert len(DOCS) >= 10
    linked = set(re.findall(r"\]\(docs/([^)#\s]+\.md)(?:#[^)\s]*)?\)", README))
    missing = sorted(p.name for p in DOCS if p.name not in linked)
    assert not missing, f"README.md links to no page {missing}: add one line each under Documentation"


def test_every_link_resolves() -> None:
    """Every relative link of the README and the pages leads to a file that exists, and an anchor
    to a heading of the page it names."""
    anchors = {path: github_anchors(text) for path, text in PAGES.items()}
    problems, checked = [], 0
    for path, text in PAGES.items():
        for target in re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", _prose(text)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            checked += 1
            if not dest.exists():
                problems.append(f"{path.name}: ({target}) names a file that does not exist")
            elif anchor and dest.suffix == ".md":
                have = anchors.get(dest) if dest in anchors else github_anchors(dest.read_text())
                if anchor not in have:
                    problems.append(f"{path.name}: ({target}) names no heading of {dest.name}")
    assert not problems, "\n".join(problems)
    assert checked >= len(DOCS)  # at least the README's own list of pages: a parsing slip that finds none must fail


def test_every_command_and_option_the_pages_name_exists() -> None:
    import click

    main = _cli()
    seen = 0
    for page, argv in _invocations():
        if len(argv) < 2 or argv[1].startswith("-") or argv[1].isupper():  # `imglora --help`, `imglora COMMAND`
            continue
        name = argv[1]
        assert name in main.commands, f"{page} names `imglora {name}`, which is not a command"
        cmd = main.commands[name]
        options = {o for p in cmd.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}
        options |= {"-h", "--help"}
        for arg in argv[2:]:
            if arg.startswith("--"):
                opt = arg.split("=", 1)[0]
                assert opt in options, f"{page}: `imglora {name}` has no option {opt} ({' '.join(argv)})"
        seen += 1
    assert seen >= 20  # the pages show every command; a parsing slip that finds none must fail
    shown = {argv[1] for _, argv in _invocations() if len(argv) > 1}
    assert set(main.commands) <= shown, f"no page shows `imglora {sorted(set(main.commands) - shown)}`"


def test_every_config_key_the_pages_name_exists() -> None:
    from imglora import config
    from imglora.families import registry

    keys = {k for k, _, _ in config.field_help(registry)}
    sections = {k.split(".")[0] for k in keys}
    named: dict[str, str] = {}
    for path, text in PAGES.items():
        for n in re.findall(r"`([a-z_0-9]+(?:\.[a-z_0-9]+)+)", text):
            if n.split(".")[0] in sections and not re.search(r"\.(py|toml)$", n):
                named.setdefault(n, path.name)
    assert len(named) > 40
    unknown = sorted(f"{n} ({page})" for n, page in named.items() if n not in keys and n not in NOT_KEYS
                     and not any(k.startswith(n + ".") for k in keys))
    assert not unknown, f"pages name keys the config does not have: {unknown}"
    for old in ("train.guidance", "train.noise_offset", "data.file"):  # quoted as moved: they must be refused now
        assert old not in keys


def test_every_preset_the_pages_name_ships() -> None:
    for path, text in PAGES.items():
        for name in set(re.findall(r"presets/([a-z0-9_-]+\.toml)", text)):
            assert (REPO / "presets" / name).is_file(), f"{path.name} names presets/{name}, which does not exist"


# Pages whose repository paths are history, not directions: docs/benchmarks.md records what was
# measured with the code of its day (its module and test paths are those of the commit it names).
PATHS_AS_OF_THEIR_DAY = {"benchmarks.md"}


def test_every_repository_path_the_pages_name_exists() -> None:
    """A file or folder a page names in inline code (`tests/...`, `benchmarks/...`, `src/...`,
    `sample_datasets/...`, `docs/...`) exists, read from the repository root."""
    missing = []
    for path, text in PAGES.items():
        if path.name in PATHS_AS_OF_THEIR_DAY:
            continue
        for named in set(re.findall(r"`((?:src|tests|benchmarks|sample_datasets|docs)/[^`\s<>]+)`", text)):
            named = named.split("::", 1)[0]
            if not list(REPO.glob(named)):
                missing.append(f"{path.name}: {named}")
    assert not missing, f"pages name repository paths that do not exist: {sorted(missing)}"
