"""Data layer: numpy dataset loaders and a fetch helper (no torch).

>>> from fl_server.data import load_dataset
>>> ds = load_dataset("digits", split="train")   # x float32 [1500, 1, 8, 8], y int64 [1500]
"""

from .datasets import DATASETS, ArrayDataset, load_dataset
from .errors import DataFileError, FetchError
from .fetch import fetch

__all__ = ["ArrayDataset", "DATASETS", "DataFileError", "FetchError", "fetch", "load_dataset"]
