"""The backend kinds the addon can drive, by option value."""

from __future__ import annotations

from tito_addon.backends.backend_protocol import Backend
from tito_addon.backends.resumed_generation import DEFAULT_RESUME, ResumePolicy, ResumeStats
from tito_addon.backends.sglang_backend import SglangBackend
from tito_addon.backends.upstream_client import UpstreamClient
from tito_addon.backends.vllm_backend import VllmBackend

BACKENDS: dict[str, type[SglangBackend] | type[VllmBackend]] = {"sglang": SglangBackend, "vllm": VllmBackend}


def make_backend(
    kind: str,
    client: UpstreamClient,
    *,
    verify_echo: bool = False,
    merge_stream_chunks: bool = False,
    compact_requests: bool = False,
    resume: ResumePolicy = DEFAULT_RESUME,
    resume_stats: ResumeStats | None = None,
    router: str = "none",
) -> Backend:
    """`merge_stream_chunks`: vLLM may derender the generate chunks that arrived during a call as one (see
    `ModelFamily.chunking_invariant_parsers`); `compact_requests`: the parsers are sent only what they read (vLLM
    derender a seed of the prompt, neither server the conversation; `ModelFamily.compact_requests`); `resume`: how far a
    generation the backend aborts (a weight update) is resumed; `router`: the engine router in front (`tito_router`)."""
    if kind == "sglang":
        return SglangBackend(
            client,
            verify_echo=verify_echo,
            compact_requests=compact_requests,
            resume=resume,
            resume_stats=resume_stats,
            router=router,
        )
    if kind == "vllm":
        return VllmBackend(
            client,
            merge_stream_chunks=merge_stream_chunks,
            compact_requests=compact_requests,
            resume=resume,
            resume_stats=resume_stats,
        )
    raise ValueError(f"unknown backend kind {kind!r}; choose one of: {', '.join(BACKENDS)}")
