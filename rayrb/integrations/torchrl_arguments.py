"""TorchRL's arguments to ``OpenMLExperienceReplay`` (``rayrb.integrations.openml_replay``), checked and turned
into a rayrb buffer's options: its sampler, writer and transforms as TorchRL's replay buffers take them, and the
rayrb options it takes besides. Imports torchrl, whose classes they are."""
from __future__ import annotations

import math
from typing import Any

from rayrb.core.validation import positive_int
from rayrb.errors import InvalidArgumentError, InvalidArgumentTypeError

# The buffer behind the dataset: every batch offline; its online side (rayrb's buffers have one) stays empty
OFFLINE_ONLY = {"online_capacity": 1, "offline_fraction": 1.0}
# TorchRL's ImmutableDatasetWriter's words, raised by every write
WRITING_ERR = "This dataset doesn't allow writing."
# Options that would give the buffer an online side: this is a dataset (compose it to have one)
ONLINE_OPTIONS = ("online_capacity", "online_storage", "offline_fraction", "num_online_shards", "online_sampler",
                  "online_nodes", "online_replicas", "rate_limiter", "offline_dataset", "num_offline_shards",
                  "sampler", "offline_sampler", "epoch_end", "drop_last", "alpha", "beta", "eps", "transform")


def sampler_options(sampler: Any) -> dict[str, Any]:
    """rayrb's buffer options for TorchRL's sampler object (``None``: TorchRL's default,
    ``SamplerWithoutReplacement()``). Only TorchRL's three plain samplers have a rayrb counterpart; any
    other sampler, or an option rayrb's samplers do not have, is refused, named."""
    from torchrl.data.replay_buffers import samplers as torchrl_samplers

    kind = type(sampler)
    if sampler is None:
        return {"sampler": "without_replacement", "epoch_end": "short"}
    if kind is torchrl_samplers.RandomSampler:
        return {"sampler": "uniform"}
    if kind is torchrl_samplers.SamplerWithoutReplacement:
        if not sampler.shuffle:  # rayrb's epochs are always shuffled
            raise InvalidArgumentError("expected SamplerWithoutReplacement(shuffle=True): rayrb's epochs visit "
                                       "the rows in a shuffled order; got shuffle=False")
        return {"sampler": "without_replacement", "epoch_end": "drop" if sampler.drop_last else "short"}
    if kind is torchrl_samplers.PrioritizedSampler:
        extra = {"reduction": (sampler.reduction, "max"),
                 "max_priority_within_buffer": (sampler._max_priority_within_buffer, False)}
        odd = {k: got for k, (got, want) in extra.items() if got != want}
        if odd:
            raise InvalidArgumentError(f"expected PrioritizedSampler with reduction='max' and "
                                       f"max_priority_within_buffer=False (rayrb's sum trees), got {odd}")
        return {"sampler": "prioritized", "alpha": sampler._alpha, "beta": sampler._beta, "eps": sampler._eps}
    raise InvalidArgumentTypeError(
        "expected sampler as None or one of TorchRL's RandomSampler, SamplerWithoutReplacement or "
        f"PrioritizedSampler (rayrb's samplers: uniform, without replacement, prioritized), got {kind.__name__}")


def check_writer(writer: Any) -> Any:
    """TorchRL's ``ImmutableDatasetWriter`` (``None`` makes one): the offline rows never change."""
    from torchrl.data.replay_buffers.writers import ImmutableDatasetWriter

    if writer is None:
        return ImmutableDatasetWriter()
    if type(writer) is not ImmutableDatasetWriter:
        raise InvalidArgumentTypeError(
            "expected writer as None or TorchRL's ImmutableDatasetWriter: an OpenML table is immutable in rayrb "
            f"(to write rows, compose it: OfflineToOnlineReplayBuffer(dataset, online_capacity=...)), got "
            f"{type(writer).__name__}")
    return writer


def one_transform(transform: Any, invert: bool = False) -> Any:
    """``transform`` as a TorchRL ``Transform`` in eval mode, as its replay buffers take one (a callable is
    wrapped); ``invert``: wrapped so that its inverse runs on sampled batches."""
    from torchrl.envs.transforms.transforms import Transform, _CallableTransform, _InvertTransform

    if not isinstance(transform, Transform):
        if not callable(transform):
            raise InvalidArgumentTypeError(f"expected transform as a TorchRL Transform or a callable, got "
                                           f"{type(transform).__name__}")
        transform = _CallableTransform(transform)
    transform.eval()
    return _InvertTransform(transform) if invert else transform


def make_transform(transform: Any) -> Any:
    """TorchRL's ``Compose`` of ``transform`` (``None``: an empty one), as its replay buffers make it."""
    from torchrl.envs.transforms.transforms import Compose

    if transform is None or isinstance(transform, Compose):
        composed = Compose() if transform is None else transform
        composed.eval()
        return composed
    return Compose(one_transform(transform))


def checked_options(given: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """The offline-only buffer's options, a user's ``given`` and those TorchRL's arguments set (``own``), checked
    now as the buffer checks them, although it starts later: a bad option is refused when the dataset is made, not
    at its first sample."""
    import inspect

    from rayrb.handle.owner import OfflineToOnlineReplayBuffer
    from rayrb.handle.settings import checked_settings

    refused = sorted(set(given) & set(ONLINE_OPTIONS))
    if refused:
        raise InvalidArgumentError(
            f"OpenMLExperienceReplay is an offline dataset: it takes none of {refused} (TorchRL's sampler= and "
            "transform= set its sampling; compose it with OfflineToOnlineReplayBuffer(dataset, online_capacity=...) "
            "for an online side)")
    takes = inspect.signature(OfflineToOnlineReplayBuffer.__init__).parameters
    unknown = sorted(k for k in given if k not in takes or takes[k].kind is not inspect.Parameter.KEYWORD_ONLY)
    if unknown:
        raise InvalidArgumentTypeError(f"OpenMLExperienceReplay got unexpected keyword arguments {unknown}")
    options = {**given, **own}
    settings = inspect.signature(checked_settings).parameters
    checked_settings(None, **OFFLINE_ONLY, **{k: v for k, v in options.items() if k in settings})
    return options


def chunk_rows_option(rows: int, chunksize: Any, num_chunks: Any) -> int | None:
    """Rows per preprocess task from TorchRL's ``chunksize`` or ``num_chunks`` (not both, as tensordict's map).

    >>> chunk_rows_option(1000, None, 3), chunk_rows_option(1000, 64, None), chunk_rows_option(10, None, None)
    (334, 64, None)
    """
    if chunksize is not None and num_chunks is not None:
        raise InvalidArgumentError(f"expected chunksize or num_chunks, not both; got chunksize={chunksize}, "
                                   f"num_chunks={num_chunks}")
    if num_chunks is not None:
        return math.ceil(rows / positive_int("num_chunks", num_chunks))
    return None if chunksize is None else positive_int("chunksize", chunksize)


def default_sampler() -> Any:
    from torchrl.data.replay_buffers import SamplerWithoutReplacement

    return SamplerWithoutReplacement()
