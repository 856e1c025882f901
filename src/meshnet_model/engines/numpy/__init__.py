"""The numpy engine (``StageModel``): the default, and the reference the torch
engine and the transformers comparisons are checked against."""

from .model import StageModel

__all__ = ["StageModel"]
