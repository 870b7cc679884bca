"""The record browser over a screenshot session (`qwen2.5-vl` on the sglang replica, through a real mitmdump): a turn's
run of image pads is one element, with the screenshot it stands for drawn from the record dir's image store (decoded
by headless Chromium, pixels checked), and a one-episode file inlines each image once and fetches nothing.

The image route serves only the store's own names, each a regular file whose bytes match its digest: a name that is not
a digest and a format, a path out of the store, a missing image, a link (or a store that is one) and a tampered file
are each a 4xx.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.headless_chromium import HeadlessChromium, chromium_binary
from support.images import IMAGE_PAD, png, screenshot_session
from support.proxy_harness import REPO, get
from support.record_view import running_view, screenshot, shown, texts

from tito_addon.records.record_reader import read_session

pytestmark = [pytest.mark.full]

RED, BLUE = (200, 30, 30), (30, 30, 200)
SHOTS = [png(160, 100, RED), png(100, 160, BLUE)]

# Each token element of the turn view as [id, how many tokens it stands for].
TOKENS_JS = """[...document.querySelectorAll('#tokens .tok')].map(
    s => [Number(s.dataset.id), Number(s.dataset.count || 1)])"""
IMAGE_JS = """[...document.querySelectorAll('#tokens figure.turn-image')].map(f => {
    const img = f.querySelector('img');
    return {sha: f.dataset.sha256, caption: f.querySelector('figcaption').textContent, src: img && img.src,
            width: img ? img.naturalWidth : 0, height: img ? img.naturalHeight : 0};
})"""
LOADED_JS = "[...document.querySelectorAll('#tokens figure.turn-image img')].every(i => i.complete && i.naturalWidth)"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    chromium_binary()  # skip (or fail, in CI) before recording anything
    record_dir, _, _ = screenshot_session(tmp_path_factory.mktemp("shots"), "shots", SHOTS)
    return record_dir


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[HeadlessChromium]:
    with HeadlessChromium(tmp_path_factory.mktemp("chromium")) as running:
        yield running


def expanded(elements: list[list[int]]) -> list[int]:
    return [token for token, count in elements for _ in range(count)]


def test_a_turns_screenshot_is_drawn_at_its_run_of_pads(recorded: Path, browser: HeadlessChromium, tmp_path) -> None:
    session = read_session(recorded, "shots")
    assert session is not None and len(session.turns) == 2
    turn = session.turns[1]
    [image] = turn.images
    assert image.sha256 == hashlib.sha256(SHOTS[1]).hexdigest()
    page = browser.new_page(width=1400, height=1000)
    try:
        with running_view(recorded) as url:
            shown(page, url + "/#/")
            skipped = page.evaluate("(document.getElementById('skipped') || {textContent: ''}).textContent")
            assert "images" not in skipped  # the image store is the record dir's own, not a foreign file
            shown(page, url + "/#/turn/shots/1")
            page.wait_for(LOADED_JS, timeout=20)
            elements = page.evaluate(TOKENS_JS)
            # Every token is on the page, the image's run of pads as one element.
            assert expanded(elements) == turn.prompt_added_ids + turn.completion_ids
            [run] = [e for e in elements if e[1] > 1]
            assert run == [IMAGE_PAD, image.length]
            assert texts(page, "#tokens .tok.run", "data-pos") == [str(image.offset)]
            [figure] = page.evaluate(IMAGE_JS)
            assert figure["sha"] == image.sha256 and figure["src"] == f"{url}/image/{image.sha256}.png"
            assert (figure["width"], figure["height"]) == (100, 160)  # the stored file, decoded by the browser
            assert (
                f"100×160 png · {image.length} tokens at {image.offset}–{image.offset + image.length - 1}"
                in (figure["caption"])
            )
            # On screen: the screenshot's blue, at its own size; the first turn's red is not in this turn.
            page.evaluate("document.querySelector('#tokens figure.turn-image').scrollIntoView({block: 'start'})")
            drawn = screenshot(page, "browser-image-turn.png", tmp_path)
            facts = browser.image_facts(drawn, {"blue": BLUE, "red": RED}, within=3)
            assert facts.near["blue"] >= 100 * 160 * 0.95 and facts.near["red"] == 0, facts
            messages = page.evaluate("document.querySelector('.messages').textContent")
            assert f"[image {image.sha256[:12]} 100×160]" in messages and "And now?" in messages
            served = get(figure["src"])
            assert served.status_code == 200 and served.content == SHOTS[1]
            assert served.headers["content-type"] == "image/png"
            assert served.headers["x-content-type-options"] == "nosniff"
    finally:
        page.close()


def test_only_the_stores_own_images_are_served(recorded: Path, tmp_path: Path) -> None:
    copy = tmp_path / "rec"
    shutil.copytree(recorded, copy)
    first, second = (f"{hashlib.sha256(shot).hexdigest()}.png" for shot in SHOTS)
    outside = tmp_path / "outside.png"
    outside.write_bytes(SHOTS[0])
    (copy / "images" / first).unlink()
    (copy / "images" / first).symlink_to(outside)  # the right bytes, but a link: not the store's own file
    (copy / "images" / second).write_bytes(SHOTS[0])  # the wrong bytes under a digest
    missing = "0" * 64 + ".png"
    with running_view(copy) as url:
        tries = {
            "/image/" + first: 404,
            "/image/" + missing: 404,
            "/image/" + second: 409,
            "/image/" + first.replace(".png", ".svg"): 400,
            "/image/abc.png": 400,
            "/image/" + first.upper(): 400,
            "/image/..%2Foutside.png": None,
            "/image/%2e%2e%2F%2e%2e%2Foutside.png": None,
            "/image/../outside.png": None,
        }  # fmt: skip (None: any 4xx, as the router or the name check answers it)
        for path, status in tries.items():
            answer = get(url + path)
            assert answer.status_code == status or (status is None and 400 <= answer.status_code < 500), (
                path, answer.status_code, answer.text)  # fmt: skip
            assert answer.json()["error"]["message"] and answer.content != SHOTS[0]
    # A store that is itself a link is not the dir's own: none of its images is served.
    linked = tmp_path / "linked"
    shutil.copytree(recorded, linked)
    shutil.move(linked / "images", tmp_path / "elsewhere")
    (linked / "images").symlink_to(tmp_path / "elsewhere")
    with running_view(linked) as url:
        assert get(f"{url}/image/{second}").status_code == 404


def test_one_episode_as_a_file_holds_each_image_once(recorded: Path, browser: HeadlessChromium, tmp_path) -> None:
    out = tmp_path / "shots.html"
    argv = [sys.executable, "-m", "tito_addon", "view", str(recorded), "--html", str(out), "--episode", "shots"]
    made = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    page_text = out.read_text()
    for shot in SHOTS:  # each image inlined once, in a two-turn episode that sent the first one twice
        assert page_text.count(hashlib.sha256(shot).hexdigest() + ".png") == 1
    page = browser.new_page(width=1400, height=1000)
    try:
        for turn, size in ((0, (160, 100)), (1, (100, 160))):
            shown(page, out.as_uri() + f"#/turn/shots/{turn}")
            page.wait_for(LOADED_JS, timeout=20)
            [figure] = page.evaluate(IMAGE_JS)
            assert figure["src"].startswith("data:image/png;base64,") and (figure["width"], figure["height"]) == size
        fetched = page.evaluate("performance.getEntriesByType('resource').filter(e => !e.name.startsWith('data:'))")
        assert fetched == []  # nothing asked of any server
    finally:
        page.close()
