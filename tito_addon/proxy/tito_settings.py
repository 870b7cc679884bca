"""Validated settings, parsed from the addon's `tito_*` options (or built directly by embedders and tests)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tito_addon.backends.backend_routes import normalize_backend_url, parse_backends
from tito_addon.backends.expert_routes import RouteShape
from tito_addon.backends.upstream_headers import ROUTER_SESSION_KEYS
from tito_addon.engine.model_families import FAMILIES
from tito_addon.engine.token_engine import APPENDABLE_ROLES, FORBIDDEN_KWARGS

BACKEND_KINDS = ("sglang", "vllm")
STORE_SCHEMES = ("redis", "rediss", "unix")


OPTION_PREFIX = "tito_"


def option(default: str | int | float | bool, help: str, **constraints: Any) -> Any:
    """A setting declared once: the mitmproxy option `tito_NAME` (`default`'s type, `default`, `help`) and the field it
    is validated into (the default goes through the same validators as a value the user sets)."""
    return Field(default=default, validate_default=True, description=help, **constraints)


class TitoSettings(BaseModel):
    """Every `tito_*` option of the capture addon, as the proxy is configured with it. `declare_options` declares
    them to mitmproxy and `from_options` reads them back; embedders and tests build settings directly."""

    model_config = ConfigDict(frozen=True)

    backend_kind: str = option("sglang", "Backend protocol: sglang (input_ids) or vllm (render/generate/derender).")
    backend_url: str | None = option(
        "",
        "Backend base URL. Default: the reverse-mode target, else $TITO_BACKEND_URL, $SGLANG_BASE_URL, "
        "$VLLM_BASE_URL, else the request's own target.",
    )
    backends: dict[tuple[str, int | None], str | None] = option(
        "",
        "Comma-separated backend hosts, HOST[:PORT] or HOST[:PORT]=URL: when set, only chat requests to these "
        "hosts are rewritten (URL: where that host's turns run).",
    )
    router: str = option(
        "none",
        "The router between the proxy and its engines: none, or vllm-router (every backend request carries "
        "X-Session-ID with the proxy's session id, so a sticky policy keeps a session on one engine).",
    )
    engines: tuple[str, ...] = option(
        "",
        "Comma-separated engine base URLs, no router: each session runs on one of them, chosen by a stable hash of its "
        "id, and moves to the next when its engine dies (replaces tito_backend_url).",
    )
    failover_retries: int = option(
        -1,
        "Times a backend call a dead engine broke (refused, reset, 500/502/503/504, a stream cut) is sent again before "
        "the agent gets the error; -1: 3 behind a router or with tito_engines, else 0.",
        ge=-1,
        le=100,
    )
    failover_backoff_ms: int = option(
        1000,
        "Wait before a broken call goes to the router again (doubled each time, up to 8x): long enough for the router "
        "to drop a dead engine (its health interval x threshold, or its circuit breaker). The next engine of "
        "tito_engines is tried at once.",
        ge=0,
        le=600_000,
    )
    tokenizer: str = option("", "Tokenizer: a Hugging Face model name or a local directory.")
    model_family: str = option("default", f"Boundary and template rules: {', '.join(FAMILIES)}.")
    record_dir: str = option("recordings", "Directory for the per-session JSONL trajectories.")
    append_roles: tuple[str, ...] = option(  # (): the family's own
        "auto",
        "Comma-separated roles a request may append to a stored turn; auto: every role the model family can "
        "append (tool,user,system, less what the family refuses, e.g. system for deepseek-r1 and mistral).",
    )
    chat_template_kwargs: dict[str, Any] = option("", "JSON object of chat template kwargs applied to every render.")
    session_header: str = option("x-session-id", "Request header that names the session.")
    trust_remote_code: bool = option(False, "Allow the tokenizer to run code from its repository.")
    upstream_timeout: float = option(
        600,
        "Seconds to wait for the backend before answering 504; a turn held by a paused engine (a weight update in "
        "keep, wait, in_place or retract mode) waits on this clock.",
    )
    resume_max: int = option(
        20,
        "Times a generation the backend aborts (a weight update's pause in abort mode) is resumed from its exact "
        "ids before the agent gets an error (0: never resumed).",
        ge=0,
        le=10_000,
    )
    resume_wait: float = option(  # an int default: mitmproxy's options take no float
        900,
        "Seconds after a generation's first cut within which it may be resumed; past it the agent gets an error.",
        gt=0,
    )
    verify_prompt_echo: bool = option(
        False,
        "sglang: have the backend echo the whole prompt on every turn and compare it id for id (by default the "
        "echo is checked on the first turn per backend and the prompt length on every turn).",
    )
    record_message_text: bool = option(
        True,
        "Record the text of the messages each turn appends (needed by the drift audit). Off: only their digests "
        "(enough to resume and replay), for agents whose tool results are large.",
    )
    prefix_cache_mb: int = option(
        256,
        "Memory for the ready-encoded ids of recent turns, so a long prompt is not re-encoded every turn.",
        ge=0,
        le=1024 * 1024,
    )
    message_memo_mb: int = option(
        128,
        "Memory for recent requests' validated messages, and as much again for each agent API's recent request "
        "bytes (chat, Anthropic Messages, Responses), so a re-sent history is neither parsed nor validated again.",
        ge=0,
        le=1024 * 1024,
    )
    gc_threshold: int = option(
        50_000,
        "Allocations between two collections of the youngest generation of Python's garbage collector (Python's "
        "default is 700); what exists once configured is frozen out of its walks (0: leave the collector as is).",
        ge=0,
        le=10_000_000,
    )
    session_idle_timeout: float = option(1800, "Close a session unused for this many seconds (0: never).")
    signing_key: str = option(
        "",
        "Key that signs what agents echo back (thinking signatures, encrypted reasoning); proxies sharing sessions "
        "share it. Empty: a key kept in the record dir (.tito-signing-key, made on first use).",
    )
    session_store: str = option(
        "memory",
        "Where sessions live: memory (this process) or a Redis URL (redis://HOST:PORT/DB, rediss://…, unix://…) "
        "shared by every proxy that names it, so any of them serves any turn of any session.",
    )
    after_close: Literal["refuse", "new"] = option(
        "refuse",
        "A request naming a session its driver closed (control API): refuse (410 Gone with x-should-retry: false, "
        "so agents stop at once; nothing forwarded) or new (the name starts a new tree; turn ids continue, nothing "
        "extends the closed turns).",
    )
    max_sessions: int = option(10000, "Live sessions kept; the least recently used closes first (0: no limit).")
    routed_experts: bool = option(
        False,
        "Mixture-of-experts models: ask the backend for every turn's routes (the experts each token went to, per "
        "layer: rollout routing replay) and record them beside the session. Each turn asks only from where its "
        "parents' routes end. The engine must run with --enable-return-routed-experts.",
    )
    image_min_pixels: int = option(
        0,
        "Vision-language families: the fewest pixels the model's image processor resizes an image to (its "
        "preprocessor_config.json size.shortest_edge, or the server's --mm-processor-kwargs min_pixels); 0: the "
        "family's own (Qwen2.5-VL 3136, Qwen3-VL 65536). Decides how many tokens each image becomes.",
        ge=0,
    )
    image_max_pixels: int = option(
        0,
        "Vision-language families: the most pixels an image is resized to (size.longest_edge, or max_pixels); 0: the "
        "family's own (Qwen2.5-VL 12845056, Qwen3-VL 16777216).",
        ge=0,
    )
    image_fetch: bool = option(
        False,
        "Fetch the images agents give by http(s) URL (once per URL, kept in memory) and pass them on inline, counted "
        "and recorded like any image. Off: such an image is a 400, and nobody fetches it.",
    )
    images_max: int = option(
        100,
        "Images a request may hold, its whole history counted (each is sent to the engine every turn); more is a "
        "400 and nothing is forwarded.",
        ge=1,
    )
    routed_experts_shape: str = option(
        "",
        "LAYERSxTOPK of the model's routes (its num_hidden_layers x num_experts_per_tok, e.g. 48x8): needed on sglang, "
        "whose routes carry no shape; vLLM's are checked against it.",
    )

    @classmethod
    def declare_options(cls, loader: Any) -> None:
        """Declare every setting as a mitmproxy option (`loader.add_option`), with its type, default and help."""
        for name, field in cls.model_fields.items():
            loader.add_option(OPTION_PREFIX + name, type(field.default), field.default, field.description)

    @classmethod
    def option_names(cls) -> frozenset[str]:
        return frozenset(OPTION_PREFIX + name for name in cls.model_fields)

    @classmethod
    def from_options(cls, options: Any) -> TitoSettings:
        """The settings that mitmproxy's options (or any object with the `tito_*` attributes) hold now; a bad value
        raises pydantic's ValidationError, which names the field."""
        return cls(**{name: getattr(options, OPTION_PREFIX + name) for name in cls.model_fields})

    @field_validator("session_store")
    @classmethod
    def _store(cls, value: str) -> str:
        value = value.strip() or "memory"
        if value == "memory":
            return value
        scheme, sep, rest = value.partition("://")
        if not sep or scheme not in STORE_SCHEMES or not rest:
            raise ValueError(f"must be memory or a Redis URL ({', '.join(s + '://…' for s in STORE_SCHEMES)})")
        return value

    @field_validator("signing_key")
    @classmethod
    def _signing_key(cls, value: str) -> str:
        if value and len(value.encode()) < 16:
            raise ValueError("must be at least 16 bytes (or empty: a key kept in the record dir)")
        return value

    @field_validator("backend_kind")
    @classmethod
    def _kind(cls, value: str) -> str:
        if value not in BACKEND_KINDS:
            raise ValueError(f"unknown backend kind {value!r}; choose one of: {', '.join(BACKEND_KINDS)}")
        return value

    @field_validator("router")
    @classmethod
    def _router(cls, value: str) -> str:
        value = value.strip().lower()
        if value not in ROUTER_SESSION_KEYS:
            raise ValueError(f"unknown router {value!r}; choose one of: {', '.join(ROUTER_SESSION_KEYS)}")
        return value

    @property
    def retries(self) -> int:
        """The failover retries in force: `failover_retries`, or where it is -1, 3 behind a router or a list."""
        if self.failover_retries >= 0:
            return self.failover_retries
        return 3 if self.router != "none" or self.engines else 0

    @field_validator("engines", mode="before")
    @classmethod
    def _engines(cls, value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            value = [part for part in value.replace(" ", "").split(",") if part]
        return tuple(dict.fromkeys(normalize_backend_url(str(url)) for url in value))

    @model_validator(mode="after")
    def _one_way_to_the_engines(self) -> TitoSettings:
        if self.engines and self.router != "none":
            raise ValueError("tito_engines is a fixed list of engines without a router: set it or tito_router")
        if self.engines and self.backend_url and self.backend_url != self.engines[0]:
            raise ValueError("tito_engines replaces tito_backend_url: set one of them")
        return self

    @model_validator(mode="after")
    def _pixel_bounds(self) -> TitoSettings:
        if self.image_min_pixels and self.image_max_pixels and self.image_min_pixels > self.image_max_pixels:
            raise ValueError("tito_image_min_pixels is more than tito_image_max_pixels")
        return self

    @field_validator("routed_experts_shape")
    @classmethod
    def _route_shape(cls, value: str) -> str:
        return str(RouteShape.parse(value) or "")

    @property
    def route_shape(self) -> RouteShape | None:
        return RouteShape.parse(self.routed_experts_shape)

    @model_validator(mode="after")
    def _routes_carried(self) -> TitoSettings:
        if self.routed_experts and self.backend_kind == "sglang" and self.route_shape is None:
            raise ValueError(
                "tito_routed_experts on sglang needs tito_routed_experts_shape (LAYERSxTOPK: the model's "
                "num_hidden_layers x num_experts_per_tok): sglang's routes carry no shape"
            )
        return self

    @field_validator("backend_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        return normalize_backend_url(value) if value else None

    @field_validator("backends", mode="before")
    @classmethod
    def _backends(cls, value: Any) -> Any:
        if isinstance(value, str):
            return parse_backends(value)
        return value

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("a tokenizer (HF name or local directory) is required")
        return value.strip()

    @field_validator("model_family")
    @classmethod
    def _family(cls, value: str) -> str:
        if value not in FAMILIES:
            raise ValueError(f"unknown model family {value!r}; choose one of: {', '.join(FAMILIES)}")
        return value

    @field_validator("append_roles", mode="before")
    @classmethod
    def _roles(cls, value: Any) -> tuple[str, ...]:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return ()
        if isinstance(value, str):
            value = [part for part in value.replace(" ", "").split(",") if part]
        roles = tuple(dict.fromkeys(str(v).lower() for v in value))
        if not roles:
            raise ValueError(f"at least one role is required; choose from {', '.join(APPENDABLE_ROLES)}")
        unknown = [r for r in roles if r not in APPENDABLE_ROLES]
        if unknown:
            raise ValueError(f"unknown role(s) {', '.join(unknown)}; choose from {', '.join(APPENDABLE_ROLES)}")
        return roles

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _kwargs(cls, value: Any) -> dict[str, Any]:
        if isinstance(value, str):
            if not value.strip():
                return {}
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object")
        bad = FORBIDDEN_KWARGS & set(value)
        if bad:
            raise ValueError(f"may not set {', '.join(sorted(bad))}")
        return value

    @field_validator("session_header")
    @classmethod
    def _header(cls, value: str) -> str:
        value = value.strip().lower()
        if not value or not all(c.isalnum() or c in "-_" for c in value):
            raise ValueError(f"not a valid header name: {value!r}")
        return value

    @field_validator("upstream_timeout")
    @classmethod
    def _timeout(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("must be positive")
        return value

    @field_validator("session_idle_timeout", "max_sessions")
    @classmethod
    def _not_negative(cls, value: float) -> float:
        if value < 0:
            raise ValueError("must be 0 (no limit) or positive")
        return value
