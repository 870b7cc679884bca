"""From settings to a serving turn service: the engine, the backend, the sessions, the recorder and the signer.

No mitmproxy here: the capture addon hands each configuration's `TitoSettings` to `TurnWiring.configure` and serves
flows with the service it gets back; the sweeper, the control API and the flow-file records read what they need from
the same wiring, never from another addon. What outlives a reconfiguration is kept here: the upstream connections,
the encoded prefixes (ids, valid whatever the engine), this process's sessions and a Redis store's client (its cache
of mirrored turns stays warm), and the engine while no option it depends on changed.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tito_addon.backends.backend_kinds import make_backend
from tito_addon.backends.backend_routes import BackendRoutes, backend_url_from_env
from tito_addon.backends.engine_failover import EngineList, FailoverPolicy
from tito_addon.backends.expert_routes import RoutesWanted
from tito_addon.backends.resumed_generation import ResumePolicy, ResumeStats
from tito_addon.backends.upstream_client import UpstreamClient
from tito_addon.backends.upstream_headers import ROUTER_SESSION_KEYS
from tito_addon.engine.model_families import FAMILIES
from tito_addon.engine.prompt_ids import EncodedPrefixes
from tito_addon.engine.token_engine import APPENDABLE_ROLES, TokenEngine
from tito_addon.engine.tokenizer_loading import load_tokenizer
from tito_addon.protocols.turn_refs import TurnSigner, stored_key
from tito_addon.proxy.collector_tuning import tune_collector
from tito_addon.proxy.proxy_facts import ProxyFacts
from tito_addon.proxy.tito_settings import TitoSettings
from tito_addon.records.records_port import FileRecords
from tito_addon.records.trajectory_recorder import default_writer_id
from tito_addon.sessions.memory_sessions import MemorySessions
from tito_addon.sessions.redis_sessions import RedisSessions
from tito_addon.sessions.session_space import SessionSpace
from tito_addon.tito_errors import TitoError
from tito_addon.turns.image_fetching import ImageFetcher
from tito_addon.turns.session_records import SessionRecords
from tito_addon.turns.turn_run import TurnsInFlight
from tito_addon.turns.turn_service import TurnService

logger = logging.getLogger(__name__)

# Settings whose change needs a new token engine (and so a new tokenizer load).
ENGINE_SETTINGS = frozenset(
    {
        "tokenizer",
        "model_family",
        "append_roles",
        "chat_template_kwargs",
        "trust_remote_code",
        "image_min_pixels",
        "image_max_pixels",
    }
)


class WiringError(ValueError):
    """Settings that cannot be served (a tokenizer that does not load, a template that is not append-only)."""


class TurnWiring:
    def __init__(self) -> None:
        self.facts = ProxyFacts()
        self.settings: TitoSettings | None = None
        self.engine: TokenEngine | None = None
        self.service: TurnService | None = None
        self.resume_stats = ResumeStats()  # the process's, across reconfigurations
        self.in_flight = TurnsInFlight()  # the same
        self.client = UpstreamClient()
        self.prefixes = EncodedPrefixes()
        self.image_fetcher = ImageFetcher()  # the same: a URL fetched once stays that image
        self.memory = MemorySessions()
        self.redis: RedisSessions | None = None
        self.retired: list[RedisSessions] = []  # stores a reconfiguration left, for the shell to close
        self.writer_id = default_writer_id()
        self.signer: tuple[tuple[str, str], TurnSigner] | None = None  # with the key and record dir it was made for

    @property
    def sessions(self) -> SessionRecords | None:
        """The sessions and their records as configured now (None until a tokenizer is set)."""
        return self.service.sessions if self.service is not None else None

    def backend_for(self, *, reverse: bool, scheme: str, host: str, port: int) -> str | None:
        """The backend URL a chat request to this host runs on, or None when the host is not a configured backend."""
        settings = self.settings
        if settings is None:
            return None
        # A fixed engine list: turns are addressed to its first URL, and each call goes to the session's engine.
        chosen = settings.engines[0] if settings.engines else settings.backend_url
        routes = BackendRoutes(
            entries=settings.backends,
            backend_url=chosen or backend_url_from_env(),
            override_reverse=bool(chosen),
        )
        return routes.resolve(reverse=reverse, scheme=scheme, host=host, port=port)

    def unconfigure(self) -> None:
        """No tokenizer: turns are refused until one is set."""
        self.service = None

    def configure(self, settings: TitoSettings) -> TurnService:
        """Build (or rebuild) the turn service for these settings; raises WiringError when they cannot be served."""
        engine = self.engine
        if (
            engine is None
            or self.settings is None
            or any(getattr(self.settings, name) != getattr(settings, name) for name in ENGINE_SETTINGS)
        ):
            engine = build_engine(settings)
        self.client.timeout_s = settings.upstream_timeout
        self.client.failover = FailoverPolicy(settings.retries, settings.failover_backoff_ms / 1000)
        if not settings.engines:
            self.client.engines = None
        elif self.client.engines is None or self.client.engines.urls != list(settings.engines):
            self.client.engines = EngineList(list(settings.engines))  # (one that stays keeps what it found dead)
        self.memory.configure(idle_timeout=settings.session_idle_timeout, max_sessions=settings.max_sessions)
        self.prefixes.resize(settings.prefix_cache_mb * 1024 * 1024)
        sessions = self._sessions(settings)
        shared = sessions is not self.memory
        backend = make_backend(
            settings.backend_kind,
            self.client,
            verify_echo=settings.verify_prompt_echo,
            merge_stream_chunks=engine.family.chunking_invariant_parsers,
            compact_requests=engine.family.compact_requests,
            resume=ResumePolicy(settings.resume_max, settings.resume_wait),
            resume_stats=self.resume_stats,
            router=settings.router,
        )
        # With a shared store several processes write turns of one session: each its own part of the file.
        records = FileRecords(settings.record_dir, writer=self.writer_id if shared else None)
        self.service = TurnService(
            engine,
            backend,
            sessions,
            records,
            session_header=settings.session_header,
            router_key=ROUTER_SESSION_KEYS[settings.router],
            engines=self.client.engines,
            prefixes=self.prefixes,
            record_message_text=settings.record_message_text,
            signer=self._signer(settings),
            memo_bytes=settings.message_memo_mb * 1024 * 1024,
            warm_apis=self.service.apis if self.service is not None else (),
            after_close=settings.after_close,
            in_flight=self.in_flight,
            routed_experts=RoutesWanted(settings.route_shape) if settings.routed_experts else None,
            images_max=settings.images_max,
            image_fetcher=self.image_fetcher if settings.image_fetch else None,
        )
        self.settings, self.engine = settings, engine
        tune_collector(settings.gc_threshold)
        logger.info(
            "tito: %s backend, tokenizer %s, family %s, recording to %s, sessions in %s",
            settings.backend_kind,
            settings.tokenizer,
            settings.model_family,
            settings.record_dir,
            f"Redis (writer {self.writer_id})" if shared else "this process",
        )
        return self.service

    def _signer(self, settings: TitoSettings) -> TurnSigner:
        """One signer while its key and record dir stay: the APIs that sign keep their memos (which hold what it
        opened) across a reconfiguration."""
        key = (settings.signing_key, settings.record_dir)
        if self.signer is None or self.signer[0] != key:
            self.signer = (key, signer_for(settings))
        return self.signer[1]

    def _sessions(self, settings: TitoSettings) -> SessionSpace:
        if settings.session_store == "memory":
            return self.memory
        if self.redis is None or self.redis.url != settings.session_store:
            if self.redis is not None:
                self.retired.append(self.redis)
            self.redis = RedisSessions.connect(settings.session_store)
        self.redis.configure(
            idle_timeout=settings.session_idle_timeout,
            max_sessions=settings.max_sessions,
            # A resumed generation's attempts may run until its resumption window closes, the last one after it.
            upstream_timeout=settings.upstream_timeout
            + (settings.resume_wait + settings.upstream_timeout if settings.resume_max else 0),
        )
        return self.redis

    def close_all(self, reason: str) -> None:
        """At shutdown: close this process's own sessions (shared ones live on in their store)."""
        if self.service is not None:
            self.service.close_all(reason)

    async def aclose(self) -> None:
        """Close the upstream connections and every Redis client (a retired store's too)."""
        await self.client.close()
        for store in [*self.retired, *([self.redis] if self.redis is not None else [])]:
            await store.aclose()
        self.retired.clear()

    async def close_retired(self) -> None:
        while self.retired:
            await self.retired.pop().aclose()


def build_engine(settings: TitoSettings) -> TokenEngine:
    try:
        tokenizer = load_tokenizer(settings.tokenizer, trust_remote_code=settings.trust_remote_code)
    except Exception as exc:  # transformers raises OSError, ValueError, HF hub errors...
        raise WiringError(f"cannot load tokenizer {settings.tokenizer!r}: {exc}") from exc
    family = FAMILIES[settings.model_family]
    roles = settings.append_roles or tuple(r for r in APPENDABLE_ROLES if r not in family.refused_append_roles)
    try:
        engine = TokenEngine(
            tokenizer,
            family,
            append_roles=roles,
            pinned_kwargs=settings.chat_template_kwargs,
            tokenizer_name=settings.tokenizer,
            vision=family.vision.with_pixels(settings.image_min_pixels or None, settings.image_max_pixels or None)
            if family.vision is not None
            else None,
        )
        engine.check_append_only()
    except (ValueError, TitoError) as exc:
        raise WiringError(f"tito: {exc}") from exc
    return engine


def signer_for(settings: TitoSettings) -> TurnSigner:
    if settings.signing_key:
        return TurnSigner(settings.signing_key.encode())
    record_dir = Path(settings.record_dir)
    return TurnSigner(lambda create: stored_key(record_dir, create))
