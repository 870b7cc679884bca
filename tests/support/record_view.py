"""The record browser (`python -m tito_addon view`) as the browser tests run it: the server as a process, and a page
drawn and read in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from support.headless_chromium import Page
from support.proxy_harness import REPO


class running_view:
    """`python -m tito_addon view DIR --port 0` as a process; its URL read from what it prints."""

    def __init__(self, record_dir: Path) -> None:
        argv = [sys.executable, "-m", "tito_addon", "view", str(record_dir), "--port", "0"]
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def __enter__(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert found, f"view printed {line!r}"
        return found.group(0).rstrip("/")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def shown(page: Page, url: str) -> None:
    """Go to `url` (a new address or only a new fragment) and wait until the page has drawn it."""
    page.navigate(url)
    fragment = url.split("#", 1)[1] if "#" in url else "/"
    page.wait_for(f"document.body.dataset.ready === {json.dumps('#' + fragment)}", timeout=20)


def texts(page: Page, selector: str, attribute: str | None = None) -> list:
    what = f"e.getAttribute({json.dumps(attribute)})" if attribute else "e.textContent"
    return page.evaluate(f"[...document.querySelectorAll({json.dumps(selector)})].map(e => {what})")


def screenshot(page: Page, name: str, tmp_path: Path) -> bytes:
    png = page.screenshot(tmp_path / name)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    keep = os.environ.get("TITO_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / name, Path(keep) / name)
    return png
