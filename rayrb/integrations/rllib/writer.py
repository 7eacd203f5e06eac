"""Env runners write their episodes straight into a rayrb buffer: an RLlib callback.

``config.callbacks(EnvRunnerWriter)`` with ``replay_buffer_config={"type": ..., "buffer": rb.client()}``:
at the end of each ``EnvRunner.sample()`` the runner turns its episode chunks into rows and extends the
buffer through the client the config carries, then empties the list it returns, so the rows go runner ->
shards and the driver's ``add`` gets nothing to write twice. The runner's metrics (returns, steps
sampled) are computed before this callback and are kept. Evaluation runners write nothing. Where the config
asks for sequences (``batch_length_T >= 2``), each episode's rows wait until it ends (or
``sequence_hold_steps`` are held) and go in a write of their own, as the buffer's ``add`` writes them; a write
that fails is written again at the runner's next sample (``PendingRows``).

This module imports RLlib; ``rayrb.integrations.rllib`` imports it only when ``EnvRunnerWriter`` is asked for.
"""
from __future__ import annotations

from typing import Any

from ray.rllib.callbacks.callbacks import RLlibCallback

from rayrb.errors import InvalidArgumentError
from rayrb.integrations.rllib.pending import PendingRows, check_write_settings, episode_writes, sequence_length
from rayrb.integrations.rllib.transitions import SEQUENCE_HOLD_STEPS, EpisodeRows, row_n_step

ROWS_WRITTEN = "rayrb_rows_written"


class EnvRunnerWriter(RLlibCallback):
    """Writes each env runner's sampled episodes into the rayrb buffer named by ``replay_buffer_config["buffer"]``."""

    def __init__(self):
        super().__init__()
        self._client: Any = None
        self._rows: EpisodeRows | None = None
        self._pending: PendingRows | None = None

    def on_sample_end(self, *, env_runner: Any = None, metrics_logger: Any = None, samples: Any = None,
                      **kwargs: Any) -> None:
        if env_runner is None or env_runner.config.in_evaluation or not isinstance(samples, list):
            return
        if self._client is None:
            client = (env_runner.config.replay_buffer_config or {}).get("buffer")
            if client is None or not hasattr(client, "extend"):
                raise InvalidArgumentError(
                    "expected replay_buffer_config['buffer'] to be a rayrb buffer client for env "
                    f"runners to write into, got {client!r}")
            config = env_runner.config.replay_buffer_config
            hold_steps = config.get("sequence_hold_steps", SEQUENCE_HOLD_STEPS)
            check_write_settings(sequence_hold_steps=hold_steps)
            sequences = sequence_length(config.get("batch_length_T")) is not None
            self._client = client
            self._rows, self._pending = episode_writes(row_n_step(client.spec), sequences, hold_steps)
        rows = self._rows.add(samples)
        samples.clear()  # taken: the driver's buffer must not write them again
        self._pending.add(rows)
        self._pending.write(self._client.extend, self._client.spec)
        if metrics_logger is not None:
            metrics_logger.log_value(ROWS_WRITTEN, 0 if rows is None else len(rows["t"]), reduce="sum")
