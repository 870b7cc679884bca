"""How the vLLM replica behaves (:class:`VllmReplicaConfig`) and what each of its endpoints shares: vLLM's error
shape, the version's ids and the model check (:class:`VllmEndpoint`, the base of the render, generate and derender
endpoints the replica is made of).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import ConfigDict, Field

from tito_addon.replicas.expert_routing import ExpertRoutingFields
from tito_addon.replicas.replica_tokenizer import ReplicaTokenizer

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "TimeoutError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

MAX_TOP_LOGPROBS = 20


class VllmReplicaConfig(ExpertRoutingFields):
    """How the vLLM replica behaves.  Only ``tokenizer`` is required; the routed-experts knobs (``routed_experts``,
    ``moe_layers``, ``moe_topk``, ``moe_experts``) are :class:`ExpertRoutingFields`'."""

    model_config = ConfigDict(extra="forbid")

    tokenizer: str = Field(description="HF tokenizer directory or hub name (Qwen3 chat format)")
    version: Literal["0.24.0", "0.32.0"] = "0.32.0"
    enable_scale_out: bool = Field(
        default=True,
        description="False: render/derender/generate answer 403 like vLLM >= 0.30 without --enable-scale-out "
        "(0.24 always registers them)",
    )
    tool_parser: bool = Field(default=True, description="--enable-auto-tool-choice --tool-call-parser hermes")
    reasoning_parser: bool = Field(default=True, description="--reasoning-parser qwen3")
    served_model_name: str = "tiny-qwen3"
    max_model_len: int = Field(default=4096, gt=1)
    noncanonical: bool = Field(default=True, description="emit deliberately non-canonical token splits")
    latency_s: float = Field(default=0.0, ge=0.0, description="sleep before answering each generate call")
    stream_delay_s: float = Field(default=0.0, ge=0.0, description="sleep between streamed generate events")
    token_delay_s: float = Field(
        default=0.0,
        ge=0.0,
        description="sleep after each sampled token, whole or streamed: generations take time, so a pause can cut "
        "them (without it a whole generation runs between two checks)",
    )
    dev_mode: bool = Field(
        default=True,
        description="VLLM_SERVER_DEV_MODE=1: the weight-update routes (/pause, /resume, /is_paused, "
        "/update_weight_version, /finish_weight_update, /inference/v1/abort_requests)",
    )
    answer_sentences: int = Field(
        default=0, ge=0, description="sentences (~14 tokens each) added to every answer: long completions (benchmarks)"
    )
    derender_delay_s: float = Field(
        default=0.0, ge=0.0, description="sleep before answering each streaming derender call (a busy server)"
    )
    weight_version: str = Field(
        default="default",
        description="0.32: the version in each generate choice's weight_versions span (a test may change it "
        "between requests, as a weight update would)",
    )
    previous_weight_version: str | None = Field(
        default=None,
        description="0.32: weights updated during every generation: the first half of its tokens report this "
        "version and the rest weight_version (two weight_versions spans)",
    )
    vision: Literal["qwen2.5-vl", "qwen3-vl"] | None = Field(
        default=None,
        description="serve a vision-language model of this line: chat image_url parts are loaded and expanded by "
        "render (features), and generate takes features",
    )
    chat_template: str | None = Field(default=None, description="--chat-template: a template file to render with")


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def bad_request(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's ErrorResponse: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError"),
            "param": param,
            "code": status,
        }
    }


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class VllmEndpoint:
    """What every endpoint of the vLLM replica reads (the replica is made of them): its config and tokenizer."""

    config: VllmReplicaConfig
    tokenizer: ReplicaTokenizer

    @property
    def v32(self) -> bool:
        return self.config.version == "0.32.0"

    def _random_id(self) -> str:
        """vLLM's ``random_uuid()``: 16 hex digits in 0.32, a full uuid4 hex in 0.24."""
        return uuid.uuid4().hex[:16] if self.v32 else uuid.uuid4().hex

    def _room(self, n_prompt: int, advice: str = "") -> int:
        """The tokens a prompt of ``n_prompt`` leaves of the context; none is vLLM's 400, ``advice`` ending it."""
        room = self.config.max_model_len - n_prompt
        if room <= 0:
            raise bad_request(
                f"This model's maximum context length is {self.config.max_model_len} tokens. However, your "
                f"request has {n_prompt} input tokens.{advice}"
            )
        return room

    def _check_model(self, model: Any) -> None:
        if model is None:
            return
        if model != self.config.served_model_name:
            raise HttpError(404, f"The model `{model}` does not exist.", param="model")
