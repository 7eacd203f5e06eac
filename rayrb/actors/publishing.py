"""Where online shards publish their write counts: the coordinator's counts map on its node
(``rayrb.durability.published``), when a shard runs there too.

* The coordinator's side, ``Targets``: at its start (and after each restart, before it takes the shards' counts)
  it tells each online shard ``(node, path, index)``; a restarted shard asks for its own (``Targets.of``).
* A shard's side, ``Publisher``: it maps the map when the target is on its own node, and each append to the shard
  (by its actor, or by a writer on its node, which maps the map itself) writes the shard's two words after the
  count moved. A shard on another node publishes nothing: its writers tell the coordinator instead.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rayrb.durability.published import CountsMap

Target = tuple[str, "str | None", int]  # (node id, path of the counts map, the shard's index among online shards)


def node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class Targets:
    """The coordinator's side: online shards by actor name, told where to publish (none: they do not)."""

    def __init__(self, names: Sequence[str | None], path: Callable[[], str | None]):
        self._names, self._path = list(names), path

    def send(self, shards: Sequence[Any]) -> None:
        """Tell each shard its target (not waited for: Ray runs it before the coordinator's later calls)."""
        if self._names:
            for i, shard in enumerate(shards):
                shard.publish_to.remote((node(), self._path(), i))

    def of(self, name: str) -> Target | None:
        """The target of the shard named ``name``, or None where shards do not publish."""
        if name not in self._names:
            return None
        return node(), self._path(), self._names.index(name)


class Publisher:
    """A shard's side: its place in the counts map, once told (``to``), or asked for at a restart (``asked``: the
    answer is taken at the first append that finds it come, never waited for, since the coordinator may be
    waiting for this shard)."""

    def __init__(self, asked: Any = None):
        self._asked = asked
        self._counts: tuple[CountsMap, int] | None = None
        self.target: Target | None = None  # the last one told, on this node or not

    @property
    def publishing(self) -> bool:
        return self._counts is not None

    def to(self, target: Target | None) -> bool:
        """Publish to ``target`` from now on, when it is on this node; whether it is."""
        self._asked, self._counts, self.target = None, None, target
        if target is not None and target[1] is not None and target[0] == node():
            counts = CountsMap.open(target[1])
            if counts is not None and 0 <= int(target[2]) < counts.shards:
                self._counts = (counts, int(target[2]))
        return self.publishing

    def take_asked(self) -> bool:
        """The answer to the restart's ask, if it came: whether this shard took a target now."""
        asked = self._asked
        if asked is None:
            return False
        import ray

        if not ray.wait([asked], timeout=0)[0]:
            return False
        try:
            return self.to(ray.get(asked))
        except Exception:  # the coordinator died with it: its restart sends the target again
            self._asked = None
            return False

    def publish(self, written: int) -> None:
        if self._counts is not None:
            counts, index = self._counts
            counts.publish(index, written)
