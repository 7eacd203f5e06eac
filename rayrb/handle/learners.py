"""The handle's ways of sampling for learners: one global batch cut in slices, each read from the shards
and assembled near its learner (``sample_slices``, ``sample_async``), or handed to connected learner
actors over the route each shard-learner pair takes (``feed``).

The coordinator plans the batch; this handle submits the reads (and, for ``feed``,
the learners' calls that take them), so the rows go from the shards to each learner
once. An RDT route's collective group is created by the handle that connects the
learners, since only a group's creator may pass its refs on.
"""
from __future__ import annotations

import uuid
from typing import Any

from rayrb.core.plans import OFFLINE, ONLINE, reads_by_plan
from rayrb.core.validation import positive_int
from rayrb.errors import InvalidArgumentError, InvalidStateError


class LearnerPaths:
    """Mixed into ``BufferClient``: slices and feeding (see the module)."""

    _routes: Any = None  # rayrb.actors.transport.Routes to the learners connected here
    _learners: list = []

    def _plan_once(self, batch_size: int, slices: int = 1) -> Any:
        """One batch (cut in ``slices``) planned for reads submitted here; no stream to give back."""
        return self.rpc.call("plan", batch_size, 1, slices=slices, call=uuid.uuid4().hex)

    def sample_async(self, batch_size: int | None = None, return_info: bool = False):
        """An ObjectRef to the next batch as a flat dict of numpy arrays, without waiting for the rows.

        Args:
            batch_size: rows in the batch (default: the buffer's).
            return_info: the ref resolves to ``(rows, info)``.

        Returns:
            An ObjectRef; ``rb.to_tensordict(ray.get(ref))`` rebuilds what ``sample`` returns.
        """
        import ray

        (ref,) = self._slices(self.batch(batch_size), 1, return_info=return_info,
                              nodes=[ray.get_runtime_context().get_node_id()])
        return ref

    def sample_slices(self, num_slices: int, batch_size: int | None = None, *, return_info: bool = False,
                      learners: list | None = None, postprocess: Any = None, split_info: bool = False) -> list:
        """Sample one global batch and return it as ``num_slices`` ObjectRefs, one per learner.

        Each ref resolves to a flat dict (``rb.to_tensordict`` rebuilds it), so a learner
        receives its slice straight from the shards: pass ``refs[j]`` to learner ``j`` (RLlib's
        ``batch_refs`` shape). Slices are disjoint, their sizes differ by at most one, and the
        exact offline count holds for the global batch and, to within one row, for each slice.

        Args:
            num_slices: how many slices.
            batch_size: rows in the global batch (default: the buffer's).
            return_info: slices resolve to ``(rows, info)``.
            learners: actor handles, one per slice: each slice is assembled on its learner's node.
            postprocess: ``postprocess(rows)`` (``postprocess(rows, info)`` with info), run in that task.
            split_info: each slice is a pair of refs ``(rows, info)``.

        Returns:
            A list of ``num_slices`` ObjectRefs (or pairs of them).

        Raises:
            ValueError: ``learners`` does not have one actor per slice.
        """
        from rayrb.actors.placement import actor_nodes

        num_slices = positive_int("num_slices", num_slices)
        batch_size = self.batch(batch_size)
        nodes = None
        if learners is not None:
            if len(learners) != num_slices:
                raise InvalidArgumentError(f"expected {num_slices} learners, one per slice, got {len(learners)}")
            nodes = actor_nodes(learners)
        return self._slices(batch_size, num_slices, return_info=return_info, nodes=nodes, postprocess=postprocess,
                            split_info=split_info)

    def _slices(self, batch_size: int, num_slices: int, *, return_info: bool, nodes: list | None = None,
                postprocess: Any = None, split_info: bool = False) -> list:
        """Plan one batch in ``num_slices`` slices; per slice, its shard reads and a task that assembles them
        (on ``nodes[j]`` when given)."""
        group = self._plan_once(batch_size, num_slices)
        out = []
        for j, (plan, parts) in enumerate(zip(group.plans, reads_by_plan(group))):
            refs = [self.rpc.by_side[side][i].sample_many.remote(*args) for side, i, args in parts]
            task = _assemble_task(nodes[j] if nodes else None, num_returns=2 if split_info else 1)
            out.append(task.remote(plan, return_info or split_info, postprocess, *refs))
        return out

    def connect_learners(self, learners: list) -> dict[str, int]:
        """Set the learner actors that ``feed`` on this handle hands slices to.

        ``transport`` decides how rows travel: ``"object_store"``; ``"gloo"`` (CPU tensors);
        ``"nccl"`` (GPU tensors between different GPUs); ``"cuda_ipc"`` (GPU shards to learners that
        Ray gave the same GPU); ``"auto"``, per pair. The collective group is created in this
        process, which alone may then pass its refs: call ``feed`` on this handle.

        Args:
            learners: actor handles; for an RDT transport their classes must be declared
                ``@ray.remote(enable_tensor_transport=True)``.

        Returns:
            How many shard-learner pairs take each route, e.g. ``{"object_store": 4}``.

        Raises:
            ValueError: no learners, a class that cannot receive RDT refs (Ray would deadlock for 60 s),
                or an NCCL group in which two members share a GPU (refused before it is created).
        """
        from rayrb.actors.transport import connect_group

        learners = list(learners)
        if not learners:
            raise InvalidArgumentError("expected at least one learner actor handle, got none")
        m = len(self.rpc.by_side[OFFLINE])
        names = [f"{self._name}/off-{i}" for i in range(m)] + \
                [f"{self._name}/on-{i}" for i in range(len(self.rpc.by_side[ONLINE]))]
        self._routes = connect_group(self._transport, self.rpc.shards, learners, f"{self._name}-{self._transport}",
                                     previous=self._routes, shard_names=names, timeout=self.rpc.timeout or 60.0)
        self._learners = learners
        counts: dict[str, int] = {}
        for t in self._routes.route.values():
            counts[t] = counts.get(t, 0) + 1
        return counts

    def feed(self, method: str = "update", batch_size: int | None = None, *args: Any, wait: bool = True):
        """Sample one global batch and call ``learner_j.method(plan, *parts, *args)`` on each connected learner.

        The learner rebuilds its slice with ``rayrb.actors.transport.receive(plan, *parts)``; rows
        come straight from the shards (as GPU tensors over NCCL or CUDA IPC routes). Slices follow
        ``sample_slices``'s rules.

        Args:
            method: the learners' method to call.
            batch_size: rows in the global batch (default: the buffer's).
            *args: passed on to ``method`` after the parts.
            wait: wait for the learners' results (bounded by ``timeout``) or return their refs.

        Returns:
            The learners' results, or their refs.

        Raises:
            RuntimeError: no learners were connected to this handle.
        """
        if not self._learners:
            raise InvalidStateError("no learners connected to this handle: call connect_learners(learners) first")
        group = self._plan_once(self.batch(batch_size), len(self._learners))
        m = len(self.rpc.by_side[OFFLINE])
        refs = []
        for j, (learner, plan, parts) in enumerate(zip(self._learners, group.plans, reads_by_plan(group))):
            reads = []
            for side, i, (counts, seeds, epochs, written) in parts:
                shard = self.rpc.by_side[side][i]
                route = self._routes.route[(i + (m if side == ONLINE else 0), j)]
                if route != "object_store":
                    reads.append(shard.sample_many_tensors.options(tensor_transport=route).remote(
                        counts, seeds, epochs, device=self._read_device, written=written))
                else:
                    reads.append(shard.sample_many.remote(counts, seeds, epochs, written))
            refs.append(getattr(learner, method).remote(plan, *reads, *args))
        return self.rpc.get(refs) if wait else refs


_TASKS: dict[Any, Any] = {}


def _assemble_task(node_id: str | None, num_returns: int = 1):
    """The task that concatenates one slice's shard parts (on ``node_id``, softly, when given)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rayrb.core.plans import assemble_slice

    if None not in _TASKS:
        _TASKS[None] = ray.remote(num_cpus=0)(assemble_slice)
    opts: dict[str, Any] = {"num_returns": num_returns}
    if node_id is not None:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=True)
    return _TASKS[None].options(**opts)
