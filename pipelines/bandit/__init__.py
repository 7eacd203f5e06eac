"""The main job's pieces (``pipelines/train_bandit.py``): behaviour policies, data, learners and results.

``python pipelines/train_bandit.py`` (and ``ray job submit --working-dir . -- python pipelines/train_bandit.py``)
puts ``pipelines/`` first on the driver's ``sys.path``, so the driver imports this package as ``bandit``. Ray's
workers need not have that path (under ``--working-dir`` they get the working directory, not the script's), so
the package is registered with Ray's cloudpickle to travel by value, as the job's definitions did when they all
lived in ``__main__``: its actor classes, remote function and preprocess fn reach any worker on any node without
an import.
"""
import sys

from ray import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # covers the submodules too
