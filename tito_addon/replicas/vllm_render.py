"""vLLM's ``POST /v1/chat/completions/render``: a ChatCompletionRequest in, a ``GenerateRequest`` out.

Prompt ids from the tokenizer's stock chat template (after vLLM's own message preprocessing), and sampling params
resolved and serialized like vLLM, including the real "``max_tokens: 16`` is dropped" serialization bug.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from tito_addon.replicas.scripted_model import ASSISTANT_OPEN, THINK_END
from tito_addon.replicas.vision_processing import IMAGE_PAD, ImageLoadError, SeenImage, VisionModel, expand
from tito_addon.replicas.vllm_config import MAX_TOP_LOGPROBS, VllmEndpoint, bad_request, is_int, is_number

#: vLLM's SamplingParams default ``max_tokens``; msgspec's omit_defaults drops a value equal to it.
_SAMPLING_DEFAULT_MAX_TOKENS = 16
_GREEDY_EPS = 1e-5
#: ChatParams defaults that 0.32's render reports in ``reasoning_parser_kwargs`` (recorded).
_CHAT_PARAM_DEFAULTS = {"cohere_format": "cmd4"}


class RenderEndpoint(VllmEndpoint):
    """The render endpoint's bodies (the replica's ``_render`` handler answers with them)."""

    vision: VisionModel | None
    chat_template: str | None

    def _render_body(self, body: dict[str, Any], request: web.Request) -> dict[str, Any]:
        self._check_model(body.get("model"))
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise bad_request("messages must be a non-empty list of message objects", param="messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise bad_request("tools must be a list", param="tools")
        tool_choice = body.get("tool_choice")
        if tool_choice is None:
            tool_choice = "auto" if tools else "none"
        if tools and tool_choice == "auto" and not self.config.tool_parser:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        if body.get("use_beam_search"):
            raise bad_request("Beam search is not supported by the render endpoint")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise bad_request("chat_template_kwargs must be an object", param="chat_template_kwargs")
        add_generation_prompt = body.get("add_generation_prompt", True) is not False
        continue_final = body.get("continue_final_message") is True
        if add_generation_prompt and continue_final:
            raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")

        images: list[SeenImage] = []
        prompt_ids = self._apply_template(
            messages, tools or None, kwargs, add_generation_prompt, continue_final, images
        )
        features = self._features(prompt_ids, images) if images else None
        room = self._room(len(prompt_ids), " Please reduce the length of the input messages.")
        requested = body.get("max_completion_tokens")
        if requested is None:
            requested = body.get("max_tokens")
        if requested is not None and (not is_int(requested) or requested < 1):
            raise bad_request("max_tokens must be at least 1", param="max_tokens")
        max_tokens = room if requested is None else min(requested, room)

        sampling = self._sampling_params(body, max_tokens, bool(tools) and tool_choice != "none")
        rid = request.headers.get("X-Request-Id") or (
            body["request_id"] if isinstance(body.get("request_id"), str) and body["request_id"] else self._random_id()
        )
        stream = body.get("stream") is True
        out: dict[str, Any] = {"request_id": f"chatcmpl-{rid}", "token_ids": prompt_ids}
        if self.v32:
            out.update({"token_offsets": None, "features": features, "content_parts": None})
        else:
            out["features"] = features
        out["sampling_params"] = sampling
        out["model"] = body.get("model")
        if self.v32:
            reasoning_ended: bool | None = None
            parser_kwargs: dict[str, Any] | None = None
            if self.config.reasoning_parser:
                reasoning_ended = self._reasoning_ended_in_prompt(prompt_ids)
                parser_kwargs = {
                    "chat_template_kwargs": {
                        **_CHAT_PARAM_DEFAULTS,
                        "add_generation_prompt": add_generation_prompt,
                        "continue_final_message": continue_final,
                        **kwargs,
                    }
                }
            out.update(
                {
                    "reasoning_ended": reasoning_ended,
                    "reasoning_parser_kwargs": parser_kwargs,
                    "return_token_ids": body.get("return_token_ids"),
                    "output_mode": "tokens",
                }
            )
        out["stream"] = stream
        out["stream_options"] = body.get("stream_options") if stream else None
        out["cache_salt"] = body.get("cache_salt")
        out["priority"] = body.get("priority") if is_int(body.get("priority")) else 0
        out["kv_transfer_params"] = None
        if self.v32:
            out["ec_transfer_params"] = None
        return out

    def _apply_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None,
        kwargs: dict[str, Any],
        add_generation_prompt: bool,
        continue_final: bool,
        images: list[SeenImage],
    ) -> list[int]:
        """vLLM's chat-message preprocessing, then the tokenizer's own chat template (or `--chat-template`'s).

        A vision-language model's template reads content parts ("openai" content format): each image part is loaded
        into `images`, in order, and given to the template as `{"type": "image"}`; its pad is expanded afterwards."""
        prepared: list[dict[str, Any]] = []
        for m in messages:
            m = dict(m)
            content = m.get("content")
            if isinstance(content, list) and self.vision is not None:
                m["content"] = self._vision_parts(content, images)
            elif isinstance(content, list):  # "string" content format: text parts joined by newlines
                m["content"] = "\n".join(
                    str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
                )
            if m.get("role") == "assistant":
                if m.get("reasoning") is not None and m.get("reasoning_content") is None:
                    m["reasoning_content"] = m["reasoning"]
                if isinstance(m.get("tool_calls"), list):
                    calls = []
                    for tc in m["tool_calls"]:
                        tc = json.loads(json.dumps(tc))
                        fn = tc.get("function") if isinstance(tc, dict) else None
                        if isinstance(fn, dict):
                            args = fn.get("arguments")
                            if not args:
                                fn["arguments"] = {}
                            elif isinstance(args, str):
                                try:
                                    fn["arguments"] = json.loads(args)
                                except json.JSONDecodeError as exc:
                                    raise bad_request(f"tool call arguments are not valid JSON: {exc}") from exc
                        calls.append(tc)
                    m["tool_calls"] = calls
            prepared.append(m)
        extra = {
            k: v
            for k, v in kwargs.items()
            if k not in ("tools", "add_generation_prompt", "continue_final_message", "tokenize", "conversation")
        }
        tok = self.tokenizer
        try:
            with tok.lock:
                text = tok.tok.apply_chat_template(
                    prepared,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final,
                    tokenize=False,
                    **({"chat_template": self.chat_template} if self.chat_template else {}),
                    **extra,
                )
        except Exception as exc:  # jinja errors ("No user query found in messages.", ...)
            raise bad_request(f"Failed to apply the chat template: {exc}") from exc
        if not isinstance(text, str):  # pragma: no cover - defensive
            raise bad_request("the chat template did not render to a string")
        return tok.encode(text)

    def _vision_parts(self, content: list[Any], images: list[SeenImage]) -> list[dict[str, Any]]:
        assert self.vision is not None
        parts: list[dict[str, Any]] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == "image_url":
                wrapped = part.get("image_url")
                url = wrapped.get("url") if isinstance(wrapped, dict) else wrapped
                try:
                    images.append(self.vision.load(url))
                except ImageLoadError as exc:
                    raise bad_request(f"Failed to load image: {exc}") from exc
                parts.append({"type": "image"})
            else:
                raise bad_request(f"Unknown part type: {kind}")
        return parts

    def _features(self, prompt_ids: list[int], images: list[SeenImage]) -> dict[str, Any]:
        """The prompt's images as render answers them: each pad expanded in `prompt_ids` (in place), and per image
        its hash, placeholder run and processed item (`MultiModalFeatures`; 0.32 adds `mm_metadata`)."""
        pad = self.tokenizer.tok.convert_tokens_to_ids(IMAGE_PAD)
        expanded = expand(prompt_ids, pad, images)
        if expanded is None:
            raise bad_request(
                f"Failed to apply prompt replacement for mm_items['image']: the prompt has "
                f"{prompt_ids.count(pad)} image placeholders for {len(images)} images"
            )
        prompt_ids[:], runs = expanded
        features: dict[str, Any] = {
            "mm_hashes": {"image": [image.sha256 for image in images]},
            "mm_placeholders": {"image": runs},
            "kwargs_data": {"image": [image.item() for image in images]},
        }
        if self.v32:
            features["mm_metadata"] = {"image": [image.item() for image in images]}
        return features

    def _reasoning_ended_in_prompt(self, prompt_ids: list[int]) -> bool:
        """Whether the CURRENT turn's think block is already closed (``enable_thinking=False``).

        History is ignored: a turn-2 prompt that carries turn 1's ``</think>`` is False, as recorded.
        """
        text = self.tokenizer.decode(prompt_ids)
        at = text.rfind(ASSISTANT_OPEN)
        return at != -1 and THINK_END in text[at + len(ASSISTANT_OPEN) :]

    def _sampling_params(self, body: dict[str, Any], max_tokens: int, tools_active: bool) -> dict[str, Any]:
        """``ChatCompletionRequest.to_sampling_params`` serialized the way the real server does.

        SamplingParams is a msgspec Struct with ``omit_defaults``: the recorded bodies show which
        keys survive (``top_p``/``min_p`` only when sampling, ``max_tokens`` unless it equals the
        default 16 -- the real bug --, ``logprobs`` only when not null, ...).
        """

        def num(key: str, default: float) -> float:
            v = body.get(key)
            return float(v) if is_number(v) else default

        temperature = num("temperature", 1.0)
        greedy = temperature < _GREEDY_EPS
        sp: dict[str, Any] = {}
        n = body.get("n")
        if is_int(n) and n != 1:
            sp["n"] = n
        sp["presence_penalty"] = num("presence_penalty", 0.0)
        sp["frequency_penalty"] = num("frequency_penalty", 0.0)
        sp["repetition_penalty"] = num("repetition_penalty", 1.0)
        sp["temperature"] = temperature
        if not greedy:
            sp["top_p"] = num("top_p", 1.0)
            top_k = body.get("top_k")
            if is_int(top_k) and top_k not in (0, -1):
                sp["top_k"] = top_k
            sp["min_p"] = num("min_p", 0.0)
        if is_int(body.get("seed")):
            sp["seed"] = body["seed"]
        stop = body.get("stop")
        sp["stop"] = [stop] if isinstance(stop, str) else [s for s in stop or [] if isinstance(s, str)]
        sp["stop_token_ids"] = [t for t in body.get("stop_token_ids") or [] if is_int(t)]
        if body.get("ignore_eos") is True:
            sp["ignore_eos"] = True
        if max_tokens != _SAMPLING_DEFAULT_MAX_TOKENS:  # the real omit_defaults bug
            sp["max_tokens"] = max_tokens
        if is_int(body.get("min_tokens")) and body["min_tokens"] > 0:
            sp["min_tokens"] = body["min_tokens"]
        if body.get("logprobs") is True:
            top = body.get("top_logprobs", 0)
            if top is not None:
                if not is_int(top) or not (-1 <= top <= MAX_TOP_LOGPROBS):
                    raise bad_request("top_logprobs must be an integer between 0 and 20", param="top_logprobs")
                sp["logprobs"] = top
        if is_int(body.get("prompt_logprobs")):
            sp["prompt_logprobs"] = body["prompt_logprobs"]
        skip_special = body.get("skip_special_tokens", True) is not False
        if tools_active and self.config.tool_parser:
            skip_special = False  # hermes adjust_request
        if not skip_special:
            sp["skip_special_tokens"] = False
        if body.get("spaces_between_special_tokens") is False:
            sp["spaces_between_special_tokens"] = False
        if body.get("include_stop_str_in_output") is True:
            sp["include_stop_str_in_output"] = True
        sp["output_kind"] = 2  # FINAL_ONLY
        sp["skip_clone"] = True
        sp["bad_words"] = [w for w in body.get("bad_words") or [] if isinstance(w, str)]
        sp["skip_reading_prefix_cache"] = False
        return sp
