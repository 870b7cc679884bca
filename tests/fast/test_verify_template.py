"""`verify-template` over the five shared tokenizers: the verdict for each official template, the family it
recommends, and that every family passes on its own tokenizer."""

from __future__ import annotations

import json

import pytest
from support.basics import cached_tokenizer, tokenizer_path

from tito_addon.tools.cli import main
from tito_addon.tools.template_verifier import render_report, verify

# tokenizer -> (does its own template pass as `default`?, the family the verifier recommends)
EXPECTED = {
    "qwen3": (False, "qwen3"),
    "qwen2.5": (True, None),
    "deepseek-r1": (False, "deepseek-r1"),
    "gpt-oss": (False, "gpt-oss"),
    "mistral": (False, "mistral"),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_verdict_for_each_official_template(name: str) -> None:
    passes, family = EXPECTED[name]
    verdict = verify(cached_tokenizer(name), tokenizer_path(name), "default")
    assert verdict.ok is passes
    assert verdict.turns and verdict.turns[0].ok  # a first turn is a plain render: always the same ids
    if passes:
        assert verdict.suggestion is None and all(verdict.roles.values()) and not verdict.probe_problems
        assert [c.ok for c in verdict.turns] == [True] * 5
    else:
        assert verdict.suggestion is not None and verdict.suggestion.family == family
        assert verdict.suggestion.ok and verdict.suggestion.suggestion is None
        assert not all(check.ok for check in verdict.turns) or verdict.probe_problems


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_family_passes_on_its_tokenizer(name: str) -> None:
    verdict = verify(cached_tokenizer(name), tokenizer_path(name), name)
    assert verdict.ok, render_report(verdict)
    assert [c.ok for c in verdict.turns] == [True] * 5
    assert set(verdict.roles) | set(verdict.refused_roles) == {"tool", "user", "system"}
    assert all(verdict.roles.values())


def test_report_names_the_roles_and_the_first_divergence() -> None:
    gpt_oss = verify(cached_tokenizer("gpt-oss"), tokenizer_path("gpt-oss"), "default", suggest=False)
    tool_turn = next(c for c in gpt_oss.turns if c.appended == ["tool", "tool"])
    # The official template names a tool result after the call; a synthetic context without the family's
    # rule cannot know the name.
    assert not tool_turn.ok and "first divergence at id" in tool_turn.detail
    assert "functions.tool to=assistant" in tool_turn.detail
    assert "functions.get_weather to=assistant" in tool_turn.detail
    mistral = verify(cached_tokenizer("mistral"), tokenizer_path("mistral"), "default", suggest=False)
    assert mistral.roles == {"tool": True, "user": False, "system": False}
    report = render_report(mistral)
    assert "appending tool: append-only" in report and "appending user: NOT append-only" in report
    assert "AVAILABLE_TOOLS" in report  # where the official template rewrites the prompt
    deepseek = verify(cached_tokenizer("deepseek-r1"), tokenizer_path("deepseek-r1"), "deepseek-r1")
    assert "system" in deepseek.refused_roles and "system: not appendable" in render_report(deepseek)


def test_kwargs_reach_every_render() -> None:
    verdict = verify(cached_tokenizer("gpt-oss"), tokenizer_path("gpt-oss"), "gpt-oss", {"reasoning_effort": "high"})
    assert verdict.ok and verdict.kwargs == {"reasoning_effort": "high"}
    broken = verify(cached_tokenizer("qwen3"), tokenizer_path("qwen3"), "qwen3", {"tools": []})
    assert not broken.ok and "may not set tools" in broken.startup_error


def test_cli_exit_codes_and_output(capsys) -> None:
    assert main(["verify-template", "--tokenizer", tokenizer_path("mistral"), "--family", "mistral"]) == 0
    assert "verdict: PASS" in capsys.readouterr().out
    # An explicit family is judged alone: no fallback to a suggestion.
    assert main(["verify-template", tokenizer_path("deepseek-r1"), "--family", "default"]) == 1
    out = capsys.readouterr().out
    assert "verdict: FAIL" in out and "suggestion" not in out
    # Without a family: `default` fails, the suggested family passes, and the report says which to use.
    assert main(["verify-template", tokenizer_path("qwen3")]) == 0
    assert "use --family qwen3 (tito_model_family=qwen3)" in capsys.readouterr().out
    code = main(
        [
            "verify-template",
            "--tokenizer",
            tokenizer_path("gpt-oss"),
            "--family",
            "gpt-oss",
            "--chat-template-kwargs",
            '{"reasoning_effort": "low"}',
            "--json",
        ]
    )
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["ok"] and payload["kwargs"] == {"reasoning_effort": "low"}
    assert payload["roles"] == {"tool": True, "user": True, "system": True}


def test_cli_usage_errors(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["verify-template", tokenizer_path("qwen3"), "--chat-template-kwargs", "[1]"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["verify-template"])
    assert main(["verify-template", "/nonexistent/tokenizer"]) == 2
    assert "cannot load tokenizer" in capsys.readouterr().err
