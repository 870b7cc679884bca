"""What an OpenAI Responses agent (Codex's shape) sends back: the output items it echoes and its function call
outputs."""

from __future__ import annotations

import json


def echo(response) -> list[dict]:
    """The output items as Codex sends them back: no ids, everything else verbatim."""
    items = []
    for item in response.output:
        dumped = item.model_dump(exclude_none=True)
        dumped.pop("id", None)
        dumped.pop("status", None)
        items.append(dumped)
    return items


def outputs(response) -> list[dict]:
    return [
        {
            "type": "function_call_output",
            "call_id": item.call_id,
            "output": f"{json.loads(item.arguments)['city']}: 21 C",
        }
        for item in response.output
        if item.type == "function_call"
    ]
