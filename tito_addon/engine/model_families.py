"""Model families: which chat template renders a family's prompts, which kwargs it pins, and what it cannot append.

The boundary rule (what follows a stored completion before the next message) is not hard-coded per family: it is
read off the family's own template (see `TokenEngine.end_of_turn_tails`), so every family closes a turn exactly as
its template would. A family only says what the template cannot tell: how to close a completion that was cut off,
which roles can never be appended, and where the names of the called tools are in the model's own ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from tito_addon.engine.vision_tokens import QWEN2_5_VL, QWEN3_VL, VisionScheme

# gpt-oss's template writes the render date into the system message. A fixed date keeps the same conversation at
# the same ids on every day and in every process (prefix caching, GRPO groups, replays); set `current_date` in
# tito_chat_template_kwargs to tell the model another date.
GPT_OSS_PINNED_DATE = "2025-08-05"
_SYSTEM_AT_START = (
    "its template places every system message at the start of the prompt (before the first user turn), so a system "
    "message appended later would rewrite the stored prefix; allow only tool and user appends "
    "(tito_append_roles=tool,user)"
)


@dataclass(frozen=True)
class ModelFamily:
    name: str
    description: str
    # None: the tokenizer's own template.
    template_file: str | None = None
    pinned_kwargs: dict[str, Any] = field(default_factory=dict)
    # The template must encode a lone "\n" as one token (the Qwen end-of-turn newline).
    single_token_newline: bool = False
    # Roles this family can never append to a stored turn, and why: refused when the engine starts.
    refused_append_roles: dict[str, str] = field(default_factory=dict)
    # Text that closes a completion which did not end its own turn (cut off by max_tokens or a stop string).
    # None: the template's end-of-turn tail after assistant text.
    unterminated_close: str | None = None
    # A regex whose first group finds, in order, the names of the tools a completion called (decoded text). For
    # templates that name the called tool in a tool result's header (harmony); a synthetic context then names them
    # as the real history does, which the OpenAI wire format (no `name` on tool messages) cannot tell.
    tool_call_name_pattern: str | None = None
    # Tokens the model stops on besides the tokenizer's eos (found without a generation_config.json).
    stop_tokens: tuple[str, ...] = ()
    # The template kwarg that turns thinking on or off, for agents whose API has a thinking switch (Anthropic's
    # `thinking`); None: the family has no switch (it always reasons, or never does).
    thinking_switch: str | None = None
    # The token that ends a completion's reasoning (a turn that reasons counts its reasoning tokens up to it, or all
    # of them when it was cut off before); None: the family never reasons.
    reasoning_end: str | None = None
    # vLLM's streaming derender may be given several generate chunks merged into one: true where the server's parsers
    # for this family give the same final message however the output is chunked (qwen3 reasoning with the hermes or
    # qwen3 tool parsers; harmony). Not for deepseek_v3 or mistral (0.31) tool parsers: chunked differently, they
    # were measured to lose content or arguments, so those turns keep one derender call per generate chunk.
    chunking_invariant_parsers: bool = False
    # The servers' parsers for this family read of the prompt only its last ids and which special token came last
    # (vLLM derender), and of the conversation nothing (vLLM derender; sglang given input_ids reads only tool-bearing
    # system messages and an assistant prefill): `backends/parser_inputs.py`. So they are sent a seed of the prompt
    # and no conversation. False (the default family, whose server parsers are unknown): the whole of both.
    compact_requests: bool = False
    # How the family's model sees images (its placeholder and its processor's resize); None: it reads text only.
    vision: VisionScheme | None = None

    def thinking_kwargs(self, enabled: bool | None) -> dict[str, Any]:
        if enabled is None or self.thinking_switch is None:
            return {}
        return {self.thinking_switch: enabled}

    def chat_template(self) -> str | None:
        if self.template_file is None:
            return None
        return resources.files("tito_addon.engine.chat_templates").joinpath(self.template_file).read_text("utf-8")


FAMILIES: dict[str, ModelFamily] = {
    "qwen3": ModelFamily(
        name="qwen3",
        description=(
            "Qwen3 hybrid-thinking models: the official template, changed to keep every earlier <think> block so "
            "prompts stay append-only; the newline after <|im_end|> that the model never emits is re-inserted."
        ),
        template_file="qwen3_keep_thinking.jinja",
        single_token_newline=True,
        thinking_switch="enable_thinking",
        reasoning_end="</think>",
        chunking_invariant_parsers=True,
        compact_requests=True,
    ),
    "qwen2.5": ModelFamily(
        name="qwen2.5",
        description=(
            "Qwen2.5 instruct and coder models: the official template (append-only as shipped); the newline "
            "after <|im_end|> is re-inserted."
        ),
        single_token_newline=True,
        chunking_invariant_parsers=True,
        compact_requests=True,
    ),
    "qwen2.5-vl": ModelFamily(
        name="qwen2.5-vl",
        description=(
            "Qwen2.5-VL vision-language models: the official template's image and text parts, framed with tools as "
            "Qwen2.5-Instruct frames them (the official VL template drops tools); each image is "
            "<|vision_start|><|image_pad|><|vision_end|>, its pad repeated once per 28×28 pixels of the resized image "
            "(patch 14, merge 2, 3,136 to 12,845,056 pixels); the newline after <|im_end|> is re-inserted."
        ),
        template_file="qwen2_5_vl_tools.jinja",
        single_token_newline=True,
        chunking_invariant_parsers=True,
        compact_requests=True,
        vision=QWEN2_5_VL,
    ),
    "qwen3-vl": ModelFamily(
        name="qwen3-vl",
        description=(
            "Qwen3-VL instruct models: the official template as shipped (images in user messages and tool results); "
            "each image's pad repeated once per 32×32 pixels of the resized image (patch 16, merge 2, 65,536 to "
            "16,777,216 pixels); the newline after <|im_end|> is re-inserted. System messages only at the start."
        ),
        template_file="qwen3_vl_instruct.jinja",
        single_token_newline=True,
        chunking_invariant_parsers=True,
        compact_requests=True,
        vision=QWEN3_VL,
        refused_append_roles={
            "system": "its template renders a system message only as the first message (a later one is dropped); "
            "allow only tool and user appends (tito_append_roles=tool,user)"
        },
    ),
    "deepseek-r1": ModelFamily(
        name="deepseek-r1",
        description=(
            "DeepSeek-R1 / V3-family models: the official template, changed to keep every earlier <think> block "
            "and to frame every tool-call turn and tool-result run the same way; a turn ends at "
            "<｜end▁of▁sentence｜>, which the model emits, so nothing is inserted after it. System messages only "
            "at the start."
        ),
        template_file="deepseek_r1_keep_thinking.jinja",
        reasoning_end="</think>",
        compact_requests=True,
        refused_append_roles={"system": _SYSTEM_AT_START},
    ),
    "gpt-oss": ModelFamily(
        name="gpt-oss",
        description=(
            "gpt-oss (harmony): the official template, changed to keep every analysis message, to end a final "
            "answer with the <|return|> the model stopped on (a tool call ends with <|call|>), and to pin the date "
            f"(current_date={GPT_OSS_PINNED_DATE}); a cut-off message is closed with <|end|>."
        ),
        template_file="gpt_oss_keep_analysis.jinja",
        pinned_kwargs={"current_date": GPT_OSS_PINNED_DATE},
        unterminated_close="<|end|>",
        tool_call_name_pattern=r"to=functions\.([^\s<]+)",
        stop_tokens=("<|return|>", "<|call|>"),
        reasoning_end="<|end|>",  # of the analysis message, which comes first
        chunking_invariant_parsers=True,
        compact_requests=True,
    ),
    "mistral": ModelFamily(
        name="mistral",
        description=(
            "Mistral v3 instruct models (SentencePiece, [INST] framing): the official template, changed to keep the "
            "system message and [AVAILABLE_TOOLS] at the first user turn; a turn ends at </s>, which the model "
            "emits. System messages only at the start."
        ),
        template_file="mistral_v3_append_only.jinja",
        compact_requests=True,
        refused_append_roles={
            "system": (
                "its template accepts a system message only as the first message (it is merged into the first "
                "user turn); allow only tool and user appends (tito_append_roles=tool,user)"
            )
        },
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
        if "<|image_pad|>" in template:
            return "qwen3-vl" if "content.type == 'image'" in template else "qwen2.5-vl"
        return "qwen3" if "<think>" in template else "qwen2.5"
    if "<｜Assistant｜>" in template:
        return "deepseek-r1"
    if "<|channel|>" in template and "<|start|>" in template:
        return "gpt-oss"
    if "[INST]" in template:
        return "mistral"
    return None
