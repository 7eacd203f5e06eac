"""Every error rayrb raises on purpose, under one base class.

Each also subclasses the builtin it stands for, so code written against the
builtins keeps working: ``except TimeoutError`` catches ``WriteTimeoutError``,
``except ValueError`` catches ``SchemaError`` and ``InvalidArgumentError``.
The few builtins rayrb raises as they are (``NotImplementedError`` in abstract
methods, ``StopIteration``, a module's ``AttributeError``) are listed, each with
its reason, in ``tests/test_errors.py``, which fails on any other.

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


class ImmutableDatasetError(ReadOnlyError, RuntimeError):
    """A write to a dataset served as TorchRL's (``OpenMLExperienceReplay``): the ``RuntimeError`` TorchRL's
    ``ImmutableDatasetWriter`` raises, in its words."""


class PreprocessError(RayrbError, RuntimeError):
    """A preprocess map that failed; nothing was left at its destination."""


class DatasetUnavailableError(RayrbError, RuntimeError):
    """A dataset that cannot be had here (not in the cache, and no network)."""


class UnknownDatasetError(RayrbError, ValueError, RuntimeError):
    """A dataset id that names no known dataset."""


class DatasetOptionError(RayrbError, TypeError, ValueError):
    """An option a dataset's loader does not take."""


class InvalidArgumentError(RayrbError, ValueError):
    """An argument or option whose value rayrb does not take: out of range, not a choice, or at odds with another."""


class InvalidArgumentTypeError(RayrbError, TypeError):
    """An argument or option of a type rayrb does not take."""


class RowIndexError(RayrbError, IndexError):
    """A row index, or a range of rows, outside those a shard or dataset holds."""


class MissingKeyError(RayrbError, KeyError):
    """A key that rows or a tensordict were expected to carry and do not."""


class DrawError(RayrbError, ValueError):
    """A batch that cannot be drawn as asked: too few rows (left in the epoch), or no weight or priority to draw."""


class SavedStateError(RayrbError, ValueError):
    """A saved state (a ``state_dict``, a checkpoint, a shard's files) that is damaged or does not fit this buffer."""


class InvalidStateError(RayrbError, RuntimeError):
    """A call that cannot be served as things stand: no online shards, no learners connected, a stale write plan."""


class ShapeMismatchError(RayrbError, RuntimeError):
    """Tensors meant to match row for row that do not: an action and its outcome, TD errors and their rows."""


class CallTimeoutError(RayrbError, TimeoutError):
    """A call to the buffer's actors that got no answer within ``timeout``."""


class DirectoryNotEmptyError(RayrbError, FileExistsError):
    """A directory a new dataset was to be written into that already holds files."""


class StreamError(RayrbError, ConnectionError):
    """A replica's stream of pieces from its primary broke, or carried what is not a frame from it."""


class FencedFrameError(RayrbError, RuntimeError):
    """A piece a replica refused: sent by its primary before the replica's last rebuild, arriving after it."""
