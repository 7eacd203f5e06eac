"""Every error rayrb raises on purpose, under one base class.

Each also subclasses the builtin it stands for, so code written against the
builtins keeps working: ``except TimeoutError`` catches ``WriteTimeoutError``,
``except ValueError`` catches ``SchemaError``.

>>> issubclass(WriteTimeoutError, (RayrbError, TimeoutError)), issubclass(SchemaError, ValueError)
(True, True)
>>> h = HeldBack("sample", "min size not reached")
>>> isinstance(h, RayrbError), h.call, str(h)
(True, 'sample', 'min size not reached')
"""
from __future__ import annotations


class RayrbError(Exception):
    """The base of every error rayrb raises on purpose."""


class BufferUnavailableError(RayrbError, RuntimeError):
    """The buffer was shut down, or an actor of it died and could not be restarted."""


class RowsLostError(BufferUnavailableError):
    """An online shard lost rows a batch was planned over: its node went with its files, and no copy held them."""


class WriteTimeoutError(RayrbError, TimeoutError):
    """An ``extend`` that timed out; ``write_id`` names it, so that retrying with it applies the rows once."""

    def __init__(self, message: str, write_id: str):
        super().__init__(message)
        self.write_id = write_id

    def __reduce__(self):
        return type(self), (str(self), self.write_id)


class WriteIdError(RayrbError, ValueError):
    """A ``write_id`` used before for other rows: a retry sends the same rows, other rows take a new id."""


class HeldBackTimeout(RayrbError, TimeoutError):
    """The rate limiter held a call back for longer than ``timeout``: nothing was drawn or written."""


class HeldBack(RayrbError):
    """The rate limiter holds a call back: nothing was drawn or written; the caller waits and asks again.

    Raised inside the planner and returned (not raised) across the actor boundary,
    where it is an answer, not a failure. ``call`` is ``"sample"`` or ``"insert"``.
    """

    def __init__(self, call: str, reason: str):
        super().__init__(reason)
        self.call, self.reason = call, reason

    def __reduce__(self):
        return type(self), (self.call, self.reason)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HeldBack) and (self.call, self.reason) == (other.call, other.reason)

    def __hash__(self) -> int:
        return hash((self.call, self.reason))


class SchemaError(RayrbError, ValueError):
    """Rows whose keys, trailing shapes or dtypes differ from the buffer's row spec."""


class ChunkError(RayrbError, RuntimeError):
    """A chunk dataset on disk that is missing, damaged or not what its manifest says."""


class ReadOnlyError(RayrbError, PermissionError):
    """A write to the offline dataset, which is immutable."""


class PreprocessError(RayrbError, RuntimeError):
    """A preprocess map that failed; nothing was left at its destination."""


class DatasetUnavailableError(RayrbError, RuntimeError):
    """A dataset that cannot be had here (not in the cache, and no network)."""


class UnknownDatasetError(RayrbError, ValueError, RuntimeError):
    """A dataset id that names no known dataset."""


class DatasetOptionError(RayrbError, TypeError, ValueError):
    """An option a dataset's loader does not take."""
