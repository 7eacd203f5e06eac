"""The coordinator's state in files on its node: two alternating state slots, the write journal and one file per
kept plan answer, each framed with a checksum and written safely (``rayrb.io.files``). No Ray here.
``docs/durability.md`` lists the formats."""
from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from rayrb.durability.storage import remove_directory
from rayrb.errors import SavedStateError
from rayrb.io.files import pwrite_all, replace_file

_MAGIC = b"RRBS"
_REPLY = b"RRBA"  # an answer's file (CoordinatorState.save_reply)
# The coordinator's saved state: JSON {"planner", "side_rng", "ahead", "version", "answers"}; "answers" lists the
# calls whose answers are kept, each in a file of its own (CoordinatorState.save_reply); a state saved before that
# holds the answers themselves, [call, request, answer] each, and is read too
# (docs/durability.md, "Files and formats"); 2: each answer's batches as positional lists
# (rayrb.core.plans.group_to_json), 1 had keyed objects. A version that changes what is saved bumps it.
STATE_SCHEMA = 2
_HEADER = struct.Struct("<4sQQQ")  # magic, sequence number, payload length, xxh3_64 of the payload


def _framed(magic: bytes, sequence: int, payload: bytes) -> bytes:
    """``payload`` behind the header its reader checks (``_unframed``)."""
    return _HEADER.pack(magic, sequence, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def _unframed(raw: bytes, magic: bytes) -> tuple[int, bytes] | None:
    """``(sequence, payload)`` of a ``_framed`` file, or None if it is short, torn, damaged or of another kind.

    >>> _unframed(_framed(b"RRBA", 3, b"{}"), b"RRBA"), _unframed(_framed(b"RRBA", 3, b"{}")[:-1], b"RRBA")
    ((3, b'{}'), None)
    """
    if len(raw) < _HEADER.size:
        return None
    kind, sequence, length, digest = _HEADER.unpack_from(raw)
    payload = raw[_HEADER.size:_HEADER.size + length]
    if kind != magic or len(payload) != length or xxhash.xxh3_64_intdigest(payload) != digest:
        return None
    return sequence, payload


class CoordinatorState:
    """The coordinator's sampling state and write journal, in files under one directory on its node.

    ``state.0`` and ``state.1`` hold what the coordinator cannot ask the shards for:
    the planner's state (RNG, step, schedule, epochs, rate limiter), the side views'
    RNG and the version. Saves (after every call that changes it) go to the two files
    in turn, each a header (sequence number, length, xxh3 of the payload) and the
    pickled state written in place: a save torn by a crash fails its check, and the
    other file, one save older, is loaded. (A rename per save cost 0.13-0.5 ms here;
    this costs about 5 us plus the pickling.) ``writes.log`` gets one line per identified write, appended before the
    shards are sent their pieces: ``[write_id, [[shard, start, stop, first], ...], digest, number]`` (the digest
    of its rows, so that a restarted coordinator still tells a retry from other rows under the same id; the line's
    number, which orders it against the mirror's copy of the journal).
    A restarted coordinator takes the write counts from the shards and remembers the
    journalled writes, so a retry of one is answered, and only the pieces the shards
    lack are sent (``rayrb.durability.writelog.WriteLog.resume``). A torn last line (a crash
    mid-append) is skipped.

    Examples:
        >>> import tempfile
        >>> s = CoordinatorState(tempfile.mkdtemp(), remember=2)
        >>> s.load() is None
        True
        >>> s.save({"version": 3}); s.save({"version": 4}); s.load()
        {'version': 4}
        >>> with open(s.directory / "state.0", "r+b") as f:  # the newest save, torn by a crash
        ...     _ = f.seek(30); _ = f.write(b"garbage")
        >>> s.load()  # the one before it
        {'version': 3}
        >>> for i in range(5):
        ...     s.journal(f"w{i}", [(0, 0, 10, 10 * i)])
        >>> [w for w, _, _ in s.writes()]  # the last ``remember``
        ['w3', 'w4']
    """

    def __init__(self, directory: str | os.PathLike, remember: int = 4096, mirror: Any = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remember = int(remember)
        # A copy of every file off this node (rayrb.durability.mirror), keyed by the directory's path: a
        # coordinator restarted on another node (or on an older copy of this directory) takes the newer of the two.
        self._mirror, self._key = mirror, str(self.directory) + "/"
        entries = self._entries()
        # the number of the next journal line: a line's number orders it against the mirror's copy of it
        self._number = entries[-1][3] + 1 if entries and entries[-1][3] is not None else len(entries)
        if mirror is not None:
            self._level()
        self._lines = sum(1 for _ in self._read_lines())
        self._sequence = 0

    def _level(self) -> None:
        """Make this directory and the mirror agree, each part by its own order: the state slots by their sequence
        number, the journal by its lines' numbers. The newer copy wins, whichever it is (an older directory,
        kept on a disk that came back, gives way to the mirror; an older mirror takes the directory's), and the
        answers the winning state may list go with it. A copy lost whole (a new node) is the oldest of all."""
        mirror, key = self._mirror, self._key
        local = {slot: _read(self._slot(slot)) for slot in (0, 1)}
        remote = {slot: mirror.get(key + self._slot(slot).name) for slot in (0, 1)}
        mine, theirs = _newest(local.values()), _newest(remote.values())
        if theirs > mine:
            for slot, raw in remote.items():
                if _unframed(raw or b"", _MAGIC) is not None:
                    replace_file(self._slot(slot), raw)
            self._copy_replies(down=True)
        elif mine > theirs:
            for slot, raw in local.items():
                found = _unframed(raw or b"", _MAGIC)
                if found is not None and found[0] > theirs:
                    mirror.put(key + self._slot(slot).name, raw)
            self._copy_replies(down=False)
        lines = mirror.keys(key + "writes/")
        theirs = int(lines[-1].rsplit("/", 1)[1]) if lines else -1
        entries = self._entries()
        mine = entries[-1][3] if entries and entries[-1][3] is not None else -1  # unnumbered (older): oldest
        if theirs > mine:
            replace_file(self._journal, b"".join(mirror.get(k) or b"" for k in lines))
        else:
            for write_id, pieces, digest, number in entries:
                if number is not None and number > theirs:
                    mirror.put(f"{key}writes/{number:012d}", _journal_line(write_id, pieces, digest, number).encode())
        self._number = max(mine, theirs) + 1

    def _copy_replies(self, down: bool) -> None:
        """The plan answers the other copy lacks, from the copy whose state won (``_level``)."""
        folder, prefix = self.directory / "replies", self._key + "replies/"
        here = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
        there = {k.rsplit("/", 1)[1] for k in self._mirror.keys(prefix)}
        folder.mkdir(exist_ok=True)
        for name in sorted(there - here if down else here - there):
            if down:
                replace_file(folder / name, self._mirror.get(prefix + name) or b"")
            else:
                self._mirror.put(prefix + name, (folder / name).read_bytes())

    def _slot(self, sequence: int) -> Path:
        return self.directory / f"state.{sequence % 2}"

    @property
    def _journal(self) -> Path:
        return self.directory / "writes.log"

    def save(self, state: dict[str, Any], encoded: dict[str, str] | None = None) -> None:
        """Write ``state`` (plain JSON data: dicts, lists, strings, numbers) under ``STATE_SCHEMA``; ``encoded``
        adds keys whose values are JSON text already (``load`` returns them decoded, as part of the state)."""
        text = json.dumps(state, separators=(",", ":"))
        if encoded:
            extra = ",".join(f"{json.dumps(key)}:{value}" for key, value in encoded.items())
            text = text[:-1] + ("," if state else "") + extra + "}"
        payload = f'{{"schema":{STATE_SCHEMA},"state":{text}}}'.encode()
        sequence = self._sequence + 1
        framed = _framed(_MAGIC, sequence, payload)
        fd = os.open(self._slot(sequence), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            pwrite_all(fd, memoryview(framed), 0)
        finally:
            os.close(fd)
        if self._mirror is not None:
            self._mirror.put(self._key + self._slot(sequence).name, framed)
        self._sequence = sequence

    def load(self) -> dict[str, Any] | None:
        """The newest state whose save completed, or None; a state of another schema is refused."""
        best: tuple[int, bytes] | None = None
        for slot in (0, 1):
            try:
                raw = self._slot(slot).read_bytes()
            except OSError:
                continue
            found = _unframed(raw, _MAGIC)
            if found is not None and (best is None or found[0] > best[0]):
                best = found
        if best is None:
            return None
        self._sequence = best[0]
        try:
            saved = json.loads(best[1])
        except ValueError:
            saved = None
        schema = saved.get("schema") if isinstance(saved, dict) else None
        if schema != STATE_SCHEMA:
            raise SavedStateError(
                f"coordinator state in {self.directory} has schema {schema!r}; this rayrb reads schema "
                f"{STATE_SCHEMA} only (docs/durability.md): start the buffer afresh or restore a "
                "checkpoint")
        return saved["state"]

    def _reply_path(self, call: str) -> Path:
        return self.directory / "replies" / f"{xxhash.xxh3_64_hexdigest(call.encode())}.json"

    def save_reply(self, call: str, text: str) -> None:
        """Keep one plan call's answer (``rayrb.durability.replies``) in a file of its own, written once: the state,
        saved after every call, lists the calls and not their answers (a group of 120 batches is ~25 KB)."""
        path = self._reply_path(call)
        path.parent.mkdir(exist_ok=True)
        framed = _framed(_REPLY, 0, text.encode())
        replace_file(path, framed)
        if self._mirror is not None:
            self._mirror.put(self._key + "replies/" + path.name, framed)

    def load_reply(self, call: str) -> str | None:
        """The answer ``save_reply`` kept for ``call``, or None if it is missing or damaged."""
        try:
            raw = self._reply_path(call).read_bytes()
        except OSError:
            return None
        found = _unframed(raw, _REPLY)
        return None if found is None else found[1].decode()

    def drop_reply(self, call: str) -> None:
        path = self._reply_path(call)
        path.unlink(missing_ok=True)
        if self._mirror is not None:
            self._mirror.delete(self._key + "replies/" + path.name)

    def journal(self, write_id: str, pieces: list[tuple[int, int, int, int]], digest: str | None = None) -> None:
        number = self._number
        line = _journal_line(write_id, [[int(x) for x in p] for p in pieces], digest, number)
        fd = os.open(self._journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        self._number += 1  # a line the mirror then misses was never sent: its number is not used again
        if self._mirror is not None:  # a line a key; the one that leaves what is remembered goes
            self._mirror.put(f"{self._key}writes/{number:012d}", line.encode())
            if number >= 2 * self._remember:
                self._mirror.delete(f"{self._key}writes/{number - 2 * self._remember:012d}")
        self._lines += 1
        if self._lines > 2 * self._remember:  # keep the journal about as long as what is remembered
            keep = self._entries()[-self._remember:]
            replace_file(self._journal, "".join(_journal_line(*entry) for entry in keep))
            self._lines = len(keep)

    def writes(self) -> list[tuple[str, list[list[int]], str | None]]:
        """The last ``remember`` journalled writes ``(write_id, pieces, digest of the rows or None)``, oldest
        first."""
        return [entry[:3] for entry in self._entries()[-self._remember:]]

    def _entries(self) -> list[tuple[str, list[list[int]], str | None, int | None]]:
        """Every journalled write ``(write_id, pieces, digest, line number)``, oldest first (None: a digest or a
        number a line written before them lacks)."""
        out = []
        for line in self._read_lines():
            try:
                entry = json.loads(line)
                write_id, pieces, *rest = entry if isinstance(entry, list) else ()
                number = int(rest[1]) if len(rest) > 1 else None
                if not (isinstance(write_id, str) and isinstance(pieces, list)
                        and all(isinstance(p, list) and len(p) == 4 and all(type(v) is int for v in p)
                                for p in pieces)):
                    continue  # valid JSON of another shape: damaged
            except (ValueError, TypeError, OverflowError):
                continue  # torn by a crash mid-append, or damaged
            out.append((write_id, pieces, rest[0] if rest else None, number))
        return out

    def _read_lines(self) -> Iterator[str]:
        try:
            with open(self._journal) as f:
                yield from f
        except FileNotFoundError:
            return

    def clear(self) -> None:
        """Start afresh (a new coordinator, not a restarted one)."""
        for p in (self._slot(0), self._slot(1), self._journal):
            p.unlink(missing_ok=True)
        shutil.rmtree(self.directory / "replies", ignore_errors=True)
        self._lines, self._sequence, self._number = 0, 0, 0
        if self._mirror is not None:
            self._mirror.delete(self._key, prefix=True)

    def remove(self) -> None:
        remove_directory(self.directory)
        if self._mirror is not None:
            self._mirror.delete(self._key, prefix=True)


def _journal_line(write_id: str, pieces: list[list[int]], digest: str | None, number: int | None = None) -> str:
    """``[write_id, pieces, digest, number]`` as one line; a line kept from before numbers (``[write_id, pieces,
    digest]``) or digests (``[write_id, pieces]``) is written back as it was."""
    if number is not None:
        return json.dumps([write_id, pieces, digest, int(number)]) + "\n"
    return json.dumps([write_id, pieces] if digest is None else [write_id, pieces, digest]) + "\n"


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _newest(raws: Any) -> int:
    """The largest sequence number among state slots' bytes whose save completed (0: none did).

    >>> _newest([_framed(_MAGIC, 4, b"{}"), _framed(_MAGIC, 5, b"{}")[:-1], None])
    4
    """
    found = [_unframed(raw, _MAGIC) for raw in raws if raw is not None]
    return max((f[0] for f in found if f is not None), default=0)
