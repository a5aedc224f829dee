"""hpdl on a Ray cluster: Horovod's ``horovod.ray.RayExecutor``, and Ray Train's TorchTrainer.

``RayExecutor`` starts one Ray actor per rank in a placement group, gives each torchrun's
variables for its place (ranks grouped by Ray node), and runs functions on all of them;
``hvd.init()`` inside such a function joins the others over gloo (nccl with GPUs). Under Ray
Train's ``TorchTrainer`` an unchanged hpdl script runs as ``train_loop_per_worker``:
``hvd.init()`` takes the process group Ray Train set up. docs/ray.md says more.

Needs Ray: ``pip install "hpdl[ray]"``.
"""

from hpdl.ray.errors import PlacementError, RayMissingError, WorkerFailedError
from hpdl.ray.executor import RayExecutor, RaySettings

__all__ = ["RayExecutor", "RaySettings", "PlacementError", "RayMissingError", "WorkerFailedError"]
