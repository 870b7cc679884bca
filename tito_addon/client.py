"""A client for the proxy's control API, for rollout drivers: `AsyncTitoClient` (asyncio) and `TitoClient` (blocking).

    from tito_addon.client import TitoClient, episode_proxy_url

    env = {"HTTP_PROXY": episode_proxy_url("http://127.0.0.1:8080", "episode-7"), ...}   # the agent's settings
    ... run the agent ...
    with TitoClient("http://127.0.0.1:8080", token) as tito:
        tito.wait_idle("episode-7")
        tito.annotate("episode-7", reward=1.0, labels=["solved"], group="task-3")
        tito.close("episode-7")
    ... every episode done ...
        data = tito.export_rows(episodes, format="verl", to="parquet", group_size=8)   # one file, groups together

Every call goes through the proxy's own port to its reserved control host (`tito_control_host`), in any proxy mode.
Built on aiohttp (the HTTP library the addon already uses); imports nothing else of the package, so a driver can
vendor this one file.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import aiohttp

T = TypeVar("T")
DEFAULT_HOST = "tito.control"


class TitoControlError(Exception):
    """The control API answered an error: `status` and the JSON error's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def episode_proxy_url(proxy: str, episode: str, password: str | None = None) -> str:
    """The proxy URL that names an episode by proxy auth: `http://EPISODE[:PASSWORD]@HOST:PORT`."""
    parts = urlsplit(proxy)
    userinfo = quote(episode, safe="") + (":" + quote(password, safe="") if password else "")
    netloc = userinfo + "@" + parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def episode_api_key(prefix: str, episode: str) -> str:
    """The API key that names an episode in reverse mode (`tito_session_api_key_prefix` + episode)."""
    return prefix + episode


class AsyncTitoClient:
    def __init__(self, proxy: str, token: str, *, host: str = DEFAULT_HOST, timeout_s: float = 660.0) -> None:
        """`proxy`: the proxy's address (`http://HOST:PORT`, with `user:password@` if it requires proxy auth)."""
        self.proxy = proxy
        self.base = f"http://{host}/v1"
        self._headers = {"authorization": f"Bearer {token}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AsyncTitoClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(
        self,
        method: str,
        path: str = "/sessions",
        *,
        params: dict[str, Any] | None = None,
        body: dict[str, Any] | None = None,
    ) -> tuple[bytes, dict[str, str]]:
        if self._session is None:
            # trust_env off: the proxy is named explicitly, never taken (or bypassed) from the driver's environment
            self._session = aiohttp.ClientSession(timeout=self._timeout, trust_env=False)
        data = json.dumps(body).encode() if body is not None else None
        headers = dict(self._headers)
        if data is not None:
            headers["content-type"] = "application/json"
        query = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in (params or {}).items()}
        async with self._session.request(
            method, self.base + path, params=query, data=data, headers=headers, proxy=self.proxy
        ) as response:
            payload = await response.read()
            if response.status >= 400:
                try:
                    message = json.loads(payload)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = payload[:200].decode("utf-8", "replace")
                raise TitoControlError(response.status, message)
            return payload, dict(response.headers)

    @staticmethod
    def _path(session_id: str, action: str = "") -> str:
        return "/sessions/" + quote(session_id, safe="") + (f"/{action}" if action else "")

    async def sessions(
        self, *, live: bool = False, limit: int = 1000, prefix: str | None = None
    ) -> list[dict[str, Any]]:
        """Live and recorded sessions (id, turns, tokens, branches, live, last_activity, closed, annotation_count),
        newest first; with `prefix`, only those whose id starts with it (a run's episodes)."""
        params: dict[str, Any] = {"live": live, "limit": limit, **({"prefix": prefix} if prefix is not None else {})}
        payload, _ = await self._call("GET", params=params)
        return json.loads(payload)["sessions"]

    async def info(self) -> dict[str, Any]:
        """What a driver checks before it runs agents (`GET /v1/info`): `version`, `session_api_key_prefix` (or
        None), `after_close`, `proxy_auth_password_required`, `backend_kind`, `model_family`, `tokenizer`, and
        `generations_cut` (`resuming`, `resumed`, `cuts`: the process's generations a weight update cut) and
        `turns_in_flight` (`count`, `oldest_s`: its turns waiting on a backend, which a pause holds)."""
        payload, _ = await self._call("GET", "/info")
        return json.loads(payload)

    async def session(self, session_id: str) -> dict[str, Any]:
        payload, _ = await self._call("GET", self._path(session_id))
        return json.loads(payload)

    async def rows(self, session_id: str, *, format: str = "generic", calls: str | None = None) -> list[dict[str, Any]]:
        """The session's segments as trainer rows (`format`: generic, verl, slime or verl-dataset; `calls`: only the
        segments of these calls, comma-separated, e.g. `main,compaction,subagent`), as dicts."""
        params = {"format": format, "to": "jsonl", **({"calls": calls} if calls else {})}
        payload, _ = await self._call("GET", self._path(session_id, "rows"), params=params)
        return [json.loads(line) for line in payload.splitlines() if line.strip()]

    async def rows_parquet(self, session_id: str, *, format: str = "generic", calls: str | None = None) -> bytes:
        """The same rows as the bytes of a Parquet file, equal to `python -m tito_addon export --session ID`'s."""
        params = {"format": format, "to": "parquet", **({"calls": calls} if calls else {})}
        payload, _ = await self._call("GET", self._path(session_id, "rows"), params=params)
        return payload

    async def export_rows(
        self,
        sessions: list[str] | None = None,
        *,
        session_prefix: str | None = None,
        format: str = "generic",
        to: str = "jsonl",
        calls: str | list[str] | None = None,
        group_size: int | None = None,
        group_policy: str = "refuse",
        dedupe_shared_turns: bool = False,
        mask_offpolicy: bool = False,
    ) -> Any:
        """The rows of several sessions as one export, equal to `python -m tito_addon export --session ID ...`'s:
        `sessions` (ids, in this order), then with `session_prefix` every recorded session whose id starts with it,
        in id order (`--session-prefix P`); each group's rows together, `group_index`, `rollout_id` and `index`
        numbered across all of them. `to`: `jsonl` (a list of dicts), `parquet` (the file's bytes) or `summary`
        (the groups and their sizes, no rows). With `group_size` (slime's `n_samples_per_prompt`, in rows) a group of
        another size is refused (a 409, naming its sessions), left out (`group_policy="drop"`) or padded (`"pad"`).
        A selection that names no recorded session is refused (a 404 or a 400), never taken as "all of them".
        `mask_offpolicy`: sampled tokens of an older weight version than their row's newest train nothing (slime's
        `--mask-offpolicy-in-partial-rollout`)."""
        body: dict[str, Any] = {"format": format, "to": to, "group_policy": group_policy,
                                "dedupe_shared_turns": dedupe_shared_turns}  # fmt: skip
        if mask_offpolicy:
            body["mask_offpolicy"] = True
        if sessions is not None:
            body["sessions"] = list(sessions)
        if session_prefix is not None:
            body["session_prefix"] = session_prefix
        if calls:
            body["calls"] = calls
        if group_size is not None:
            body["group_size"] = group_size
        payload, _ = await self._call("POST", "/rows", body=body)
        if to == "parquet":
            return payload
        if to == "summary":
            return json.loads(payload)
        return [json.loads(line) for line in payload.splitlines() if line.strip()]

    async def annotate(
        self,
        session_id: str,
        *,
        reward: float | None = None,
        labels: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        group: str | None = None,
        turn_id: int | None = None,
        scope: str | None = None,
    ) -> dict[str, Any]:
        """Attach a reward, labels, metadata or a group (the task the episode was a sample of: its GRPO group) to the
        session, or to one of its turns (`turn_id`): it reaches every segment of the episode, or with
        `scope="segment"` only the segments holding that turn (a group is always the episode's)."""
        fields = {"reward": reward, "labels": labels, "metadata": metadata, "group": group, "turn_id": turn_id,
                  "scope": scope}  # fmt: skip
        body = {k: v for k, v in fields.items() if v is not None}
        payload, _ = await self._call("POST", self._path(session_id, "annotations"), body=body)
        return json.loads(payload)

    async def wait_idle(self, session_id: str, *, timeout_s: float = 30.0) -> bool:
        """Wait until no turn of the session is in flight (at most `timeout_s`); whether it is idle."""
        payload, _ = await self._call("GET", self._path(session_id, "wait"), params={"timeout": timeout_s})
        return bool(json.loads(payload)["idle"])

    async def close(self, session_id: str, *, timeout_s: float = 30.0) -> dict[str, Any]:
        """Close the session once idle (its close line written); its name is then refused or starts anew."""
        payload, _ = await self._call("POST", self._path(session_id, "close"), body={"timeout": timeout_s})
        return json.loads(payload)


class TitoClient:
    """The blocking form of `AsyncTitoClient`: the same calls, run on a private event loop in its own thread (so it
    works from scripts, threads and notebooks that already run a loop)."""

    def __init__(self, proxy: str, token: str, *, host: str = DEFAULT_HOST, timeout_s: float = 660.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tito-client", daemon=True)
        self._thread.start()
        self._client = AsyncTitoClient(proxy, token, host=host, timeout_s=timeout_s)

    def _run(self, call: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()

    def __enter__(self) -> TitoClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_client()

    def close_client(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def sessions(self, *, live: bool = False, limit: int = 1000, prefix: str | None = None) -> list[dict[str, Any]]:
        return self._run(self._client.sessions(live=live, limit=limit, prefix=prefix))

    def info(self) -> dict[str, Any]:
        return self._run(self._client.info())

    def session(self, session_id: str) -> dict[str, Any]:
        return self._run(self._client.session(session_id))

    def rows(self, session_id: str, *, format: str = "generic", calls: str | None = None) -> list[dict[str, Any]]:
        return self._run(self._client.rows(session_id, format=format, calls=calls))

    def rows_parquet(self, session_id: str, *, format: str = "generic", calls: str | None = None) -> bytes:
        return self._run(self._client.rows_parquet(session_id, format=format, calls=calls))

    def export_rows(self, sessions: list[str] | None = None, **options: Any) -> Any:
        return self._run(self._client.export_rows(sessions, **options))

    def annotate(self, session_id: str, **fields: Any) -> dict[str, Any]:
        return self._run(self._client.annotate(session_id, **fields))

    def wait_idle(self, session_id: str, *, timeout_s: float = 30.0) -> bool:
        return self._run(self._client.wait_idle(session_id, timeout_s=timeout_s))

    def close(self, session_id: str, *, timeout_s: float = 30.0) -> dict[str, Any]:
        return self._run(self._client.close(session_id, timeout_s=timeout_s))
