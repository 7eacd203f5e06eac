"""The sections of ``pipelines/benchmark.py``, one a module, over a shared harness.

``harness`` holds what the sections share (timing, summaries, the synthetic table, TorchRL's peers, the consumer
actor, memory and CPU probes); each other module is one section, named as ``--sections`` names it, with its own
actors; ``report`` derives the ratios and plots from the results.

What these modules define goes to Ray's workers pickled by value (actor classes, ``standardize`` handed to
``rayrb.preprocess``, the call-cost actor's answer class), as it did when all of it lived in the script's
``__main__``: a worker never imports ``bench``, and the answer class crosses back as before, at the same cost. A
worker could not import it everywhere: Ray puts the script's folder (``pipelines/``) on the workers' path only when
the job has no working directory; under ``ray job submit --working-dir .`` they get the checkout's root instead.
"""
from __future__ import annotations

import sys

from ray import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the package's submodules with it
