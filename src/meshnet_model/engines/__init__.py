"""Compute engines behind ``StageRunner``: each owns a stage's weights, its
sessions' cache arrays and the per-layer forward pass (``base.Engine``).

* ``numpy`` — ``StageModel``, the default and the reference;
* ``torch`` — ``meshnet-node --engine torch``; PyTorch is imported only when
  one is built, never by importing this package.
"""
