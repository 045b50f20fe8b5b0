"""Opening a GGUF file and reading its key/value metadata, for the tokenizer and the weight loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf


def open_gguf_reader(path: str | Path) -> gguf.GGUFReader:
    """Memory-map a GGUF file and parse its header; errors name the file and what is wrong with it.

    It lives in services.text, not in the weight loader, so that tokenizing never has to import torch.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    with path.open("rb") as file:
        magic = file.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, MemoryError) as exc:
        # The reader reports a short or damaged file as a failed reshape or index deep inside numpy.
        raise ValueError(f"{path}: corrupt or truncated GGUF file ({type(exc).__name__}: {exc})") from exc


class GGUFMetadata:
    """Typed access to a GGUF reader's key/value fields; a missing key reads as None."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._reader = reader
        self.where = str(getattr(reader.data, "filename", None) or "GGUF file")

    def get(self, key: str) -> Any:
        field = self._reader.fields.get(key)
        return None if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.where}: GGUF metadata lacks {key!r}")
        return value


def split_merges(merges: list[str], where: str) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` (``"a b"`` strings) as pairs; ValueError naming the file for a bad one."""
    pairs = []
    for merge in merges:
        pair = merge.split(" ", 1)
        if len(pair) != 2:
            raise ValueError(f"{where}: merge {merge!r} is not two tokens separated by a space")
        pairs.append((pair[0], pair[1]))
    return pairs
