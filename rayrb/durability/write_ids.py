"""The write ids an online shard placed itself: its journal of direct writes. No Ray here.

Where a buffer's shards place their own writes (``rayrb.handle.direct``), a write reaches its shard without the
coordinator, so the shard keeps what a retry needs: for each piece it applied, ``(write id, piece)`` ->
``(first, rows, start, digest)``, the piece's place in the shard's write stream (its ``first``-th row on), its
rows, where those rows start in the whole write, and the digest of the whole write's rows.

The journal line is appended *before* the piece's rows are stored and the write count moves past them, so

- a process killed after the count moved finds the line again: a retry (Ray re-sends the call to the restarted
  shard) is answered from it and writes nothing;
- a process killed before finds a line whose rows the count never reached: reopening drops it, and the retry
  places the piece anew, at the count there is.

Lines that count are a chain: each piece starts where the one before it ended, and the last ends at or before
the write count. So a line is kept on reopening when its rows end at or below the first row of the next kept
line (the write count, for the last). A piece that failed after its line was written (its rows refused, a full
disk) is passed over by the next piece's line at the same place.

Examples:
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> ids = WriteIds(d, written=0)
    >>> ids.add("a", 0, first=0, rows=4, start=0, digest="x")
    >>> ids.add("b", 0, first=4, rows=2, start=0, digest="y")   # its rows never counted: the shard died first
    >>> again = WriteIds(d, written=4)
    >>> again.get("a", 0), again.get("b", 0)
    (Piece(first=0, rows=4, start=0, digest='x'), None)
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

from rayrb.errors import WriteIdError
from rayrb.io.files import replace_file

FILE = "write_ids.log"
REMEMBER = 4096  # pieces a shard keeps ids for: as many writes as the coordinator remembers (docs/durability.md)


class Piece(NamedTuple):
    first: int  # the shard's write count the piece was placed at
    rows: int
    start: int  # where its rows start in the whole write
    digest: str | None  # of the whole write's rows (rayrb.io.arrays.rows_digest)


class WriteIds:
    """The last ``remember`` pieces a shard placed, by ``(write id, piece)``, journalled under ``directory``
    (kept in memory only without one)."""

    def __init__(self, directory: str | os.PathLike | None, written: int, remember: int = REMEMBER):
        self._path = None if directory is None else Path(directory) / FILE
        self._remember = int(remember)
        self._pieces: OrderedDict[tuple[str, int], Piece] = OrderedDict()
        self._lines = 0
        if self._path is not None:
            for key, piece in _chain(_read(self._path), int(written))[-self._remember:]:
                self._pieces[key] = piece
            self._lines = len(self._pieces)
            replace_file(self._path, "".join(_line(k, p) for k, p in self._pieces.items()))  # torn lines gone

    def get(self, write_id: str, piece: int) -> Piece | None:
        return self._pieces.get((write_id, int(piece)))

    def of(self, write_id: str) -> dict[int, Piece]:
        """Every piece of ``write_id`` this shard holds, by piece number."""
        return {p: v for (w, p), v in self._pieces.items() if w == write_id}

    def check(self, write_id: str, piece: int, rows: int, start: int, digest: str | None) -> Piece | None:
        """The piece placed before under this id, if any; raises ``WriteIdError`` if it was placed for other
        rows (another count, another place in its write, or another digest)."""
        seen = self.get(write_id, piece)
        if seen is not None and (seen.rows, seen.start) != (int(rows), int(start)) or (
                seen is not None and None not in (seen.digest, digest) and seen.digest != digest):
            raise WriteIdError(f"write_id {write_id!r} (piece {piece}) was used for {seen.rows} rows at row "
                               f"{seen.start} of its write with digest {seen.digest}, got {rows} rows at row {start} "
                               f"with digest {digest}: a retry sends the same rows, other rows take a new id")
        return seen

    def add(self, write_id: str, piece: int, *, first: int, rows: int, start: int, digest: str | None) -> None:
        """Journal a piece before its rows are stored (see the module)."""
        key, value = (str(write_id), int(piece)), Piece(int(first), int(rows), int(start), digest)
        if self._path is not None:
            fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, _line(key, value).encode())
            finally:
                os.close(fd)
            self._lines += 1
        self._pieces.pop(key, None)
        self._pieces[key] = value
        while len(self._pieces) > self._remember:
            self._pieces.popitem(last=False)
        if self._lines > 2 * self._remember:  # the file about as long as what is remembered
            replace_file(self._path, "".join(_line(k, p) for k, p in self._pieces.items()))
            self._lines = len(self._pieces)

    def forget(self, key: tuple[str, int]) -> None:
        """Drop a piece whose rows were refused after its line was written (its line is passed over on
        reopening: the next piece's starts at the same place)."""
        self._pieces.pop((str(key[0]), int(key[1])), None)

    def clear(self) -> None:
        """A restore replaced the rows whole: no earlier write is answered from them."""
        self._pieces.clear()
        if self._path is not None:
            replace_file(self._path, "")
            self._lines = 0

    def __len__(self) -> int:
        return len(self._pieces)


def _line(key: tuple[str, int], p: Piece) -> str:
    return json.dumps([key[0], key[1], p.first, p.rows, p.start, p.digest], separators=(",", ":")) + "\n"


def _read(path: Path) -> list[tuple[tuple[str, int], Piece]]:
    """The journal's lines in order; a torn or damaged line (a crash mid-append) is skipped."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            write_id, piece, first, rows, start, digest = json.loads(line)
            out.append(((str(write_id), int(piece)), Piece(int(first), int(rows), int(start),
                                                           None if digest is None else str(digest))))
        except (ValueError, TypeError):
            continue
    return out


def _chain(lines: list[tuple[tuple[str, int], Piece]], written: int) -> list[tuple[tuple[str, int], Piece]]:
    """The lines whose rows count, oldest first (see the module).

    >>> p = lambda first, rows: Piece(first, rows, 0, None)
    >>> [k for k, _ in _chain([(("a", 0), p(0, 2)), (("f", 0), p(2, 5)), (("b", 0), p(2, 1))], written=3)]
    [('a', 0), ('b', 0)]
    >>> [k for k, _ in _chain([(("a", 0), p(0, 2)), (("b", 0), p(2, 2))], written=3)]  # b did not count
    [('a', 0)]
    """
    kept, limit = [], written
    for key, piece in reversed(lines):
        if piece.first + piece.rows <= limit:
            kept.append((key, piece))
            limit = piece.first
    return kept[::-1]
