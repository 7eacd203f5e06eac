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

import torch

from rayrb.core.plans import OFFLINE, ONLINE, reads_by_plan
from rayrb.core.validation import positive_int
from rayrb.errors import InvalidArgumentError, InvalidStateError
from rayrb.handle.rpc import shard_id


class Learners:
    """A handle's slices and feeding (see the module; the arguments are documented on the handle's methods)."""

    def __init__(self, rpc: Any, output: Any, name: str, transport: str, read_device: str | None,
                 layout: Any = None):
        self.rpc, self.output, self.name, self.transport, self.read_device = rpc, output, name, transport, read_device
        self.shard_names = None if layout is None else [p.name for p in layout.shards]  # offline first
        self.routes: Any = None  # rayrb.actors.transport.Routes to the learners connected here
        self.learners: list[Any] = []

    def plan_once(self, batch_size: int, slices: int = 1) -> Any:
        """One batch (cut in ``slices``) planned for reads submitted here; no stream to give back."""
        return self.rpc.call("plan", batch_size, 1, slices=slices, call=uuid.uuid4().hex)

    def sample_async(self, batch_size: int | None, return_info: bool, node: str | None) -> Any:
        """One batch's ref, assembled on ``node``."""
        (ref,) = self._slices(self.output.size(batch_size), 1, return_info=return_info, nodes=[node])
        return ref

    def sample_slices(self, num_slices: int, batch_size: int | None, *, return_info: bool, learners: list | None,
                      postprocess: Any, split_info: bool) -> list:
        """One global batch in ``num_slices`` refs, each assembled on its learner's node when given."""
        from rayrb.actors.placement import actor_nodes

        num_slices = positive_int("num_slices", num_slices)
        batch_size = self.output.size(batch_size)
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
        if self.output.short and (not (return_info or split_info) or postprocess is not None):
            # short slices come padded: ``to_tensordict`` drops the padding by each row's info
            raise InvalidArgumentError(f"expected return_info=True and no postprocess with strict_length=False (a "
                                       f"batch's short slices are found by each row's info), got return_info="
                                       f"{return_info}, postprocess={postprocess!r}")
        group = self.plan_once(batch_size, num_slices)
        out = []
        for j, (plan, parts) in enumerate(zip(group.plans, reads_by_plan(group))):
            refs = [self.rpc.read(side, i, args) for side, i, args in parts]
            task = _assemble_task(nodes[j] if nodes else None, num_returns=2 if split_info else 1)
            out.append(task.remote(plan, return_info or split_info, postprocess, *refs))
        return out

    def connect(self, learners: list) -> dict[str, int]:
        """Make the routes to ``learners`` (the collective group is created in this process); the pairs per
        route."""
        from rayrb.actors.transport import connect_group

        learners = list(learners)
        if not learners:
            raise InvalidArgumentError("expected at least one learner actor handle, got none")
        names = self.shard_names or [f"{self.name}/{shard_id(side, i)}" for side in (OFFLINE, ONLINE)
                                     for i in range(len(self.rpc.by_side[side]))]
        self.routes = connect_group(self.transport, self.rpc.shards, learners, f"{self.name}-{self.transport}",
                                    previous=self.routes, shard_names=names, timeout=self.rpc.timeout or 60.0)
        self.learners = learners
        counts: dict[str, int] = {}
        for t in self.routes.route.values():
            counts[t] = counts.get(t, 0) + 1
        return counts

    def feed(self, method: str, batch_size: int | None, *args: Any, wait: bool = True):
        """Plan one global batch and call ``method`` on each connected learner with its slice's reads."""
        if not self.learners:
            raise InvalidStateError("no learners connected to this handle: call connect_learners(learners) first")
        if self.output.short:  # a learner's ``receive`` knows no slice length to drop short slices' padding by
            raise InvalidArgumentError("expected slices of slice_len steps (strict_length=True) to feed learners, got "
                                       "strict_length=False: use sample_slices(..., return_info=True) instead")
        group = self.plan_once(self.output.size(batch_size), len(self.learners))
        m = len(self.rpc.by_side[OFFLINE])
        refs = []
        for j, (learner, plan, parts) in enumerate(zip(self.learners, group.plans, reads_by_plan(group))):
            reads = [self.rpc.read(side, i, read, route=self.routes.route[(i + (m if side == ONLINE else 0), j)],
                                   device=self.read_device) for side, i, read in parts]
            refs.append(getattr(learner, method).remote(plan, *reads, *args))
        return self.rpc.get(refs) if wait else refs


def direct_reads(rpc: Any, storage_device: str, device: Any) -> dict[str, list] | None:
    """The shard handles by side, when batches can go from GPU shards to this process's GPU over CUDA IPC:
    ``device`` is CUDA, the shards hold their rows on a GPU, and Ray gave this actor that GPU. Else None."""
    if device is None or storage_device == "cpu" or torch.device(device).type != "cuda":
        return None
    import ray

    from rayrb.actors.transport import Place, choose

    try:
        mine = Place("consumer", ray.get_runtime_context().get_node_id(), tuple(str(g) for g in ray.get_gpu_ids()))
    except Exception:
        return None
    shard_places = rpc.get([s.place.remote() for s in rpc.shards])
    if not all(choose(Place(str(i), p["node"], tuple(p["gpus"])), mine) == "cuda_ipc"
               for i, p in enumerate(shard_places)):
        return None
    return rpc.by_side


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
