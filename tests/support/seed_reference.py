"""The reference for the prompt seed vLLM's derender is sent (`backends/parser_inputs.prompt_seed`): a plain forward
loop over the prompt, for the parser-input sweeps, the live vLLM replica tests and the real-vLLM tier."""

from __future__ import annotations

from tito_addon.backends.parser_inputs import PROMPT_TAIL


def expected_seed(ids: list[int], special: frozenset[int], tail: int = PROMPT_TAIL) -> list[int]:
    """The reference: a plain forward loop over the prompt."""
    if len(ids) <= tail:
        return list(ids)
    head = len(ids) - tail
    last: dict[int, int] = {}
    for position, token in enumerate(ids[:head]):
        if token in special:
            last[token] = position
    return [ids[p] for p in sorted(last.values())] + ids[head:]
