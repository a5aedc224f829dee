"""What the driver asks the active SparkContext: its task slots, the busy ones, its own address."""

from __future__ import annotations

import socket
from typing import Optional, Tuple


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


def running_tasks(sc, group: Optional[str] = None) -> int:
    """The tasks running now: those of the job group ``group``, or of every job (None).

    Each holds a slot; a barrier stage's tasks run all together or not at all.
    """
    tracker = sc.statusTracker()
    if group is None:
        stages = tracker.getActiveStageIds()
    else:
        jobs = [tracker.getJobInfo(job) for job in tracker.getJobIdsForGroup(group)]
        stages = [stage for job in jobs if job is not None for stage in job.stageIds]
    running = 0
    for stage in stages:
        info = tracker.getStageInfo(stage)
        if info is not None:
            running += info.numActiveTasks
    return running


def driver_addresses(sc) -> Tuple[str, str]:
    """``(address to listen on, address the executors reach the driver at)``, as Spark's own RPC uses them."""
    conf = sc.getConf()
    advertised = conf.get("spark.driver.host", None) or socket.gethostname()
    return conf.get("spark.driver.bindAddress", None) or advertised, advertised
