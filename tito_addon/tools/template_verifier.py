"""`verify-template`: is a tokenizer's template (as a family renders it) safe for token-exact turns?

Two checks, both on the real tokenizer: the engine's startup probe (each appendable role, after a tool call and
after a final answer), and whole conversations (system, user, reasoning, parallel tool calls, tool results, later
user and system turns) built turn by turn as the proxy builds them (stored prompt + completion ids, then the
continuation) and compared, id by id, with a from-scratch render of the same messages. A completion is the
template's own rendering of the reply, ending at the stop id the model ends on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tito_addon.canonical_chat import ChatMessage
from tito_addon.engine.model_families import FAMILIES, suggest_family
from tito_addon.engine.template_messages import template_message
from tito_addon.engine.token_engine import APPENDABLE_ROLES, TokenEngine
from tito_addon.tito_errors import TitoError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    },
]


def _m(**fields: Any) -> ChatMessage:
    return ChatMessage.model_validate(fields)


def _call(call_id: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    # Nine alphanumerics: Mistral's template refuses any other tool-call id.
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def conversation(with_system_turn: bool) -> list[tuple[list[ChatMessage], ChatMessage]]:
    """(appended messages, assistant reply) per turn."""
    turns = [
        (
            [_m(role="system", content="You are a travel agent."), _m(role="user", content="Weather and a café?")],
            _m(
                role="assistant",
                content="",
                reasoning_content="Two independent lookups.",
                tool_calls=[
                    _call("callAAA01", "get_weather", {"city": "Oslo"}),
                    _call("callBBB02", "search", {"q": "café Oslo"}),
                ],
            ),
        ),
        (
            [
                _m(role="tool", tool_call_id="callAAA01", content='{"temp_c": -3}'),
                _m(role="tool", tool_call_id="callBBB02", content="Fuglen"),
            ],
            _m(role="assistant", content="−3 °C; try Fuglen.", reasoning_content="Combine both results."),
        ),
        (
            [_m(role="user", content="And in Paris?")],
            _m(
                role="assistant",
                content="",
                reasoning_content="One lookup.",
                tool_calls=[_call("callCCC03", "get_weather", {"city": "Paris"})],
            ),
        ),
        (
            [_m(role="tool", tool_call_id="callCCC03", content='{"temp_c": 21}')],
            _m(role="assistant", content="21 °C in Paris.", reasoning_content="Report it."),
        ),
    ]
    last: list[ChatMessage] = [_m(role="user", content="Thanks! 谢谢")]
    if with_system_turn:
        last.insert(0, _m(role="system", content="Answer in one line."))
    turns.append((last, _m(role="assistant", content="You're welcome!", reasoning_content="Short.")))
    return turns


@dataclass
class TurnCheck:
    turn: int
    appended: list[str]
    ok: bool
    detail: str = ""


@dataclass
class Verdict:
    tokenizer: str
    family: str
    kwargs: dict[str, Any]
    ok: bool = False
    startup_error: str = ""
    refused_roles: dict[str, str] = field(default_factory=dict)
    probe_problems: list[str] = field(default_factory=list)
    turns: list[TurnCheck] = field(default_factory=list)
    roles: dict[str, bool] = field(default_factory=dict)
    suggestion: Verdict | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "tokenizer": self.tokenizer,
            "family": self.family,
            "kwargs": self.kwargs,
            "ok": self.ok,
            "startup_error": self.startup_error or None,
            "refused_roles": self.refused_roles,
            "probe_problems": self.probe_problems,
            "turns": [vars(t) for t in self.turns],
            "roles": self.roles,
            "suggestion": self.suggestion.to_json() if self.suggestion else None,
        }


def _window(engine: TokenEngine, ids: list[int], at: int) -> str:
    return repr(engine.tokenizer.decode(ids[max(0, at - 6) : at + 10], skip_special_tokens=False))


def _divergence(engine: TokenEngine, incremental: list[int], scratch: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(incremental, scratch, strict=False)) if a != b), None)
    if at is None:
        at = min(len(incremental), len(scratch))
    return (
        f"first divergence at id {at} (incremental {len(incremental)} ids, from scratch {len(scratch)}): "
        f"incremental {_window(engine, incremental, at)} vs from scratch {_window(engine, scratch, at)}"
    )


def _completion(engine: TokenEngine, history: list[dict[str, Any]], reply: dict[str, Any], kwargs: dict[str, Any]):
    prompt = engine.render(history, TOOLS, add_generation_prompt=True, kwargs=kwargs)
    full = engine.render(history + [reply], TOOLS, add_generation_prompt=False, kwargs=kwargs)
    if not full.startswith(prompt):
        raise ValueError("adding the assistant reply rewrites its own prompt: " + _text_divergence(prompt, full))
    ids = engine.encode(full[len(prompt) :])
    # The model stops on a stop id; whatever the template writes after it is the boundary's to insert.
    stops = [i for i, token in enumerate(ids) if token in engine.stop_ids]
    return ids[: stops[-1] + 1] if stops else ids


def _text_divergence(before: str, after: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), min(len(before), len(after)))
    return f"at character {at}: {before[at : at + 40]!r} becomes {after[at : at + 40]!r}"


def run_conversation(engine: TokenEngine, kwargs: dict[str, Any]) -> list[TurnCheck]:
    checks: list[TurnCheck] = []
    history: list[dict[str, Any]] = []
    stored: list[int] | None = None
    completion: list[int] = []
    for turn, (appended, reply) in enumerate(conversation("system" in engine.append_roles)):
        roles = [m.role for m in appended]
        try:
            if stored is None:
                prompt = engine.first_turn(appended, TOOLS, kwargs).ids
            else:
                prompt = stored + engine.continuation(completion, appended, TOOLS, kwargs).ids
            history += [template_message(m) for m in appended]
            scratch = engine.encode(engine.render(history, TOOLS, add_generation_prompt=True, kwargs=kwargs))
        except (TitoError, ValueError) as exc:
            checks.append(TurnCheck(turn, roles, False, getattr(exc, "message", str(exc))))
            break
        checks.append(
            TurnCheck(turn, roles, prompt == scratch, "" if prompt == scratch else _divergence(engine, prompt, scratch))
        )
        try:
            rendered_reply = template_message(reply)
            completion = _completion(engine, history, rendered_reply, kwargs)
        except (TitoError, ValueError) as exc:
            checks.append(TurnCheck(turn, ["assistant reply"], False, getattr(exc, "message", str(exc))))
            break
        history.append(rendered_reply)
        stored = prompt + completion
    return checks


def verify(
    tokenizer: Any, tokenizer_name: str, family_name: str, kwargs: dict[str, Any] | None = None, *, suggest: bool = True
) -> Verdict:
    family = FAMILIES[family_name]
    kwargs = dict(kwargs or {})
    verdict = Verdict(tokenizer_name, family_name, kwargs, refused_roles=dict(family.refused_append_roles))
    roles = tuple(r for r in APPENDABLE_ROLES if r not in family.refused_append_roles)
    try:
        engine = TokenEngine(tokenizer, family, append_roles=roles, pinned_kwargs=kwargs, tokenizer_name=tokenizer_name)
    except (TitoError, ValueError) as exc:
        verdict.startup_error = getattr(exc, "message", str(exc))
        return verdict
    verdict.probe_problems = engine.append_only_problems()
    verdict.turns = run_conversation(engine, engine.effective_kwargs({}))
    for role in roles:
        probe_ok = not any(p.startswith(f"appending a {role} message") for p in verdict.probe_problems)
        turns_ok = all(check.ok for check in verdict.turns if role in check.appended)
        verdict.roles[role] = probe_ok and turns_ok
    verdict.ok = not verdict.probe_problems and all(check.ok for check in verdict.turns)
    if not verdict.ok and suggest:
        hint = suggest_family(engine.template)
        if hint and hint != family_name:
            verdict.suggestion = verify(tokenizer, tokenizer_name, hint, kwargs, suggest=False)
    return verdict


def render_report(verdict: Verdict, indent: str = "") -> str:
    lines = [
        f"{indent}tokenizer: {verdict.tokenizer}",
        f"{indent}family: {verdict.family} (tito_model_family={verdict.family})"
        + (f", chat template kwargs {json.dumps(verdict.kwargs)}" if verdict.kwargs else ""),
        f"{indent}verdict: {'PASS' if verdict.ok else 'FAIL'}",
    ]
    if verdict.startup_error:
        lines.append(f"{indent}  the engine refuses to start: {verdict.startup_error}")
    for role, why in verdict.refused_roles.items():
        lines.append(f"{indent}  {role}: not appendable in this family ({why})")
    for role, ok in verdict.roles.items():
        lines.append(f"{indent}  appending {role}: {'append-only' if ok else 'NOT append-only'}")
    if verdict.probe_problems:
        lines.append(f"{indent}  startup probe:")
        lines += [f"{indent}    - {problem}" for problem in verdict.probe_problems]
    if verdict.turns:
        lines.append(f"{indent}  multi-turn, incremental vs from scratch:")
        for check in verdict.turns:
            status = "same ids" if check.ok else f"DIFFERENT: {check.detail}"
            lines.append(f"{indent}    turn {check.turn} (appends {', '.join(check.appended)}): {status}")
    if verdict.suggestion is not None:
        suggested = verdict.suggestion
        lines.append(
            f"{indent}suggestion: family {suggested.family} "
            + (
                f"passes: use --family {suggested.family} (tito_model_family={suggested.family})"
                if suggested.ok
                else "fails as well:"
            )
        )
        lines.append(render_report(suggested, indent + "  "))
    return "\n".join(lines)
