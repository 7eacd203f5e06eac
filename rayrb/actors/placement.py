"""Where actors go: offline shards beside their chunks, online shards beside their writers (``online_nodes``),
learner slices beside their learners."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rayrb.errors import InvalidArgumentError, InvalidArgumentTypeError
from rayrb.io.chunks import ChunkDataset


def shard_placement(dataset: ChunkDataset, start: int, stop: int, opts: dict) -> dict:
    """Actor options that prefer the node holding most of rows ``[start, stop)`` (a soft hint)."""
    if "scheduling_strategy" in opts:
        return opts
    rows_by_node: dict[str, int] = {}
    for c, a in zip(dataset.chunks, dataset.offsets[:-1]):
        overlap = min(stop, a + c.rows) - max(start, a)
        if c.node and overlap > 0:
            rows_by_node[c.node] = rows_by_node.get(c.node, 0) + int(overlap)
    if not rows_by_node:
        return opts
    node = max(rows_by_node, key=rows_by_node.get)
    if node not in _alive_nodes():
        return opts
    return on_node(opts, node)


def _alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def online_nodes_option(nodes: Sequence[str | None] | None, num_online_shards: int,
                        actor_options: dict) -> list[str | None] | None:
    """Check ``online_nodes``: one live node id (or None) per online shard, and no scheduling strategy besides."""
    if nodes is None:
        return None
    if isinstance(nodes, str) or not isinstance(nodes, Sequence):
        raise InvalidArgumentTypeError(f"expected online_nodes as a list of node ids (or None), one per online shard, "
                                       f"got {type(nodes).__name__}")
    nodes = list(nodes)
    if len(nodes) != num_online_shards:
        raise InvalidArgumentError(f"expected one entry of online_nodes per online shard ({num_online_shards}), "
                                   f"got {len(nodes)}: {nodes!r}")
    bad = [n for n in nodes if n is not None and not isinstance(n, str)]
    if bad:
        raise InvalidArgumentTypeError(f"expected node ids (str) or None in online_nodes, got {bad!r}")
    if "scheduling_strategy" in actor_options and any(n is not None for n in nodes):
        raise InvalidArgumentError(
            "online_nodes and actor_options['scheduling_strategy'] both place the online shards: "
            "give one of them")
    if all(n is None for n in nodes):  # places nothing: Ray need not have started yet
        return nodes
    alive = _alive_nodes()
    unknown = sorted({n for n in nodes if n is not None and n not in alive})
    if unknown:
        raise InvalidArgumentError(f"online_nodes names nodes that are not alive in this cluster: {unknown}; "
                                   f"alive: {sorted(alive)}")
    return nodes


# Ray places an actor that asks for no resources at all on a random node, whatever its soft node affinity
# (ray#25360 kept that for soft hints; measured here: 4 of 6 such actors missed their node, 0 of 6 with this).
HINTED_CPUS = 0.0001


def on_node(opts: dict, node: str | None) -> dict:
    """``opts`` preferring ``node`` (a soft hint: a shard restarted after its node is lost runs elsewhere).

    An actor that asks for nothing asks for ``HINTED_CPUS``, so that Ray honours the hint.
    """
    if node is None:
        return opts
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    out = {**opts, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)}
    if not out.get("num_cpus") and not out.get("num_gpus") and not out.get("resources"):
        out["num_cpus"] = HINTED_CPUS
    return out


def actor_nodes(actors: list) -> list[str | None]:
    """The node each actor runs on (None where Ray does not say)."""
    from ray.util.state import list_actors

    want = {a._actor_id.hex(): i for i, a in enumerate(actors)}
    nodes: list[str | None] = [None] * len(actors)
    try:
        for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000):
            if a.actor_id in want:
                nodes[want[a.actor_id]] = a.node_id
    except Exception:  # the state API needs the dashboard; placement is only a hint
        pass
    return nodes


GPU_SHARE = 0.01  # of a GPU, per shard that holds its rows there: learners on that GPU keep the rest


def group_options(actor_options: dict[str, Any], transport: str, num_actors: int,
                  storage_device: str = "cpu") -> tuple[dict, dict, dict, str | None]:
    """``(class options, shard options, coordinator options, device)`` under ``transport`` and ``storage_device``.

    ``device`` is where shards put the tensors they send over Ray Direct Transport
    (None: where their rows are).
    """
    opts = {"num_cpus": 0, **actor_options}
    coord_opts = {k: v for k, v in opts.items() if k != "num_gpus"}
    # Shards return tensors over RDT: a class-level option, not an .options() one.
    rdt = transport != "object_store" or storage_device != "cpu"
    cls_opts = {"enable_tensor_transport": True} if rdt else {"num_cpus": 0}
    device: str | None = "cpu" if storage_device == "cpu" else None
    if transport == "nccl":  # NCCL needs one GPU per rank: a whole GPU per shard
        device = "cuda" if storage_device == "cpu" else None
        opts.setdefault("num_gpus", 1.0)
    elif storage_device != "cpu":
        opts.setdefault("num_gpus", GPU_SHARE)
    return cls_opts, opts, coord_opts, device


def replica_groups(shards: int, replicas: int, opts: dict, timeout: float = 60.0) -> list:
    """One placement group per online shard, its ``replicas`` copies each on another node (``STRICT_SPREAD``: Ray
    moves a lost copy to a node that holds no other copy of it). Raises, having removed what it made, when the
    cluster has too few nodes with room."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    alive = len(_alive_nodes())
    if alive < replicas:
        raise InvalidArgumentError(
            f"expected at least online_replicas={replicas} alive nodes (each copy of an online shard "
            f"on another node), got {alive}")
    bundle = {"CPU": max(float(opts.get("num_cpus") or 0), HINTED_CPUS)}
    if opts.get("num_gpus"):
        bundle["GPU"] = float(opts["num_gpus"])
    bundle.update(opts.get("resources") or {})
    groups = [placement_group([dict(bundle) for _ in range(replicas)], strategy="STRICT_SPREAD")
              for _ in range(shards)]
    ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout)
    if len(ready) < len(groups):
        for g in groups:
            remove_placement_group(g)
        raise InvalidArgumentError(
            f"expected room for {replicas} copies of each of {shards} online shards on {replicas} "
            f"different nodes ({bundle} each), got none within {timeout:.0f} s on {alive} alive "
            f"nodes: add nodes, or lower online_replicas")
    return groups


def copies_node(bundle_nodes: Sequence[Sequence[str | None]]) -> str | None:
    """The node holding copies of the most online shards, given each shard's copies' nodes (primary first);
    ties go to the node of the earliest primary, then of the earliest copy. A coordinator there has a copy of
    those shards beside it, which publishes their counts in its counts map (``rayrb.actors.publishing``), so
    their writers need not tell it.

    >>> copies_node([["a", "b"], ["c", "a"]]), copies_node([["a", "b"], ["b", "c"]]), copies_node([])
    ('a', 'b', None)
    """
    held: dict[str, tuple[int, int, int]] = {}  # node -> (shards, a primary's rank, a copy's rank), first seen
    for shard, nodes in enumerate(bundle_nodes):
        for copy, node in enumerate(dict.fromkeys(nodes)):
            if node is None:
                continue
            n, primary, first = held.get(node, (0, len(bundle_nodes), shard))
            held[node] = (n + 1, min(primary, shard) if copy == 0 else primary, first)
    return min(held, key=lambda k: (-held[k][0], held[k][1], held[k][2])) if held else None


def beside_copies(coord_opts: dict, groups: Sequence[Any]) -> dict:
    """The coordinator's options preferring the node with copies of the most online shards (``copies_node``),
    given their placement groups (none: as they are), unless the options place it already."""
    if not groups or "scheduling_strategy" in coord_opts:
        return coord_opts
    return on_node(coord_opts, copies_node(group_nodes(groups)))


def group_nodes(groups: Sequence[Any]) -> list[list[str | None]]:
    """Each placement group's bundles' nodes, in bundle order (groups ready)."""
    from ray.util.placement_group import placement_group_table

    out = []
    for g in groups:
        where = placement_group_table(g).get("bundles_to_node_id") or {}
        out.append([where.get(i) for i in range(len(where))])
    return out


def in_group(opts: dict, group: Any, index: int) -> dict:
    """``opts`` placing the actor in bundle ``index`` of ``group``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    out = {**opts, "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)}
    if not out.get("num_cpus"):
        out["num_cpus"] = HINTED_CPUS
    return out
