"""hpdl on Apache Spark: ``hpdl.spark.run(fn, ...)`` runs ``fn`` on ranks inside a barrier stage.

As Horovod's ``horovod.spark.run``, with Spark's barrier mode: Spark starts every rank's task
together (or none), each rank runs in a child process of its task, and the ranks meet over
gloo (nccl with GPUs). See docs/spark.md. pyspark is imported when ``run`` is called, so this
package imports without it (``pip install "hpdl[spark]"`` brings it).
"""

from hpdl.spark.errors import RankFailedError, SlotsUnavailableError, SparkRunError
from hpdl.spark.runner import run

__all__ = ["RankFailedError", "SlotsUnavailableError", "SparkRunError", "run"]
