"""The README as a user reads it: its links and anchors lead somewhere, its Python examples are Python, the
figures it links are the ones bench/RESULTS.md has, and it speaks of commands, not of the test suite's files."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    headings = {github_slug(m) for m in re.findall(r"^#{1,6} (.+)$", markdown, flags=re.M)}
    return headings | set(re.findall(r'<a id="([^"]+)"', markdown))


def test_every_link_of_the_readme_leads_somewhere() -> None:
    own = anchors(README)
    broken = []
    for target in LINK.findall(README):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        if not path:
            ok = anchor in own
        else:
            file = REPO / path
            ok = file.exists() and (not anchor or anchor in anchors(file.read_text()))
        if not ok:
            broken.append(target)
    assert not broken, f"links to nowhere: {broken}"


def test_the_contents_list_every_top_level_section() -> None:
    sections = re.findall(r"^## (.+)$", README, flags=re.M)
    contents = README.split("## Contents", 1)[1].split("\n## ", 1)[0]
    missing = [s for s in sections if s not in ("Contents", "Quick start") and f"(#{github_slug(s)})" not in contents]
    assert not missing, f"sections missing from the contents: {missing}"


def test_python_examples_are_python() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks
    for block in blocks:
        ast.parse(block)


def test_user_text_names_no_test_files() -> None:
    assert not re.findall(r"\btests/[\w/]+\.py", README)


@pytest.mark.parametrize("command", ["make serve", "make test"])
def test_the_two_set_up_commands_come_first(command: str) -> None:
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert f"\n{command} " in quick_start
