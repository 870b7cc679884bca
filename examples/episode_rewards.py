"""Reward functions for examples/rollout_driver.py (`--reward episode_rewards:NAME`, or `--reward PATH.py:NAME` for
one of your own). Each takes the dict the driver builds for one finished episode and returns a float, or a float and
labels:

    {"episode": "run-…-0003", "group": "task-1", "prompt": "…", "ground_truth": … or None, "metadata": {…},
     "answer": "the agent's final text" or None, "outcome": {"finish_reason", "answer", "tool_calls", "tool_errors"},
     "exit_code": 0}

A function that raises, or returns anything but a finite number (and a list of strings), gives the episode no
reward: the driver says why, leaves the episode out of the export and exits non-zero.
"""

from __future__ import annotations

import re
from typing import Any


def tool_use(episode: dict[str, Any]) -> tuple[float, list[str]]:
    """The driver's default rule: 1 for an agent that used its tool without errors and then answered; 0.5 for an
    answer without a tool call; 0 for an unfinished episode or a tool error."""
    outcome = episode.get("outcome") or {}
    if outcome.get("finish_reason") != "stop" or not outcome.get("answer"):
        return 0.0, ["unfinished"]
    if outcome.get("tool_errors"):
        return 0.0, ["tool_error"]
    if outcome.get("tool_calls"):
        return 1.0, ["tool_used", "answered"]
    return 0.5, ["answered"]


def normalized(text: Any) -> str:
    return re.sub(r"\s+", " ", str(text)).strip().lower()


def matches_ground_truth(episode: dict[str, Any]) -> tuple[float, list[str]]:
    """1 when the agent's answer contains the task's ground truth (case and spacing ignored; a list: any of them),
    else 0. A task without ground truth cannot be scored by this rule: that is an error, not a 0."""
    truth = episode.get("ground_truth")
    if truth is None:
        raise ValueError(f"task of {episode.get('episode')} has no ground_truth (give one in the --tasks-file line)")
    answer = normalized(episode.get("answer") or "")
    wanted = truth if isinstance(truth, list) else [truth]
    if answer and any(normalized(w) in answer for w in wanted):
        return 1.0, ["correct"]
    return 0.0, ["incorrect" if answer else "no_answer"]
