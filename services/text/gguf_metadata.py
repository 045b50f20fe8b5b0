"""Opening a GGUF file and reading its key/value metadata, for the tokenizer and the weight loader."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from stat import S_ISREG
from typing import Any

import gguf
import numpy as np

# Readers of the last few files opened, by (path, inode, size, mtime): a process that opens the same unchanged
# file again (the tokenizer, then the weight loader; engines made one after another) skips the header parse,
# ~3 s for a 49k-token vocabulary on a small CPU. A reader is a read-only memory map, so sharing it is safe.
_READERS: OrderedDict[tuple, gguf.GGUFReader] = OrderedDict()
_MAX_READERS = 4


class _PlainViewReader(gguf.GGUFReader):
    """``gguf.GGUFReader`` slicing a plain ndarray view of its memory map instead of the ``np.memmap`` itself.

    The reader slices the file once per field part and tensor (about 250k slices for a 49k-token vocabulary and its
    merges), and every slice of an ``np.memmap`` runs numpy's Python-level ``memmap.__getitem__`` and
    ``__array_finalize__``: 70% of the header parse. A view of the same mapping as a base ``ndarray`` reads the same
    bytes without them: SmolLM2's header parses in 0.65 s instead of 2.3 s, and its tensors (plain views too)
    dequantize without the same overhead. ``mapping`` keeps the ``np.memmap`` (its ``filename``).
    """

    mapping: np.memmap

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.memmap) -> None:
        self.mapping = value
        self._plain = value.view(np.ndarray)


def open_gguf_reader(path: str | Path) -> gguf.GGUFReader:
    """Memory-map a GGUF file and parse its header; errors name the file and what is wrong with it. A file opened
    before and unchanged since (same inode, size and modification time) gets the same reader back.

    It lives in services.text, not in the weight loader, so that tokenizing never has to import torch.
    """
    path = Path(path)
    try:
        stat = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        stat = None
    if stat is None or not S_ISREG(stat.st_mode):
        raise FileNotFoundError(f"{path}: no such GGUF file")
    key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key in _READERS:
        _READERS.move_to_end(key)
        return _READERS[key]
    with path.open("rb") as file:
        magic = file.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = _PlainViewReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, MemoryError) as exc:
        # The reader reports a short or damaged file as a failed reshape or index deep inside numpy.
        raise ValueError(f"{path}: corrupt or truncated GGUF file ({type(exc).__name__}: {exc})") from exc
    _READERS[key] = reader
    while len(_READERS) > _MAX_READERS:
        _READERS.popitem(last=False)
    return reader


class GGUFMetadata:
    """Typed access to a GGUF reader's key/value fields; a missing key reads as None."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._reader = reader
        self.where = str(getattr(getattr(reader, "mapping", reader.data), "filename", None) or "GGUF file")

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
