"""The README's recipes: every block marked `<!-- recipe: NAME -->`, by name, as the README holds it, in Getting started
and in Many engines; run as written by test_readme_recipes.py (the full tier), Getting started's checked against the
agent table by test_readme_agent_table.py."""

from __future__ import annotations

import re

from .basics import REPO

README = REPO / "README.md"
RECIPE = re.compile(r"<!-- recipe: ([\w-]+) -->\n```bash\n(.*?)```", re.S)


def section(heading: str) -> str:
    """The README from `heading` to the next heading of its level or above."""
    text = README.read_text()
    start = text.index(heading)
    level = heading.split(" ", 1)[0]
    ends = [text.find(f"\n{mark} ", start + 1) for mark in ("#" * n for n in range(2, len(level) + 1))]
    return text[start : min([end for end in ends if end >= 0], default=len(text))]


def getting_started() -> str:
    return section("## Getting started")


def recipes() -> dict[str, str]:
    found = RECIPE.findall(getting_started())
    return dict(found)


def engine_recipes() -> dict[str, str]:
    """Many engines' recipes: each router's engines, router, proxy and turns."""
    return dict(RECIPE.findall(section("### Many engines")))
