"""The record dir's images: each stored once, under its content's digest, as the agent sent it.

A computer-use episode sends a screenshot every turn and re-sends every earlier one with it; its lines name images by
digest (`images` of a turn line) and the bytes live once in `<record_dir>/images/<sha256>.<format>`, written before
the line that names them, so no line names an image that is not there. Names are made from a digest and a format the
proxy decoded, never from what a client wrote, and are checked to stay in the store.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path

from tito_addon.chat_images import ChatImage

STORE_DIR = "images"
_NAME = re.compile(r"^[0-9a-f]{64}\.(png|jpeg|gif|webp)$")


class ImageStore:
    def __init__(self, record_dir: str | os.PathLike[str]) -> None:
        self.root = Path(record_dir) / STORE_DIR
        self._known: set[str] = set()

    def path(self, file_name: str) -> Path:
        if not _NAME.match(file_name):
            raise ValueError(f"not an image store name: {file_name!r}")
        return self.root / file_name

    def put(self, images: Iterable[ChatImage]) -> None:
        """Keep each image not yet kept; an image already there is the same bytes (its name is their digest)."""
        for image in images:
            name = image.file_name
            if name in self._known:
                continue
            path = self.path(name)
            if not path.exists():
                self.root.mkdir(parents=True, exist_ok=True)
                # Written whole, then named: a reader never sees half an image under a digest.
                fd, temp = tempfile.mkstemp(dir=self.root, prefix=".incoming-")
                try:
                    with os.fdopen(fd, "wb") as handle:
                        handle.write(image.data)
                    os.replace(temp, path)
                except BaseException:
                    Path(temp).unlink(missing_ok=True)
                    raise
            self._known.add(name)

    def read(self, file_name: str) -> bytes:
        """An image's bytes, checked against the digest that names it (OSError when missing or not the same)."""
        data = self.path(file_name).read_bytes()
        if hashlib.sha256(data).hexdigest() != file_name.split(".", 1)[0]:
            raise OSError(f"the stored image {file_name} does not match its digest")
        return data
