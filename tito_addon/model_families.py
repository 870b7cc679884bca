"""Model families: which chat template renders a family's prompts, and which kwargs it pins.

The boundary rule (what follows a stored completion before the next message) is not hard-coded per
family: it is read off the family's own template (see `TokenEngine.end_of_turn_ids`), so every family
closes a turn exactly as its template would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class ModelFamily:
    name: str
    description: str
    # None: the tokenizer's own template.
    template_file: str | None = None
    pinned_kwargs: dict[str, Any] = field(default_factory=dict)
    # The template must encode a lone "\n" as one token (the Qwen end-of-turn newline).
    single_token_newline: bool = False

    def chat_template(self) -> str | None:
        if self.template_file is None:
            return None
        return resources.files("tito_addon.chat_templates").joinpath(self.template_file).read_text("utf-8")


FAMILIES: dict[str, ModelFamily] = {
    "qwen3": ModelFamily(
        name="qwen3",
        description=(
            "Qwen3 hybrid-thinking models: the official template, changed to keep every earlier <think> block so "
            "prompts stay append-only; the newline after <|im_end|> that the model never emits is re-inserted."
        ),
        template_file="qwen3_keep_thinking.jinja",
        single_token_newline=True,
    ),
    "qwen2.5": ModelFamily(
        name="qwen2.5",
        description=(
            "Qwen2.5 instruct and coder models: the official template (append-only as shipped); the newline "
            "after <|im_end|> is re-inserted."
        ),
        single_token_newline=True,
    ),
    "default": ModelFamily(
        name="default",
        description=(
            "The tokenizer's own template, used only if a probe at startup shows it is append-only for the "
            "configured roles; the end-of-turn tail is read off the template."
        ),
    ),
}


def suggest_family(template: str) -> str | None:
    """The family to recommend when a tokenizer's own template fails the append-only probe."""
    if "<|im_start|>" in template:
        return "qwen3" if "<think>" in template else "qwen2.5"
    return None
