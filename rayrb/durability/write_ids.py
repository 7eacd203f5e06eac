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

Several processes append to one journal: the shard and the writers on its node that append to its files
themselves (``rayrb.durability.appends``), each under the shard's write lock. Each keeps a view of the file and
``sync`` s it before it answers or appends: the lines others appended since are read and chained as on reopening
(a line a process killed mid-append left without its end is closed by the next append, never glued to it), and
a file rewritten by another process (bounded on disk) is read again whole.

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

import numpy as np

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

    def __init__(self, directory: str | os.PathLike | None, written: int, remember: int = REMEMBER,
                 rewrite: bool = True):
        """The journal in ``directory`` at write count ``written``; ``rewrite``: the shard's own start, which
        rewrites the file without its torn lines (a writer's view, ``rewrite=False``, only reads it)."""
        self._path = None if directory is None else Path(directory) / FILE
        self._remember = int(remember)
        self._pieces: OrderedDict[tuple[str, int], Piece] = OrderedDict()
        self._lines = 0
        self._read_to: tuple[int, int] = (-1, 0)  # (inode, bytes) of the file this view has read
        self._open_line = False  # the file ends inside a line (a process killed mid-append)
        if self._path is not None:
            if rewrite:
                for key, piece in _chain(_read(self._path), int(written))[-self._remember:]:
                    self._pieces[key] = piece
                self._lines = len(self._pieces)
                replace_file(self._path, "".join(_line(k, p) for k, p in self._pieces.items()))  # torn lines gone
                self._read_to = _stat(self._path)
            else:
                self.sync(written)

    def sync(self, written: int) -> None:
        """Take the lines other processes appended (or the file whole, if one rewrote it) since this view last
        read it, chained at write count ``written`` (see the module). Called under the shard's write lock."""
        if self._path is None:
            return
        inode, size = _stat(self._path)
        seen_inode, seen = self._read_to
        if inode != seen_inode:  # rewritten (or made) by another process: read whole
            self._pieces.clear()
            self._lines, seen, self._open_line = 0, 0, False
        if size > seen:
            with open(self._path, "rb") as f:
                f.seek(seen)
                text = f.read(size - seen).decode(errors="replace")
            self._open_line = not text.endswith("\n")
            for line in text.splitlines():
                self._lines += 1
                parsed = _parse(line)
                if parsed is None:
                    continue
                key, piece = parsed
                while self._pieces:  # a line at or before the end of the last: the pieces it passes over failed
                    last = next(reversed(self._pieces.values()))
                    if last.first + last.rows <= piece.first:
                        break
                    self._pieces.popitem(last=True)
                self._pieces.pop(key, None)
                self._pieces[key] = piece
            while len(self._pieces) > self._remember:
                self._pieces.popitem(last=False)
        while self._pieces:  # lines whose rows the count never reached: their writer died first
            last = next(reversed(self._pieces.values()))
            if last.first + last.rows <= int(written):
                break
            self._pieces.popitem(last=True)
        self._read_to = (inode, max(size, seen) if inode == seen_inode else size)

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
            data = ("\n" if self._open_line else "") + _line(key, value)  # a torn line is closed, not joined
            fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, data.encode())
                st = os.fstat(fd)
            finally:
                os.close(fd)
            self._lines += 1
            self._open_line = False
            if self._read_to[0] == st.st_ino:
                self._read_to = (st.st_ino, st.st_size)
        self._pieces.pop(key, None)
        self._pieces[key] = value
        while len(self._pieces) > self._remember:
            self._pieces.popitem(last=False)
        if self._lines > 2 * self._remember:  # the file about as long as what is remembered
            replace_file(self._path, "".join(_line(k, p) for k, p in self._pieces.items()))
            self._lines = len(self._pieces)
            self._read_to = _stat(self._path)

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
            self._read_to, self._open_line = _stat(self._path), False

    def __len__(self) -> int:
        return len(self._pieces)

    def to_array(self) -> np.ndarray:
        """The pieces remembered, oldest first, as journal lines: what another copy of the shard takes
        (``adopt``) with its rows."""
        return np.array([_line(k, p).rstrip("\n") for k, p in self._pieces.items()], dtype=str)

    def adopt(self, lines: np.ndarray | None, written: int) -> None:
        """Take the pieces of another copy of this shard (``to_array``), whose rows this copy just took (a merge
        or a rebuild), so that a retry of a write that copy placed is answered here too; the journal is
        rewritten at write count ``written``. A piece both copies journalled keeps this copy's line."""
        self.sync(written)
        theirs = [] if lines is None else [p for p in map(_parse, np.asarray(lines).tolist()) if p is not None]
        kept = combined(list(self._pieces.items()), theirs, int(written))[-self._remember:]
        self._pieces = OrderedDict(kept)
        if self._path is not None:
            replace_file(self._path, "".join(_line(k, p) for k, p in kept))
            self._lines, self._read_to, self._open_line = len(kept), _stat(self._path), False


def _line(key: tuple[str, int], p: Piece) -> str:
    return json.dumps([key[0], key[1], p.first, p.rows, p.start, p.digest], separators=(",", ":")) + "\n"


def _read(path: Path) -> list[tuple[tuple[str, int], Piece]]:
    """The journal's lines in order; a torn or damaged line (a crash mid-append) is skipped."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return out
    return [p for p in map(_parse, text.splitlines()) if p is not None]


def _parse(line: str) -> tuple[tuple[str, int], Piece] | None:
    """A journal line, or None where it is torn or damaged."""
    try:
        write_id, piece, first, rows, start, digest = json.loads(line)
        return (str(write_id), int(piece)), Piece(int(first), int(rows), int(start),
                                                  None if digest is None else str(digest))
    except (ValueError, TypeError, OverflowError):  # OverflowError: a number JSON holds and an int does not
        return None


def _stat(path: Path) -> tuple[int, int]:
    """``(inode, size)`` of the journal, ``(-1, 0)`` where there is none yet."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return -1, 0
    return st.st_ino, st.st_size


def combined(mine: list[tuple[tuple[str, int], Piece]], theirs: list[tuple[tuple[str, int], Piece]],
             written: int) -> list[tuple[tuple[str, int], Piece]]:
    """Two copies' journals made one at write count ``written``: every piece by its place in the write stream,
    chained (``_chain``); where both hold a piece at one place (or under one key), this copy's wins, as its
    rows do in a merge of equal generations.

    >>> p = lambda first, rows: Piece(first, rows, 0, None)
    >>> [k for k, _ in combined([(("a", 0), p(0, 2))], [(("a", 0), p(0, 2)), (("b", 0), p(2, 2))], written=4)]
    [('a', 0), ('b', 0)]
    >>> [k for k, _ in combined([(("c", 0), p(2, 2))], [(("b", 0), p(2, 2))], written=4)]
    [('c', 0)]
    """
    mine_keys = {k for k, _ in mine}
    lines = [(k, p, 0) for k, p in theirs if k not in mine_keys] + [(k, p, 1) for k, p in mine]
    lines.sort(key=lambda line: (line[1].first, line[2]))
    return _chain([(k, p) for k, p, _ in lines], written)


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
