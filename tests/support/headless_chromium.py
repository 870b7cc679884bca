"""A headless Chromium the tests drive over the Chrome DevTools Protocol (CDP), with aiohttp's websocket client.

A sync API for tests; the protocol runs on an asyncio loop in a background thread:

    with HeadlessChromium(tmp_path) as browser:
        page = browser.new_page("http://127.0.0.1:8081/", width=1280, height=900)
        page.wait_for("document.querySelector('.flow-table tbody tr')")
        page.click(".flow-table tbody tr")
        page.set_value("input.filter", "~u /v1/")   # fires input and change, as typing does (React sees it)
        text = page.evaluate("document.title")       # awaits a promise, returns the value as JSON gives it
        png = page.screenshot(tmp_path / "page.png") # PNG bytes, also written to the path
        html = page.dom()
        assert browser.image_facts(png).colours > 16  # decoded by the browser: size, colours

`chromium_binary()` finds the browser, or skips the test (fails it where `TITO_CHROMIUM_REQUIRED=1`, as CI sets).
Chromium runs in a process group of its own with a fresh profile under the given directory (its log is
`chromium.log` there); closing the browser asks it to quit, then kills the whole group. Every call has a timeout;
a JavaScript exception is a `PageError` that carries the page's message, and a browser that died is a `CdpError`
naming its log's tail. `page.console` holds what the page logged and threw, for a failing test to show.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

T = TypeVar("T")

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--mute-audio",
    "--remote-debugging-port=0",
]
START_TIMEOUT = 30.0


# Decodes a base64 image and counts its pixels' distinct values and the most common one's share.
IMAGE_FACTS_JS = """(async (data, near, within) => {
    const bytes = Uint8Array.from(atob(data), c => c.charCodeAt(0));
    const bitmap = await createImageBitmap(new Blob([bytes]));
    const canvas = new OffscreenCanvas(bitmap.width, bitmap.height);
    const context = canvas.getContext('2d');
    context.drawImage(bitmap, 0, 0);
    const rgba = context.getImageData(0, 0, bitmap.width, bitmap.height).data;
    const close = Object.fromEntries(Object.keys(near).map(name => [name, 0]));
    for (let i = 0; i < rgba.length; i += 4) {
        for (const [name, [r, g, b]] of Object.entries(near)) {
            if (Math.abs(rgba[i] - r) <= within && Math.abs(rgba[i + 1] - g) <= within &&
                Math.abs(rgba[i + 2] - b) <= within) close[name] += 1;
        }
    }
    const pixels = new Uint32Array(rgba.buffer);
    const counts = new Map();
    for (const pixel of pixels) counts.set(pixel, (counts.get(pixel) || 0) + 1);
    let most = 0;
    for (const count of counts.values()) most = Math.max(most, count);
    return {width: bitmap.width, height: bitmap.height, colours: counts.size, background_share: most / pixels.length,
            near: close};
})(%s, %s, %d)"""


@dataclass(frozen=True)
class ImageFacts:
    width: int
    height: int
    colours: int  # distinct pixel values
    background_share: float  # the share of the pixels that have the most common value
    near: dict[str, int]  # per colour asked for, the pixels within the tolerance of it in each channel


class CdpError(RuntimeError):
    """The browser refused a command, did not answer in time, or is gone."""


class PageError(RuntimeError):
    """JavaScript the test ran in a page threw (the page's own message and location)."""


def chromium_binary() -> str:
    """The Chromium to run: skips the calling test where none is installed, fails it where one is required."""
    import pytest

    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not found:
        if os.environ.get("TITO_CHROMIUM_REQUIRED") == "1":
            pytest.fail("this test needs Chromium (apt-get install chromium)")
        pytest.skip("Chromium is not installed")
    return found


class _Connection:
    """One websocket to the browser; commands are matched to their answers by id, events handed to waiters.
    Lives on the background loop only."""

    def __init__(self, http: aiohttp.ClientSession, socket: aiohttp.ClientWebSocketResponse) -> None:
        self.http, self.socket = http, socket
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.waiters: list[tuple[str, str | None, asyncio.Future[dict[str, Any]]]] = []
        self.consoles: dict[str, list[str]] = {}  # CDP session -> its page's console lines
        self.closed: BaseException | None = None
        self.reader = asyncio.ensure_future(self._read())

    async def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict:
        if self.closed is not None:
            raise CdpError(f"{method}: the browser connection is closed ({self.closed})")
        number = next(self.ids)
        message: dict[str, Any] = {"id": number, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[number] = answer
        try:
            await self.socket.send_str(json.dumps(message))
            reply = await answer
        finally:
            self.pending.pop(number, None)
        if "error" in reply:
            raise CdpError(f"{method}: {reply['error'].get('message')} {reply['error'].get('data', '')}".rstrip())
        return reply.get("result", {})

    def event(self, method: str, session: str | None) -> asyncio.Future[dict[str, Any]]:
        """A future for the next `method` event of `session`; made before the command that causes it."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiters.append((method, session, future))
        return future

    async def _read(self) -> None:
        try:
            async for frame in self.socket:
                if frame.type != aiohttp.WSMsgType.TEXT:
                    continue
                message = json.loads(frame.data)
                if "id" in message:
                    future = self.pending.get(message["id"])
                    if future is not None and not future.done():
                        future.set_result(message)
                else:
                    self._dispatch(message)
            self.closed = CdpError("the browser closed its DevTools connection")
        except Exception as exc:  # noqa: BLE001 - every pending command learns why the connection ended
            self.closed = exc
        for future in [*self.pending.values(), *(w[2] for w in self.waiters)]:
            if not future.done():
                future.set_exception(CdpError(f"the browser connection ended: {self.closed}"))

    def _dispatch(self, message: dict[str, Any]) -> None:
        method, session, params = message.get("method"), message.get("sessionId"), message.get("params", {})
        if method == "Runtime.consoleAPICalled":
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.consoles.setdefault(session or "", []).append(f"console.{params.get('type')}: {args}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = (details.get("exception") or {}).get("description") or details.get("text")
            self.consoles.setdefault(session or "", []).append(f"uncaught: {text}")
        for waiter in list(self.waiters):
            if waiter[0] == method and waiter[1] == session:
                self.waiters.remove(waiter)
                if not waiter[2].done():
                    waiter[2].set_result(params)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.socket.close()
        self.reader.cancel()
        with contextlib.suppress(BaseException):
            await self.reader
        await self.http.close()


class HeadlessChromium:
    """A headless Chromium process and its DevTools connection. `timeout`: the default for every call."""

    def __init__(
        self, workdir: Path, *, binary: str | None = None, timeout: float = 30.0, flags: list[str] | None = None
    ) -> None:
        self.workdir = Path(workdir)
        self.binary = binary or chromium_binary()
        self.timeout = timeout
        self.flags = [*FLAGS, *(flags or [])]
        self.profile = self.workdir / "chromium-profile"
        self.log_path = self.workdir / "chromium.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.pages: list[Page] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._connection: _Connection | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> HeadlessChromium:
        self.profile.mkdir(parents=True, exist_ok=True)
        port_file = self.profile / "DevToolsActivePort"
        port_file.unlink(missing_ok=True)  # a previous run's port is not this one's
        argv = [self.binary, *self.flags, f"--user-data-dir={self.profile}", "about:blank"]
        with self.log_path.open("wb") as log:
            # Its own process group: closing kills the renderers and helpers with it.
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            browser_path = self._devtools_address(port_file)
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="headless-chromium", daemon=True)
            self._thread.start()
            self._connection = self._run(self._connect(browser_path), self.timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _devtools_address(self, port_file: Path) -> str:
        """ws://… of the browser target: Chromium writes its port and path to the profile once it listens."""
        deadline = time.monotonic() + START_TIMEOUT
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise CdpError(f"Chromium exited with {self.process.returncode}:\n{self.log_tail()}")
            lines = port_file.read_text().splitlines() if port_file.is_file() else []
            if len(lines) >= 2:
                return f"ws://127.0.0.1:{int(lines[0])}{lines[1]}"
            time.sleep(0.05)
        raise CdpError(f"Chromium did not open its DevTools port in {START_TIMEOUT:.0f} s:\n{self.log_tail()}")

    @staticmethod
    async def _connect(address: str) -> _Connection:
        http = aiohttp.ClientSession()
        try:
            socket = await http.ws_connect(address, max_msg_size=0)  # screenshots are megabytes of base64
        except BaseException:
            await http.close()
            raise
        return _Connection(http, socket)

    def close(self) -> None:
        """Quit the browser (politely, then by killing its process group) and stop the loop; safe to call twice."""
        if self._connection is not None and self._loop is not None:
            with contextlib.suppress(Exception):
                self._run(self._connection.call("Browser.close"), 5.0)
            with contextlib.suppress(Exception):
                self._run(self._connection.close(), 5.0)
            self._connection = None
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5.0)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)  # helpers that outlived the browser too
            self.process.wait()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=5.0)
            self._loop.close()
            self._loop = self._thread = None

    def __enter__(self) -> HeadlessChromium:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text("utf-8", "replace")[-chars:]
        except OSError:
            return "(no log)"

    # -- calls --------------------------------------------------------------------------------

    def _run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None) -> T:
        assert self._loop is not None, "the browser is not started"
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        limit = self.timeout if timeout is None else timeout
        try:
            return future.result(limit)
        except TimeoutError:
            future.cancel()
            raise CdpError(f"no answer from Chromium in {limit:.0f} s") from None
        except CdpError as exc:
            if self.process is not None and self.process.poll() is not None:  # it died: say how
                raise CdpError(f"{exc}; Chromium exited with {self.process.returncode}:\n{self.log_tail()}") from exc
            raise

    def call(self, method: str, params: dict[str, Any] | None = None, *, session: str | None = None) -> dict:
        """Any CDP command (`session`: a page's, for a page's domains); its result."""
        connection = self._live()
        return self._run(connection.call(method, params, session), None)

    def _live(self) -> _Connection:
        if self._connection is None:
            raise CdpError("the browser is not started")
        return self._connection

    def image_facts(
        self, image: bytes, near: dict[str, tuple[int, int, int]] | None = None, within: int = 24
    ) -> ImageFacts:
        """What an image (a screenshot's PNG) shows, decoded by the browser in a scratch tab: its size and colours,
        for a test to tell a rendered page from a blank one, and how many pixels lie within `within` of each colour
        in `near` (an RGB each), for a test to tell what it shows."""
        page = self.new_page()
        try:
            data = json.dumps(base64.b64encode(image).decode())
            facts = page.evaluate(IMAGE_FACTS_JS % (data, json.dumps(near or {}), within))
        finally:
            page.close()
        return ImageFacts(**facts)

    def new_page(self, url: str = "about:blank", *, width: int = 1280, height: int = 900) -> Page:
        """A new tab of `width` x `height` CSS pixels, loaded (its `load` event fired) at `url`."""
        target = self.call("Target.createTarget", {"url": "about:blank"})
        attached = self.call("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})
        page = Page(self, target["targetId"], attached["sessionId"])
        for domain in ("Page.enable", "Runtime.enable"):
            page.call(domain)
        page.resize(width, height)
        self.pages.append(page)
        if url != "about:blank":
            page.navigate(url)
        return page


class Page:
    """One tab. Every method takes a `timeout` in seconds (default: the browser's)."""

    def __init__(self, browser: HeadlessChromium, target_id: str, session: str) -> None:
        self.browser, self.target_id, self.session = browser, target_id, session

    def call(self, method: str, params: dict[str, Any] | None = None, *, timeout: float | None = None) -> dict:
        """A CDP command to this page's target."""
        connection = self.browser._live()
        return self.browser._run(connection.call(method, params, self.session), timeout)

    @property
    def console(self) -> list[str]:
        """What the page logged (`console.*`) and threw (uncaught exceptions), in order."""
        return list(self.browser._live().consoles.get(self.session, []))

    def navigate(self, url: str, *, timeout: float | None = None) -> None:
        """Go to `url` and wait for its `load` event; a change of the fragment alone loads nothing and returns at
        once (wait for what the page then shows with `wait_for`)."""
        connection = self.browser._live()

        async def go() -> None:
            loaded = connection.event("Page.loadEventFired", self.session)
            try:
                result = await connection.call("Page.navigate", {"url": url}, self.session)
                if result.get("errorText"):
                    raise CdpError(f"cannot load {url}: {result['errorText']}")
                if result.get("loaderId"):  # a new document: wait until it has loaded
                    await loaded
            finally:
                if not loaded.done():
                    loaded.cancel()
                    connection.waiters = [w for w in connection.waiters if w[2] is not loaded]

        self.browser._run(go(), timeout)

    def evaluate(self, expression: str, *, timeout: float | None = None) -> Any:
        """The value of a JavaScript expression (a promise is awaited), as JSON carries it (DOM nodes are not
        values: return their text or attributes). A thrown exception is a PageError."""
        result = self.call(
            "Runtime.evaluate",
            {"expression": expression, "awaitPromise": True, "returnByValue": True, "userGesture": True},
            timeout=timeout,
        )
        details = result.get("exceptionDetails")
        if details is not None:
            thrown = (details.get("exception") or {}).get("description") or details.get("text")
            raise PageError(f"{thrown} (evaluating {expression[:200]!r})")
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, *, timeout: float = 10.0, interval: float = 0.1) -> Any:
        """Poll `expression` until its value is truthy and return that value (a DOM node found is `True`: nodes are
        not values); a TimeoutError naming its last value (or the exception it last threw) otherwise."""
        deadline = time.monotonic() + timeout
        last: Any = None
        polled = f"(async () => {{ const value = await ({expression}); return value instanceof Node || value; }})()"
        while True:
            try:
                last = self.evaluate(polled, timeout=max(1.0, deadline - time.monotonic()))
                if last:
                    return last
            except PageError as exc:
                last = exc
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{expression[:200]!r} was not truthy in {timeout:g} s (last: {last!r}); console: {self.console}"
                )
            time.sleep(interval)

    def click(self, selector: str, *, timeout: float | None = None) -> None:
        """A real left click (mouse moved, pressed, released) at the centre of the first element `selector` finds,
        scrolled into view first; a PageError when none is found or it has no size."""
        box = self.evaluate(
            f"""(() => {{
                const el = document.querySelector({json.dumps(selector)});
                if (!el) throw new Error('no element matches ' + {json.dumps(selector)});
                el.scrollIntoView({{block: 'center', inline: 'center'}});
                const r = el.getBoundingClientRect();
                if (!r.width || !r.height) throw new Error({json.dumps(selector)} + ' has no size');
                return {{x: r.left + r.width / 2, y: r.top + r.height / 2}};
            }})()""",
            timeout=timeout,
        )
        point = {"x": box["x"], "y": box["y"], "button": "left", "clickCount": 1}
        self.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": box["x"], "y": box["y"]}, timeout=timeout)
        self.call("Input.dispatchMouseEvent", {"type": "mousePressed", **point}, timeout=timeout)
        self.call("Input.dispatchMouseEvent", {"type": "mouseReleased", **point}, timeout=timeout)

    def set_value(self, selector: str, value: str, *, timeout: float | None = None) -> None:
        """Set an input's, textarea's or select's value and fire `input` and `change` as a user's edit does. The
        value goes through the element's native setter, so a React-controlled field sees the change."""
        self.evaluate(
            f"""(() => {{
                const el = document.querySelector({json.dumps(selector)});
                if (!el) throw new Error('no element matches ' + {json.dumps(selector)});
                const proto = Object.getPrototypeOf(el);
                const setter = Object.getOwnPropertyDescriptor(proto, 'value')?.set;
                if (setter) setter.call(el, {json.dumps(value)}); else el.value = {json.dumps(value)};
                el.dispatchEvent(new Event('input', {{bubbles: true}}));
                el.dispatchEvent(new Event('change', {{bubbles: true}}));
                return true;
            }})()""",
            timeout=timeout,
        )

    def resize(self, width: int, height: int) -> None:
        """The viewport, in CSS pixels at scale 1 (what a screenshot captures)."""
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
        self.call("Emulation.setDeviceMetricsOverride", metrics)

    def screenshot(
        self, path: Path | str | None = None, *, width: int | None = None, height: int | None = None
    ) -> bytes:
        """A PNG of the viewport (resized first when `width` and `height` are given); written to `path` if given."""
        if width is not None and height is not None:
            self.resize(width, height)
        data = base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"})["data"])
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_bytes(data)
        return data

    def dom(self) -> str:
        """The document's HTML as it stands now (after scripts ran), not as it was served."""
        return str(self.evaluate("document.documentElement.outerHTML"))

    def close(self) -> None:
        self.browser.call("Target.closeTarget", {"targetId": self.target_id})
        if self in self.browser.pages:
            self.browser.pages.remove(self)
