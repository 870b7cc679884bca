"""How the sglang replica behaves: :class:`ReplicaConfig`, and the model and version it reports."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from tito_addon.replicas.expert_routing import ExpertRoutingFields

MODEL_ID = "reference-model"
#: sglang version this replica claims to be (``/get_server_info``), by mode.
SGLANG_VERSION = "0.5.23"
OLD_SGLANG_VERSION = "0.5.12"


class ReplicaConfig(ExpertRoutingFields):
    """How the replica behaves.  Only ``tokenizer`` is required; the routed-experts knobs (``routed_experts``,
    ``moe_layers``, ``moe_topk``, ``moe_experts``) are :class:`ExpertRoutingFields`'."""

    model_config = ConfigDict(extra="forbid")

    tokenizer: str = Field(description="HF tokenizer directory or hub name")
    honor_input_ids: bool = Field(
        default=True,
        description="False emulates sglang < 0.5.13: input_ids / return_prompt_token_ids / "
        "return_meta_info / return_token_ids / sglext flags are silently ignored",
    )
    latency_s: float = Field(default=0.0, ge=0.0, description="sleep before answering a chat request")
    version: str = Field(default=SGLANG_VERSION, description="the sglang version it reports; sglext needs 0.5.20+")
    report_version: bool = Field(default=True, description="False: the server-info routes answer 404")
    context_length: int = Field(
        default=40960,
        gt=1,
        description="the model's context length (`max_model_len` at /v1/models); like sglang, a prompt plus its "
        "max_tokens at or past it is a 400",
    )
    checkpoint_shift: float = Field(
        default=0.0, description="scoring only (/generate): logprobs of a 'newer checkpoint', shifted by this much"
    )
    noncanonical: bool = Field(default=True, description="emit deliberately non-canonical token splits")
    weight_version: str = Field(
        default="default",
        description="what meta_info.weight_version and the response's metadata.weight_version say (sglang's "
        "--weight-version; a test may change it between requests, as an update_weights call would); like sglang, "
        "streamed chat chunks carry none",
    )
    token_delay_s: float = Field(
        default=0.0,
        ge=0.0,
        description="sleep after each sampled token, whole or streamed: generations take time, so a pause "
        "(`/pause_generation`, `/update_weight_version`, `/abort_request`) can cut them",
    )
    prefix_cache: bool = Field(
        default=True,
        description="simulate sglang's radix cache: meta_info.cached_tokens = longest prefix shared "
        "with an earlier prompt+completion (always < prompt length); False -> always 0",
    )
    # Steering for real agents (Claude Code, Codex), which offer a dozen tools and put context messages after the
    # prompt: by default the script calls the request's first tool with arguments made up from its schema, and only
    # when the last message is the user's. Both knobs unset keep that behaviour exactly.
    preferred_tools: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="tool name -> fixed arguments: when a call turn offers one of these tools (first listed here "
        "wins) the script calls it with these arguments instead of the first tool with made-up ones; parallel "
        "calls then repeat it. Two keys steer instead of being sent: `$once` (true: skip the tool once the "
        "conversation holds a call to it) and `$agent_ids` (an argument to fill with the `agent_id`s the "
        "conversation's tool results hold, as Codex's wait_agent needs; skip the tool while there are none)",
    )
    tool_budget: int | None = Field(
        default=None,
        ge=0,
        description="None: no limit. N: once the replica has answered N tool-call turns (since its last reset), every "
        "later turn answers: ends an agent whose contexts restart (compaction) whatever tool_rounds says",
    )
    tool_rounds: int | None = Field(
        default=None,
        ge=0,
        description="None: call a tool when the last message is the user's. N: call a tool while fewer than N "
        "assistant turns follow the last user message, whatever role comes last, then answer",
    )
    answer_sentences: int = Field(
        default=0, ge=0, description="sentences (~14 tokens each) added to every answer: long completions (benchmarks)"
    )
    # A compaction: the agent asks for a summary of the history so far (Claude Code's instruction asks for an
    # <analysis> then a <summary> block; Codex's begins "You are performing a CONTEXT CHECKPOINT COMPACTION").
    summary_markers: tuple[str, ...] = Field(
        default=("<summary>", "CONTEXT CHECKPOINT COMPACTION"),
        description="a last user message holding one of these asks for a summary: the script answers with text "
        "(never a tool call), whatever tool_rounds says",
    )
    vision: Literal["qwen2.5-vl", "qwen3-vl"] | None = Field(
        default=None,
        description="serve a vision-language model of this line: native /generate takes image_data and expands one "
        "<|image_pad|> per image in input_ids (SGLANG_MM_AVOID_RETOKENIZE)",
    )
    exact_images: bool = Field(
        default=True,
        description="False: the exact image path fails on every request and falls back, silently, to decoding the "
        "ids and re-tokenizing them (0.5.13-0.5.19 with a JPEG on a CUDA server)",
    )
    summary_text: str = Field(
        default="The user asked about the weather; the tools were called and their results reported.",
        description="the summary the script answers a summary request with, inside <summary> tags",
    )
