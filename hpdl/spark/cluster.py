"""What the driver asks the active SparkContext: its task slots, the busy ones, its own address."""

from __future__ import annotations

import socket
from typing import Tuple


def task_slots(sc) -> int:
    """Every task slot of the cluster's executors now, busy or not (what a barrier stage may hold).

    Spark's own count, the one its barrier check compares a stage with (executor cores over
    ``spark.task.cpus``, and the GPUs and other resources a task asks for). It is internal to
    Spark's JVM side, so an older Spark without resource profiles is asked without one, and
    one that has neither answers with its default parallelism (its cores, in local and
    standalone modes).
    """
    jsc = sc._jsc.sc()
    try:
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # py4j: no such method in this Spark
        pass
    try:
        return int(jsc.maxNumConcurrentTasks())
    except Exception:  # py4j: no such method in this Spark
        return int(sc.defaultParallelism)


def busy_slots(sc) -> int:
    """The tasks other jobs are running now, each holding a slot."""
    tracker = sc.statusTracker()
    busy = 0
    for stage in tracker.getActiveStageIds():
        info = tracker.getStageInfo(stage)
        if info is not None:
            busy += info.numActiveTasks
    return busy


def driver_addresses(sc) -> Tuple[str, str]:
    """``(address to listen on, address the executors reach the driver at)``, as Spark's own RPC uses them."""
    conf = sc.getConf()
    advertised = conf.get("spark.driver.host", None) or socket.gethostname()
    return conf.get("spark.driver.bindAddress", None) or advertised, advertised
