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


def routes_array(value: Any, tokens: int, where: str) -> Any:
    """An exported row's MoE routes (`routed_experts`, slime's `rollout_routed_experts`) as a numpy array of shape
    `(tokens - 1, layers, topk)`: Parquet holds the `.npy` file's bytes, JSON Lines their base64. None stays None."""
    if value is None:
        return None
    import base64
    import io

    import numpy as np

    data = base64.b64decode(value, validate=True) if isinstance(value, str) else bytes(value)
    array = np.load(io.BytesIO(data), allow_pickle=False)
    if array.ndim != 3 or array.shape[0] != max(tokens - 1, 0):
        raise ValueError(f"{where}: its routes are {array.shape}, not a row for each of its {tokens} tokens but one")
    return array


def require_columns(rows: list[dict[str, Any]], columns: tuple[str, ...], layout: str) -> None:
    for row in rows:
        missing = [name for name in columns if name not in row]
        if missing:
            raise ValueError(f"these rows are not the {layout} layout (no {', '.join(missing)}): export with "
                             f"--format {layout}")  # fmt: skip
