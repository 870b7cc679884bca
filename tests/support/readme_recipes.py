"""The README's Getting started recipes: every block marked `<!-- recipe: NAME -->`, by name, as the README holds it;
run as written by test_readme_recipes.py (the full tier), checked against the agent table by
test_readme_agent_table.py."""

from __future__ import annotations

import re

from .basics import REPO

README = REPO / "README.md"
RECIPE = re.compile(r"<!-- recipe: ([\w-]+) -->\n```bash\n(.*?)```", re.S)


def getting_started() -> str:
    text = README.read_text()
    start = text.index("## Getting started")
    return text[start : text.index("\n## ", start + 1)]


def recipes() -> dict[str, str]:
    found = RECIPE.findall(getting_started())
    return dict(found)
