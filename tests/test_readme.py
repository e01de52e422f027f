"""README.md stays true for a first-time reader: short, two commands, every CLI option, the
Python floor that is tested, no internal target columns or unmeasured references, links that
lead somewhere; and CHANGELOG.md's Unreleased section stays a short list for users."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

from torch_serialized.cli import _parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
CHANGELOG = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
DOCS = sorted((ROOT / "docs").glob("*.md"))


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings (fenced code left out)."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    titles = re.findall(r"^#{1,6} (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", t.strip().lower()).replace(" ", "-") for t in titles}


def test_readme_and_changelog_stay_short() -> None:
    assert len(README.splitlines()) <= 300
    start = CHANGELOG.index("## [Unreleased]")
    end = CHANGELOG.find("\n## [", start)
    unreleased = CHANGELOG[start : end if end > 0 else None].rstrip("\n")
    assert len(unreleased.splitlines()) <= 120


def test_exactly_two_commands_for_a_fresh_machine() -> None:
    blocks = re.findall(r"```bash\n(.*?)```", section("Two commands"), re.S)
    assert len(blocks) == 2 and all(b.count("\n") == 1 for b in blocks), blocks
    demo, tests = (b.strip() for b in blocks)
    assert demo.startswith("python3 -m venv .venv && ") and demo.endswith("torch-serialized demo")
    assert tests.startswith("python3 -m venv .venv && ") and tests.endswith("-m pytest")
    assert '".[test]"' in tests


def test_the_command_line_summary_lists_every_option() -> None:
    summary = section("Command line")
    commands = next(
        a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    missing = []
    for name, parser in commands.items():
        assert f"torch-serialized {name}" in summary, name
        for action in parser._actions:
            options = [o for o in action.option_strings if o not in ("-h", "--help")]
            if options and not any(o in summary for o in options):
                missing.append(f"{name} {options[0]}")
    assert missing == []


def test_requires_python_is_what_readme_and_the_linters_say() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    floor = project["project"]["requires-python"].removeprefix(">=")
    assert f"Python {floor} or newer" in README and f"CI: Python {floor}" in README
    assert project["tool"]["mypy"]["python_version"] == floor
    assert project["tool"]["ruff"]["target-version"] == "py" + floor.replace(".", "")


def test_performance_shows_measured_figures_only() -> None:
    performance = section("Performance")
    header = next(line for line in performance.splitlines() if line.startswith("| scenario"))
    assert "target" not in header
    assert "missed" not in performance and "met" not in performance.split()
    assert "PEERS.md" not in README


def test_named_examples_exist() -> None:
    for name in re.findall(r"`(\w+\.py)`", section("Which API to use")):
        assert (ROOT / "examples" / name).is_file(), name


def test_links_in_readme_and_docs_lead_somewhere() -> None:
    pages = [ROOT / "README.md", *DOCS]
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for link in re.findall(r"\]\(((?!http)[^)]+)\)", text):
            path, _, anchor = link.partition("#")
            target = (page.parent / path) if path else page
            assert target.exists(), f"{page.name}: {link}"
            if anchor and target.suffix == ".md":
                assert anchor in anchors(target.read_text(encoding="utf-8")), f"{page.name}: {link}"
