"""The coordinator's steering calls (``Steering``, mixed into ``rayrb.actors.coordinator.Coordinator``): the
offline fraction read and set, TorchRL's ``anneal`` and the schedule's step. Each change of settings bumps the
version and forgets the draws ahead, which cannot be given back past it, and is saved."""
from __future__ import annotations

from typing import Any

from rayrb.actors.restoring import saved


class Steering:
    """Calls that change the offline fraction; they use the coordinator's ``_planner``, ``_changed`` and
    ``_sizes``."""

    def offline_fraction(self) -> float:
        return self._planner.fraction(self._sizes())

    @saved
    def set_offline_fraction(self, value: Any) -> float:
        self._changed(settings=True)
        self._planner.set_fraction(value)
        return self.offline_fraction()

    @saved
    def anneal(self, step: int, total_steps: int) -> float:
        """TorchRL's ``anneal``: linear from the base fraction to 0 over ``total_steps``."""
        self._changed(settings=True)
        return self._planner.anneal(step, total_steps, self._sizes())

    @saved
    def set_step(self, step: int) -> None:
        self._changed(settings=True)
        self._planner.set_step(step)

    def base_fraction(self) -> float:
        """The fraction ``anneal`` decays from."""
        return self._planner.base_fraction(self._sizes())

    @saved
    def set_base_fraction(self, value: float) -> float:
        self._changed(settings=True)
        self._planner.set_base_fraction(value)
        return self.base_fraction()
