"""The README's Getting started recipes agree with its episode-naming table: the table's rows name what the recipes
run (the variables, the Codex config keys). Cheap; the recipes themselves run as written in the full tier
(test_readme_recipes.py)."""

from __future__ import annotations

import re

from support.readme_recipes import README, recipes

RECIPES = ["install", "terminal", "backend", "proxy", "openai-python", "claude-code", "codex", "gemini-cli", "look",
           "driver", "verl-step"]  # fmt: skip
AGENTS = ("openai-python", "Claude Code", "Codex", "Gemini CLI")  # the table's rows that recipes run


def agent_rows() -> dict[str, str]:
    """The episode-naming table's rows, by agent."""
    rows = {}
    for line in README.read_text().splitlines():
        cells = line.split(" | ")
        if line.startswith("| ") and len(cells) == 2 and cells[0][2:] in AGENTS:
            rows[cells[0][2:]] = cells[1]
    return rows


def test_readme_recipes_agree_with_the_agent_table() -> None:
    """Cheap, and first: the table's rows name what the recipes run (the variables, the Codex config keys)."""
    blocks, rows = recipes(), agent_rows()
    assert list(blocks) == RECIPES, list(blocks)
    assert sorted(rows) == sorted(AGENTS), rows
    for agent, recipe, episode in (("openai-python", "openai-python", "weather"), ("Claude Code", "claude-code",
                                   "claude"), ("Codex", "codex", "codex"), ("Gemini CLI", "gemini-cli",
                                   "gemini")):  # fmt: skip
        reverse = rows[agent][rows[agent].index("reverse:") :]
        spans = re.findall(r"`([^`]+)`", reverse)
        settings = [word for span in spans for word in re.findall(r"\b[A-Z_]+=\S+|\b[a-z_]+ = \"[^\"]*\"", span)]
        assert settings, (agent, reverse)
        for setting in settings:
            if "ANTHROPIC_AUTH_TOKEN" in setting:  # the row's alternative to the recipe's x-api-key
                continue
            assert setting.replace("ep-7", episode) in blocks[recipe], (agent, setting)
