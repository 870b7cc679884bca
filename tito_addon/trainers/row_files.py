"""Exported rows read back as dicts, from the Parquet or JSON Lines file `python -m tito_addon export` wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

Rows = str | Path | list  # a file's path, or rows already read (`rows_of`, the control API's JSON Lines)


def read_rows(source: Rows) -> list[dict[str, Any]]:
    if isinstance(source, list):
        return source
    path = Path(source)
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as lines:
            return [json.loads(line) for line in lines if line.strip()]
    import pyarrow.parquet as pq

    # One file read on this thread: Arrow's pool threads can still be joinable at interpreter exit, which aborts a
    # short script after its work is done.
    return pq.ParquetFile(path).read(use_threads=False).to_pylist()


def require_columns(rows: list[dict[str, Any]], columns: tuple[str, ...], layout: str) -> None:
    for row in rows:
        missing = [name for name in columns if name not in row]
        if missing:
            raise ValueError(f"these rows are not the {layout} layout (no {', '.join(missing)}): export with "
                             f"--format {layout}")  # fmt: skip
