"""What a TorchRL dataset refuses, as TorchRL's datasets refuse it: writes (its ``ImmutableDatasetWriter``'s
words), another storage or sampler once made, and storage hooks that would have nothing to act on. The base of
``rayrb.OpenMLExperienceReplay`` (``rayrb.integrations.openml_replay``), whose rows are immutable chunks that
rayrb's shards map."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rayrb.errors import ImmutableDatasetError, InvalidArgumentError
from rayrb.integrations.torchrl_arguments import WRITING_ERR, check_writer


class ImmutableDataset:
    """TorchRL's immutable-dataset surface; a subclass holds ``dataset_id`` and ``_writer``."""

    dataset_id: str
    write_count = property(lambda self: 0, doc="Rows written: none (an immutable dataset), as TorchRL's.")

    def set_sampler(self, sampler: Any) -> None:
        raise InvalidArgumentError(f"set_sampler: expected the sampler at construction (OpenMLExperienceReplay"
                                   f"({self.dataset_id!r}, batch_size, sampler=...)), got {type(sampler).__name__} "
                                   "after: rayrb's shards were started with their sampler")

    def set_storage(self, storage: Any, collate_fn: Callable | None = None) -> None:
        raise ImmutableDatasetError(f"set_storage: the storage of an OpenML dataset is its prepared table; got "
                                    f"{type(storage).__name__}")

    def set_writer(self, writer: Any) -> None:
        check_writer(writer)  # TorchRL's ImmutableDatasetWriter, or refused, named
        self._writer = writer

    def add(self, data: Any) -> int:
        raise ImmutableDatasetError(WRITING_ERR)

    def extend(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        raise ImmutableDatasetError(WRITING_ERR)

    def empty(self, empty_write_count: bool = True) -> None:
        raise ImmutableDatasetError(WRITING_ERR)

    def register_save_hook(self, hook: Callable) -> None:
        raise InvalidArgumentError(
            "a storage save hook has nothing to act on here: dumps() saves the sampling state and priorities, not "
            "the table's rows (immutable chunks, recorded by their content hash and mapped again on loads); "
            f"to change the rows, preprocess(fn, dest=...) them; got {hook!r}")

    def register_load_hook(self, hook: Callable) -> None:
        raise InvalidArgumentError(
            "a storage load hook has nothing to act on here: loads() restores the sampling state and priorities, "
            "and the table's rows are mapped from their chunks as they are; to change the rows, "
            f"preprocess(fn, dest=...) them; got {hook!r}")
