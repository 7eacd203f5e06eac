"""Section ``call_cost``: what Ray itself costs the callee per call, for the two shapes of the coordinator's plan
call (keyword arguments answered by an object; one tuple answered by its text), the same answer text in both."""
from __future__ import annotations

import time
from typing import Any

import ray

from bench.harness import add_run, med_ranges, medians_text


@ray.remote(num_cpus=0)
class CallShapes:
    """Stand-in for the coordinator's plan call, to measure what Ray itself costs the callee per call."""

    def cpu(self) -> float:
        return time.process_time()

    def keywords(self, batch_size, k, *, stream=None, served=None, call=None) -> Any:
        return _Answer(self._text)

    def packed(self, request: tuple) -> str:
        return self._text

    def set_text(self, text: str) -> None:
        self._text = text


class _Answer:
    def __init__(self, text: str):
        self.text = text

    def __reduce__(self):  # as a GroupPlan travels: pickled as its text
        return _Answer, (self.text,)


def bench_call_cost(cfg: dict, results: dict) -> None:
    """The callee's CPU per call (its process time) for the plan call's two shapes, same answer text: keyword
    arguments answered by an object, and one tuple answered by the text (``Coordinator.plan_packed``)."""
    import uuid

    actor = CallShapes.remote()
    ray.get(actor.set_text.remote("x" * 3800))  # a group of 12 plans' JSON at B=4096 is about this long
    calls = {"keywords_object": lambda i: actor.keywords.remote(4096, 12, stream="s" * 32, served=i,
                                                                call=uuid.uuid4().hex),
             "tuple_text": lambda i: actor.packed.remote((4096, 12, "s" * 32, i, uuid.uuid4().hex, 0.0))}
    n = max(200, 20 * cfg["min_iters"]) if cfg["min_time"] < 0.5 else 2000
    row: dict[str, list] = {}
    for _ in range(cfg["repeats"]):
        for name, fn in calls.items():
            c0, refs = ray.get(actor.cpu.remote()), []
            for i in range(n):
                refs.append(fn(i))
                if len(refs) >= 4:  # a few in flight, as handles keep them
                    ray.get(refs.pop(0))
            ray.get(refs)
            add_run(row, {f"{name}_callee_ms": (ray.get(actor.cpu.remote()) - c0) / n * 1e3})
    results["call_cost"] = med_ranges(row)
    print("  " + medians_text(results["call_cost"], ".3f"), flush=True)
    ray.kill(actor)
