"""hpdl: Horovod-compatible data-parallel training for PyTorch, in pure Python.

Layers (imports point downwards): launch, spark, sr, bench, profile -> torch -> engine -> comm.
Import ``hpdl.torch`` (as ``hvd``) for the training API.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
