"""The handle's settings, saved state and one-side views: what steers the stream rather than samples it.

Mixed into :class:`~rayrb.handle.client.BufferClient`; each of these calls gives back first what the
handle's ``sample()`` loop drew ahead (``GIVES_BACK_BEFORE`` there), so a new fraction, step or state applies
to the next batch.
"""
from __future__ import annotations

from typing import Any

from rayrb.core.plans import OFFLINE, ONLINE, assemble
from rayrb.core.schedules import Schedule, make_schedule
from rayrb.core.validation import fraction, non_negative_int, positive_int
from rayrb.handle.stream import report_served


class Steering:
    """Settings, sampling state and the side views of a handle (see the module)."""

    # TorchRL's sub-buffers ------------------------------------------------------
    @property
    def offline_buffer(self):
        """The offline side, buffer-like (``len``, ``sample``, ``state_dict``); see ``rayrb.handle.views``."""
        from rayrb.handle.views import SideView

        return SideView(self, OFFLINE)

    @property
    def online_buffer(self):
        """The online side, buffer-like (``len``, ``sample``, ``extend``, ``state_dict``)."""
        from rayrb.handle.views import SideView

        return SideView(self, ONLINE)

    def sample_side(self, side: str, batch_size: int | None, return_info: bool = False):
        """``batch_size`` rows of one side, uniformly with replacement, from a stream of the views' own."""
        plan, indices = self.rpc.get(self.rpc.coord.plan_side.remote(side, self.batch(batch_size)))
        refs = [self.rpc.by_side[p.side][p.shard].gather.remote(idx) for p, idx in zip(plan.parts, indices)]
        return self.finish(assemble(plan, self.rpc.get(refs), return_info), return_info)

    def load_side_states(self, side: str, states: list[dict]) -> None:
        """Give each shard of ``side`` its state (checked by every shard first), then take their counts."""
        self.rpc.get(self.rpc.get(self.rpc.coord.load_shard_states.remote(side, states)))
        self.rpc.get(self.rpc.coord.resync.remote())

    def side_states(self, side: str) -> list[dict]:
        """Each shard of ``side``'s state arrays, copied here."""
        return self.rpc.get(self.rpc.get(self.rpc.coord.shard_states.remote(side)))

    # settings -----------------------------------------------------------------
    def _get_offline_fraction(self) -> float:
        return float(self.rpc.get(self.rpc.coord.offline_fraction.remote()))

    def _set_offline_fraction(self, value: float | Schedule | str | dict) -> None:
        if isinstance(value, (int, float)):
            fraction("offline_fraction", value)
        self.rpc.get(self.rpc.coord.set_offline_fraction.remote(make_schedule(value)))

    offline_fraction = property(lambda self: self._get_offline_fraction(),
                                lambda self, value: self._set_offline_fraction(value),
                                doc="The fraction the next batch will use (after any schedule or annealing).")
    _offline_fraction = offline_fraction  # TorchRL's private name, which its trainer hooks read and assign

    def _set_base_fraction(self, value: float) -> None:
        self.rpc.get(self.rpc.coord.set_base_fraction.remote(fraction("base_offline_fraction", value)))

    _base_offline_fraction = property(lambda self: float(self.rpc.get(self.rpc.coord.base_fraction.remote())),
                                      lambda self, value: self._set_base_fraction(value),
                                      doc="The fraction ``anneal`` decays from (TorchRL's name).")

    def anneal(self, step: int, total_steps: int) -> None:
        """Decay ``offline_fraction`` linearly from its base value to 0 over ``total_steps`` (TorchRL's).

        Args:
            step: the current step.
            total_steps: the step at which the fraction reaches 0.
        """
        step, total_steps = non_negative_int("step", step), positive_int("total_steps", total_steps)
        self.rpc.get(self.rpc.coord.anneal.remote(step, total_steps))

    def set_step(self, step: int) -> None:
        """Set the step that schedules read (by default, the number of sample calls so far).

        Args:
            step: a non-negative integer.
        """
        self.rpc.get(self.rpc.coord.set_step.remote(non_negative_int("step", step)))

    def state_dict(self) -> dict[str, Any]:
        """The sampling state (step, schedule, RNG, epochs, rate limiter) that resumes the same stream.

        Batches drawn ahead and not handed over are left out.

        Returns:
            A dict of plain data, for ``load_state_dict``.
        """
        report_served(self.rpc)  # what iterators drew ahead is left out, what they handed over is not
        return self.rpc.get(self.rpc.coord.state_dict.remote())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rpc.get(self.rpc.coord.load_state_dict.remote(state))
