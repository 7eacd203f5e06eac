"""Dataset sources: the seven OpenML recipes and the id registry."""
from rayrb.io.datasets.openml import OPENML_DATASETS, DatasetUnavailableError, load_openml
from rayrb.io.datasets.registry import load_dataset, register_dataset

__all__ = ["OPENML_DATASETS", "DatasetUnavailableError", "load_openml", "load_dataset", "register_dataset"]
