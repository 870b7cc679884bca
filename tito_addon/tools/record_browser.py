"""`python -m tito_addon view REC`: a local web page over a record dir, and `view --html OUT` for one episode.

The page is one HTML file with its script and style inlined (`browser_assets/`): no build step, no CDN, nothing
fetched but this server's JSON. The server answers only what the catalog knows: a session or an episode is looked
up by its id among those read from the dir, and the files read are the catalog's own paths, so no URL can name a
file, in the dir or outside it. Every answer is JSON (an error with a 4xx) except the page itself, a branch's
drift audit page, and an image a turn shows: a file of the record dir's image store, named by its digest and format
(the only names the store holds), a regular file whose bytes match that digest.

A turn's tokens are read on demand from its session's files; a tokenizer names them when one is at hand: `--tokenizer`,
else the record's own when it names a local directory (never a download, never remote code).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import html
import json
import logging
import sys
import threading
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tito_addon.engine.tokenizer_loading import RecordTokenizers
from tito_addon.records.episode_graph import episode_graph, group_view
from tito_addon.records.image_store import ImageStore
from tito_addon.records.record_catalog import SORTABLE, Catalog, EpisodeFilter, RecordCatalog, facets
from tito_addon.records.record_models import CALLS, TurnRecord
from tito_addon.records.record_reader import RecordError, SessionFile, merge_parts
from tito_addon.records.turn_tokens import SegmentPlace, segment_place, turn_tokens

logger = logging.getLogger(__name__)

PAGE_ROWS = 500  # rollout table rows per answer; the page asks for more as it is scrolled to its end


class ViewError(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class CatalogQuery(BaseModel):
    """The rollout table's query: its filters, its order and which rows."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    reward_min: float | None = Field(default=None, allow_inf_nan=False)
    reward_max: float | None = Field(default=None, allow_inf_nan=False)
    group: str | None = None
    label: str | None = None
    length_min: int | None = Field(default=None, ge=0)
    length_max: int | None = Field(default=None, ge=0)
    call: str | None = None
    weight_version: str | None = None
    family: str | None = None
    text: str | None = None
    sort: str = "first_at"
    order: str = "asc"
    offset: int = Field(default=0, ge=0)
    limit: int = Field(default=PAGE_ROWS, ge=1, le=100_000)

    @classmethod
    def of(cls, query: dict[str, str]) -> CatalogQuery:
        given = {key: value for key, value in query.items() if value != ""}
        try:
            parsed = cls.model_validate(given)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first.get("loc", ()))
            raise ViewError(f"bad query {where}: {first['msg']}") from None
        if parsed.sort not in SORTABLE:
            raise ViewError(f"sort must be one of: {', '.join(SORTABLE)}")
        if parsed.order not in ("asc", "desc"):
            raise ViewError("order must be asc or desc")
        if parsed.call is not None and parsed.call not in CALLS:
            raise ViewError(f"call must be one of: {', '.join(CALLS)}")
        return parsed

    def episode_filter(self) -> EpisodeFilter:
        fields = self.model_dump(exclude={"order", "offset", "limit"})
        return EpisodeFilter(**fields, descending=self.order == "desc")


class RecordBrowser:
    """The answers the page asks for, as plain JSON values (the server's and the one-episode file's alike)."""

    def __init__(self, record_dir: Path, tokenizers: RecordTokenizers | None = None) -> None:
        self.record_dir = record_dir
        self.tokenizers = tokenizers or RecordTokenizers()
        self._catalog = RecordCatalog(record_dir)
        self._lock = threading.Lock()

    def catalog(self) -> Catalog:
        with self._lock:  # one reader at a time: the catalog's cache is its own
            return self._catalog.catalog()

    def episodes(self, query: CatalogQuery) -> dict[str, Any]:
        catalog = self.catalog()
        rows = query.episode_filter().apply(catalog.episodes)
        return {
            "record_dir": str(self.record_dir),
            "total": len(catalog.episodes),
            "matched": len(rows),
            "offset": query.offset,
            "episodes": rows[query.offset : query.offset + query.limit],
            "facets": facets(catalog.episodes),
            "sessions": len(catalog.sessions),
            "turns": sum(d.summary["turns"] for d in catalog.sessions),
            "skipped": catalog.skipped.as_json(),
        }

    def sessions(self) -> dict[str, Any]:
        catalog = self.catalog()
        rows = catalog.session_rows()
        episodes: dict[str, list[str]] = {}
        for row in catalog.episodes:
            for session_id in row["sessions"]:
                episodes.setdefault(session_id, []).append(row["episode"])
        for row in rows:
            row["episodes"] = episodes.get(row["session_id"], [])
        return {"sessions": rows, "skipped": catalog.skipped.as_json()}

    def episode(self, episode: str) -> dict[str, Any]:
        catalog = self.catalog()
        view = catalog.views.get(episode)
        if view is None:
            raise ViewError(f"no episode {episode[:200]!r} in this record dir", 404)
        row = next(row for row in catalog.episodes if row["episode"] == episode)
        return {**episode_graph(catalog, view), "row": row}

    def group(self, group: str) -> dict[str, Any]:
        found = group_view(self.catalog(), group)
        if not found["episodes"]:
            raise ViewError(f"no group {group[:200]!r} in this record dir", 404)
        return found

    def _session_file(self, session_id: str) -> SessionFile:
        digest = self.catalog().session(session_id)
        if digest is None:
            raise ViewError(f"no session {session_id[:200]!r} in this record dir", 404)
        try:
            return merge_parts(digest.session.paths)  # the catalog's own paths: never a name from the request
        except (OSError, RecordError) as exc:
            raise ViewError(f"cannot read session {session_id[:200]!r}: {exc}", 409) from exc

    def turn(self, session_id: str, turn_id: int) -> dict[str, Any]:
        session_file = self._session_file(session_id)
        turns = {turn.turn_id: turn for turn in session_file.turns}
        turn = turns.get(turn_id)
        if turn is None:
            raise ViewError(f"session {session_id[:200]!r} has no turn {turn_id}", 404)
        tokenizer, _ = self.tokenizers.for_record(turn.tokenizer.name, turn.tokenizer.tokenizer_sha256)
        tokens = turn_tokens(turn, tokenizer, segment=self._segment(turn))
        below = {turn.turn_id}
        for other in session_file.turns:  # parents come before their children
            if other.parent_turn_id in below:
                below.add(other.turn_id)
        parents = {t.parent_turn_id for t in session_file.turns}
        return {
            "tokens": tokens.model_dump(mode="json"),
            "appended_messages": turn.appended_messages,
            "appended_keys": len(turn.appended_keys) if turn.appended_keys is not None else None,
            "assistant_message": turn.assistant_message,
            "annotations": [
                n.model_dump(mode="json", by_alias=True, exclude_none=True)
                for n in session_file.annotations
                if n.turn_id == turn_id
            ],  # fmt: skip
            "leaves": sorted(t for t in below if t not in parents),
            "record": {key: value for key, value in turn.line_fields().items() if key not in BULKY},
        }

    def _segment(self, turn: TurnRecord) -> SegmentPlace | None:
        """The export's segment the turn is in, numbered within its episode (across its sessions)."""
        view = self.catalog().views.get(turn.episode_id)
        return segment_place(view.segments, turn) if view is not None else None

    def audit_page(self, session_id: str, leaf: int) -> str:
        from tito_addon.tools.audit_page import render_page
        from tito_addon.tools.drift_audit import audit_session

        session_file = self._session_file(session_id)
        if leaf not in {t.turn_id for t in session_file.turns}:
            raise ViewError(f"session {session_id[:200]!r} has no turn {leaf}", 404)
        info = session_file.turns[0].tokenizer
        tokenizer, why = self.tokenizers.for_record(info.name, info.tokenizer_sha256)
        if tokenizer is None:
            raise ViewError(
                f"the drift audit needs the record's tokenizer ({why}): start view with --tokenizer PATH", 409
            )
        try:
            audits = [a for a in audit_session(session_file, tokenizer) if a.leaf_turn_id == leaf]
        except RecordError as exc:
            raise ViewError(str(exc), 409) from exc
        if not audits:
            raise ViewError(f"turn {leaf} of session {session_id[:200]!r} ends no branch", 404)
        return render_page(session_file, audits[0], tokenizer)

    def image(self, file_name: str) -> tuple[bytes, str]:
        """A stored image's bytes and media type."""
        store = ImageStore(self.record_dir)
        try:
            path = store.path(file_name)
        except ValueError as exc:
            raise ViewError(f"{file_name[:100]!r} names no image: images are named <sha256>.<format>", 400) from exc
        if store.root.is_symlink() or path.is_symlink() or not path.is_file():  # the dir's own files, never a link
            raise ViewError(f"no image {file_name} in this record dir", 404)
        try:
            data = store.read(file_name)
        except OSError as exc:
            raise ViewError(f"cannot read image {file_name}: {exc}", 409) from exc
        return data, "image/" + file_name.rsplit(".", 1)[1]

    def episode_bundle(self, episode: str) -> dict[str, Any]:
        """Everything the page shows of one episode, for a file that asks no server: its turns' images inlined, each
        once (an image the store lacks is left out and the page says so)."""
        graph = self.episode(episode)
        turns = {}
        images: dict[str, str] = {}
        for tree in graph["trees"]:
            for node in tree["turns"]:
                turn = self.turn(tree["session"], node["turn_id"])
                turns[f"{tree['session']}/{node['turn_id']}"] = turn
                for image in turn["tokens"]["images"]:
                    name = f"{image['sha256']}.{image['format']}"
                    if name not in images:
                        try:
                            data, media_type = self.image(name)
                        except ViewError:
                            continue
                        images[name] = f"data:{media_type};base64,{base64.b64encode(data).decode()}"
        return {"episode": graph, "turns": turns, "group": self.group(graph["group"]), "images": images}


# The turn's record as the page's "record" panel shows it: without what the token view already shows in full.
BULKY = {"prompt_added_ids", "completion_ids", "completion_logprobs", "appended_messages", "assistant_message"}


def page_html(bundle: dict[str, Any] | None = None, title: str = "tito records") -> str:
    """The page, its script and style inlined; with `bundle`, one episode that needs no server."""
    assets = resources.files("tito_addon.tools") / "browser_assets"
    script = (assets / "app.js").read_text("utf-8")
    style = (assets / "app.css").read_text("utf-8")
    data = ""
    if bundle is not None:
        # No `<` in the script element at all (`</script>` or `<!--` in a record's text would change how HTML reads
        # it): JSON spells it `\u003c`.
        encoded = json.dumps(bundle, ensure_ascii=False, allow_nan=False).replace("<", "\\u003c")
        data = f'<script type="application/json" id="tito-bundle">{encoded}</script>'
        # A shared file fetches nothing, whatever a record's text holds: the browser refuses any request it makes.
        policy = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"
        policy_meta = f'<meta http-equiv="Content-Security-Policy" content="{policy}">'
    else:
        policy_meta = ""
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">{policy_meta}'
        f"<style>{style}</style></head>"
        f'<body><header id="top"><a href="#/" class="brand">tito records</a><nav><a href="#/">episodes</a>'
        f'<a href="#/sessions">sessions</a></nav><span id="where"></span></header><main id="main">loading…</main>'
        f"{data}<script>{script}</script></body></html>"
    )


# -- the HTTP server -----------------------------------------------------------------------------------------------


def json_response(value: Any, status: int = 200) -> web.Response:
    body = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return web.Response(status=status, text=body, content_type="application/json")


def error_response(message: str, status: int) -> web.Response:
    return json_response({"error": {"message": message, "status": status}}, status)


def browser_app(browser: RecordBrowser) -> web.Application:
    async def answer(work: Any) -> web.Response:
        try:
            return json_response(await asyncio.to_thread(work))
        except ViewError as exc:
            return error_response(str(exc), exc.status)
        except RecordError as exc:
            return error_response(str(exc), 409)

    def one(request: web.Request, name: str) -> str:
        value = request.query.get(name)
        if not value:
            raise ViewError(f"the query needs {name}")
        return value

    def number(request: web.Request, name: str) -> int:
        value = one(request, name)
        if not value.isdigit() or len(value) > 18:
            raise ViewError(f"{name} must be a turn id (a non-negative integer)")
        return int(value)

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=page_html(), content_type="text/html", headers=NO_FETCHES)

    async def episodes(request: web.Request) -> web.Response:
        return await answer(lambda: browser.episodes(CatalogQuery.of(dict(request.query))))

    async def sessions(request: web.Request) -> web.Response:
        return await answer(browser.sessions)

    async def episode(request: web.Request) -> web.Response:
        return await answer(lambda: browser.episode(one(request, "id")))

    async def group(request: web.Request) -> web.Response:
        return await answer(lambda: browser.group(one(request, "id")))

    async def turn(request: web.Request) -> web.Response:
        return await answer(lambda: browser.turn(one(request, "session"), number(request, "turn")))

    async def image(request: web.Request) -> web.Response:
        try:
            data, media_type = await asyncio.to_thread(browser.image, request.match_info["name"])
        except ViewError as exc:
            return error_response(str(exc), exc.status)
        # Never read as anything but the image it is (no sniffing), and cached: its name is its content's digest.
        headers = {"x-content-type-options": "nosniff", "cache-control": "private, max-age=31536000, immutable",
                   "content-security-policy": "default-src 'none'"}  # fmt: skip
        return web.Response(body=data, content_type=media_type, headers=headers)

    async def audit(request: web.Request) -> web.Response:
        try:
            text = await asyncio.to_thread(lambda: browser.audit_page(one(request, "session"), number(request, "leaf")))
        except ViewError as exc:
            return error_response(str(exc), exc.status)
        return web.Response(text=text, content_type="text/html", headers=NO_FETCHES)

    @web.middleware
    async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:  # aiohttp's own 404 and 405: JSON too, so the page can say them
            return error_response(exc.reason or "not found", exc.status)

    app = web.Application(middlewares=[json_errors])
    app.router.add_get("/", page)
    app.router.add_get("/api/episodes", episodes)
    app.router.add_get("/api/sessions", sessions)
    app.router.add_get("/api/episode", episode)
    app.router.add_get("/api/group", group)
    app.router.add_get("/api/turn", turn)
    app.router.add_get("/audit", audit)
    app.router.add_get("/image/{name}", image)
    return app


# The page fetches only from where it came: a record's text in it can never load anything from elsewhere.
NO_FETCHES = {"content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                         "connect-src 'self'; img-src 'self' data:"}  # fmt: skip


def serve(browser: RecordBrowser, host: str, port: int) -> None:
    async def main() -> None:
        runner = web.AppRunner(browser_app(browser), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        print(f"tito view: http://{host}:{bound}/ over {browser.record_dir} (Ctrl-C stops)", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass


def main(argv: list[str]) -> int:
    """`python -m tito_addon view`."""
    parser = argparse.ArgumentParser(
        prog="python -m tito_addon view",
        description="Browse a record dir in a web page: the episodes as a rollout table with filters, each episode's "
        "segments and session trees, a turn's tokens shaded by log-prob, a GRPO group side by side.",
    )
    parser.add_argument("record_dir", type=Path, metavar="RECORD_DIR")
    parser.add_argument("--port", type=int, default=8765, help="the page's port on --host (0: any free one)")
    parser.add_argument("--host", default="127.0.0.1", help="where to listen (default: loopback only)")
    parser.add_argument("--tokenizer", help="names the tokens (default: the record's own, when a local directory)")
    parser.add_argument("--html", type=Path, metavar="OUT", help="write one episode as one self-contained page")
    parser.add_argument("--episode", help="the episode --html writes (default: the first one recorded)")
    args = parser.parse_args(argv)
    if not args.record_dir.is_dir():
        print(f"error: {args.record_dir} is not a directory", file=sys.stderr)
        return 2
    browser = RecordBrowser(args.record_dir, RecordTokenizers(override=args.tokenizer))
    if args.html is None:
        serve(browser, args.host, args.port)
        return 0
    try:
        episodes = browser.catalog().episodes
        episode = args.episode or (episodes[0]["episode"] if episodes else None)
        if episode is None:
            raise ViewError(f"{args.record_dir} holds no episode")
        bundle = browser.episode_bundle(episode)
    except (ViewError, RecordError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.html.write_text(page_html(bundle, title=f"tito episode {episode}"), "utf-8")
    print(f"page: {args.html} (episode {episode}, {len(bundle['turns'])} turns)")
    return 0
