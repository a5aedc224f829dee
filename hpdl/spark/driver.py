"""One ``hpdl.spark.run`` on the driver: wait for slots, run the barrier stage, watch it, collect.

The driver never waits without a bound and never leaves a rank running:

- it submits the stage only once the cluster has ``num_proc`` task slots (Spark refuses a
  barrier stage larger than the cluster, then retries that check for minutes on its own), and
  cancels it when its tasks have not all reached the driver within the start timeout (the
  stage waits for slots that other jobs hold);
- the first rank that fails makes it cancel the stage and tell every task to end its rank, then
  raise that rank's failure;
- Ctrl-C (pyspark turns it into cancelling every job, then KeyboardInterrupt) does the same.
"""

from __future__ import annotations

import functools
import itertools
import queue
import re
import secrets
import threading
import time
from typing import Any, Dict, List, Optional, TextIO

import cloudpickle

from hpdl.launch.rank_output import prefix_line
from hpdl.spark.cluster import driver_addresses, running_tasks, task_slots
from hpdl.spark.errors import RankFailedError, SlotsUnavailableError, SparkRunError
from hpdl.spark.service import EXITED, REGISTERED, STARTED, DriverService
from hpdl.spark.task import TaskSpec, describe_exit, exception_line, run_task

# How often the driver looks again at the cluster's slots while too few are there.
SLOT_POLL_S = 1.0
# After a rank failed or the run was cancelled: how long Spark may take to end the stage's
# other tasks (each kills its rank at once when told; Spark's own kill takes a few seconds).
CANCEL_GRACE_S = 30.0
# After the stage ended: how long the last output lines may take to arrive.
DRAIN_S = 10.0

_run_ids = itertools.count()


class RankOutput:
    """The driver's copy of every rank's output: each line prefixed with its rank."""

    def __init__(self, stdout: TextIO, stderr: TextIO, timestamp: bool) -> None:
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._timestamp = timestamp
        self._lock = threading.Lock()

    def write(self, rank: int, stream: str, line: bytes) -> None:
        text = line.decode("utf-8", "replace")
        if not text.endswith("\n"):
            text += "\n"  # a rank's last line without one, or a piece of a line too long for one frame
        with self._lock:
            target = self._streams[stream]
            target.write(prefix_line(rank, stream, text, self._timestamp))
            target.flush()


class SparkRun:
    """The driver's side of one run; :meth:`execute` returns every rank's result in rank order."""

    def __init__(self, sc, num_proc: int, start_timeout_s: float, payload: bytes, *, driver_settings: Dict[str, str],
                 user_env: Dict[str, str], interfaces: Dict[str, str], executable: Optional[str],
                 output: RankOutput, log: TextIO, verbose: int) -> None:
        self.sc, self.num_proc, self.start_timeout_s = sc, num_proc, start_timeout_s
        self.payload, self.driver_settings, self.user_env = payload, driver_settings, user_env
        self.interfaces, self.executable = interfaces, executable
        self.output, self.log, self.verbose = output, log, verbose
        self.token = secrets.token_hex(16)
        self.group = f"hpdl.spark.run.{next(_run_ids)}.{self.token[:8]}"
        self.service_address = ""
        self._job: Optional[threading.Thread] = None
        self._job_outcome: "queue.Queue[tuple]" = queue.Queue()

    def say(self, level: int, text: str) -> None:
        if self.verbose >= level:
            self.log.write(f"hpdl.spark: {text}\n")
            self.log.flush()

    def execute(self) -> List[Any]:
        deadline = time.monotonic() + self.start_timeout_s
        bind_host, advertised_host = driver_addresses(self.sc)
        service = DriverService(bind_host, advertised_host, self.token, self.output.write)
        self.service_address = "%s:%d" % service.address
        try:
            self._wait_for_slots(deadline)
            self._submit(service)
            return self._results(self._supervise(service, deadline))
        except BaseException:
            self._cancel(service)
            raise
        finally:
            service.close()

    # -- before the stage -----------------------------------------------------------------------

    def _wait_for_slots(self, deadline: float) -> None:
        waiting = False
        while True:
            total = task_slots(self.sc)
            if total >= self.num_proc:
                return
            if time.monotonic() >= deadline:
                raise self._slots_error(total, total)
            if not waiting:
                self.say(2, f"waiting for {self.num_proc} task slots; the cluster has {total}")
                waiting = True
            time.sleep(min(SLOT_POLL_S, max(0.0, deadline - time.monotonic())))

    def _slots_error(self, free: int, total: int) -> SlotsUnavailableError:
        busy = f", {total - free} of them busy with other jobs" if free < total else ""
        return SlotsUnavailableError(
            f"hpdl.spark.run: wanted {self.num_proc} task slots, found {free} free within the start timeout of "
            f"{self.start_timeout_s:g} s ({total} in the cluster{busy}): a barrier stage starts all its "
            f"tasks together, one rank in each; add executors or cores, lower num_proc, or raise start_timeout "
            f"(HPDL_SPARK_START_TIMEOUT)", wanted=self.num_proc, found=free, total=total)

    def _start_timed_out(self, registered: int) -> SparkRunError:
        """The error for tasks that did not all reach the driver in time: no slots, or slow to start."""
        started = running_tasks(self.sc, self.group)
        if started:
            return SparkRunError(
                f"hpdl.spark.run: Spark started the {started} tasks of the barrier stage, but only {registered} of "
                f"{self.num_proc} reached the driver at {self.service_address} within the start timeout of "
                f"{self.start_timeout_s:g} s: can the executors reach that address (spark.driver.host)? Or raise "
                f"start_timeout (HPDL_SPARK_START_TIMEOUT) if their Python workers are slow to start")
        total = task_slots(self.sc)
        return self._slots_error(max(0, total - running_tasks(self.sc)), total)

    def _submit(self, service: DriverService) -> None:
        from pyspark import InheritableThread

        spec = TaskSpec(service.address, self.token, self.payload, self.driver_settings, self.user_env,
                        self.interfaces, self.executable)
        task = functools.partial(run_task, spec)

        def job() -> None:
            try:
                # A thread that inherits the caller's job properties (a scheduler pool, say), then
                # puts the stage in a group of its own so that exactly this run can be cancelled.
                self.sc.setJobGroup(self.group, f"hpdl.spark.run: {self.num_proc} ranks", interruptOnCancel=True)
                rdd = self.sc.parallelize(range(self.num_proc), self.num_proc)
                self._job_outcome.put((rdd.barrier().mapPartitions(task).collect(), None))
            except BaseException as err:  # reported to the driver's loop, which raises
                self._job_outcome.put((None, err))

        self._job = InheritableThread(target=job, name="hpdl-spark-job", daemon=True)
        self._job.start()

    # -- while it runs --------------------------------------------------------------------------

    def _supervise(self, service: DriverService, deadline: float) -> List[tuple]:
        registered: Dict[int, str] = {}
        failures: List[Dict[str, Any]] = []
        stopped_at: Optional[float] = None
        while True:
            try:
                rows, error = self._job_outcome.get(timeout=0.1)
            except queue.Empty:
                pass
            else:
                if error is not None:
                    service.stop_all()  # Spark ends the stage's tasks in its own time: end their ranks now
                # Once the tasks' connections are read to the end, every report and output line is in.
                service.close(drain_s=DRAIN_S)
                self._take_reports(service, registered, failures)
                if failures:
                    raise self._rank_failed(failures)
                if error is not None:
                    raise SparkRunError(f"hpdl.spark.run: Spark failed the barrier stage: {spark_failure(error)}")
                return rows
            self._take_reports(service, registered, failures)
            if failures and stopped_at is None:
                stopped_at = time.monotonic()
                self._cancel(service)
            if stopped_at is not None and time.monotonic() - stopped_at > CANCEL_GRACE_S:
                raise self._rank_failed(failures)
            if not failures and len(registered) < self.num_proc and time.monotonic() >= deadline:
                raise self._start_timed_out(len(registered))

    def _take_reports(self, service: DriverService, registered: Dict[int, str],
                      failures: List[Dict[str, Any]]) -> None:
        """Take the tasks' reports that arrived: count registrations, collect failures."""
        while True:
            try:
                report = service.reports.get_nowait()
            except queue.Empty:
                return
            data = report.data
            if report.kind == REGISTERED:
                registered[data["partition"]] = data["host"]
                if len(registered) == self.num_proc:
                    self.say(2, f"all {self.num_proc} tasks reached the driver")
            elif report.kind == STARTED:
                self.say(2, f"rank {data['rank']} (local rank {data['local_rank']}) started on {data['hostname']} "
                            f"as process {data['pid']}")
            elif report.kind == EXITED:
                if data.get("exit_code") == 0:
                    self.say(2, f"rank {data['rank']} returned")
                elif not data.get("stopped"):
                    failures.append(data)

    def _rank_failed(self, failures: List[Dict[str, Any]]) -> RankFailedError:
        ordered = first_failures(failures)
        first = ordered[0]
        message = describe_exit(f"rank {first['rank']} (on {first['hostname']})", first.get("exit_code"),
                                first.get("signal"), first.get("error"), first.get("tail") or [], stopped=False,
                                exception=exception_line(first.get("exception_type"), first.get("message")))
        others = {}
        for failure in ordered[1:]:
            if failure["rank"] != first["rank"]:
                others.setdefault(failure["rank"], failure)
        if len(others) == 1:
            (rank, other), = others.items()
            line = exception_line(other.get("exception_type"), other.get("message"))
            message += f"\n(then rank {rank} failed too{': ' + line if line else ''})"
        elif others:
            message += f"\n(then ranks {', '.join(map(str, sorted(others)))} failed too)"
        return RankFailedError(f"hpdl.spark.run: {message}", rank=first["rank"], host=first["hostname"],
                               exit_code=first.get("exit_code"), signal=first.get("signal"),
                               traceback=first.get("error"), tail=first.get("tail") or [],
                               exception_type=first.get("exception_type"), exception_message=first.get("message"))

    def _cancel(self, service: DriverService) -> None:
        """End the stage and every rank of it; wait (bounded) until the tasks have ended their ranks.

        Each task closes its connection once its rank's process is reaped, so when every
        connection has ended no rank of this run is left.
        """
        service.stop_all()
        job = self._job
        if job is None:
            return
        if job.is_alive():
            self.sc.cancelJobGroup(self.group)
        deadline = time.monotonic() + CANCEL_GRACE_S
        job.join(CANCEL_GRACE_S)
        service.close(drain_s=max(0.0, deadline - time.monotonic()))

    # -- after it ---------------------------------------------------------------------------------

    def _results(self, rows: List[tuple]) -> List[Any]:
        ranks = sorted(rank for rank, _ in rows)
        if ranks != list(range(self.num_proc)):
            raise SparkRunError(f"hpdl.spark.run: the stage returned the results of ranks {ranks}, "
                                f"not of ranks 0-{self.num_proc - 1}")
        results = []
        for rank, data in sorted(rows, key=lambda row: row[0]):
            try:
                results.append(cloudpickle.loads(data))
            except Exception as err:
                raise SparkRunError(f"hpdl.spark.run: the result of rank {rank} cannot be unpickled on the driver: "
                                    f"{type(err).__name__}: {err}") from None
        return results


def first_failures(failures: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The ranks' failure reports, first the one that failed the run.

    Reports arrive as the ranks' processes end, not as they fail: a rank that raised still
    shuts hpdl down as it exits, while the others, told so, raise hpdl's HorovodInternalError
    ("hpdl has been shut down (rank 1 ... exited)") and may end first. So a failure of the
    rank's own (its exception, an exit, a signal) comes before such a ``secondary`` one, and
    among either kind the earlier failure (``at``, on the clock of the rank's host), then the
    earlier report.
    """
    return sorted(failures, key=lambda f: (bool(f.get("secondary")), f.get("at") or float("inf")))


def spark_failure(error: BaseException, lines: int = 8) -> str:
    """The part of Spark's failure that says what went wrong: a Python traceback's last lines, else the cause.

    Spark's own text is the whole JVM stack, with the task's Python traceback inside it, and
    its error class's SQL state after the message.
    """
    text = str(error)
    sql_state = re.compile(r"\s*SQLSTATE: \w+\s*$")
    python = text.rfind("Traceback (most recent call last):")
    if python >= 0:
        body = []
        for line in text[python:].splitlines()[1:]:
            if re.match(r"\s+at [\w$.]+\(", line) or line.startswith("\tat "):
                break
            body.append(line)
        body = [line for line in body if line.strip() and not sql_state.fullmatch(line)]
        return "\n" + "\n".join("    " + line for line in body[-lines:])
    for line in text.splitlines():
        cause = re.search(r"[\w.$]*(?:Exception|Error|Failed)\w*: (.+)", line)
        if cause:
            return sql_state.sub("", cause.group(1))
    return text.splitlines()[0] if text else type(error).__name__
