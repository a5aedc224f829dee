"""hpdl: Horovod-compatible data-parallel training for PyTorch, in pure Python.

Layers (imports point downwards): launch, spark, sr, bench, profile -> torch -> engine -> comm.
Import ``hpdl.torch`` (as ``hvd``) for the training API.
"""

from hpdl import rank_exit as _rank_exit

__version__ = "0.1.0"
__all__ = ["__version__"]

_rank_exit.install()  # under `hpdl run`: a rank's own exit is noted for its parent (rank_exit.py)
