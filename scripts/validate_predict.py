"""`hpdl profile predict` against `hpdl bench replay`, configuration by configuration.

For each configuration (profile, ranks, emulated nodes, link rate and delay, fp16 or not,
backend) it runs, on the same placement:
1. `hpdl bench allreduce --paths backend,engine --json`: the allreduce curve a user would
   measure on the target cluster at the target scale (float16 for the fp16 configurations: the
   allreduce they run), the engine's path beside it for the engine's overhead per round;
2. `hpdl bench replay PROFILE --json`: the profile's communication through the real engine,
   its compute slept;
3. `hpdl profile predict PROFILE --json -` from that curve (both levels: the curve is the whole
   placement's), the library's own allreduce as measured (`--algorithm ring`), and for fp16
   the `--what-if fp16` row;
and prints the step times and the prediction's error, as a Markdown table (docs/predict.md
quotes it) and, with --json, every record. Emulated nodes need root (hpdl emulate).

With --training it checks the prediction against real training instead: EDSR-baseline trained
by `hpdl bench synthetic` at 2 ranks on one node, profiled; then the same training across 2
emulated nodes; each predicted from the one-node profile and the curve measured on its own
placement (the user's case: profile what you have, predict the placement you will get).

Usage:
    python scripts/validate_predict.py --profiles edsr-baseline=p1.json,edsr=p2.json [--only 1,2] [--json out.json]
    python scripts/validate_predict.py --training [--rate 100mbit] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class Config:
    model: str  # the profile's name in --profiles
    nodes: int
    slots: int  # ranks per node
    rate: Optional[str] = None  # tc syntax, emulated nodes only
    delay: Optional[str] = None  # one-way, per link end (hpdl emulate --delay)
    fp16: bool = False
    backend: str = "gloo"

    @property
    def ranks(self) -> int:
        return self.nodes * self.slots

    def describe(self) -> str:
        where = "1 node" if self.nodes == 1 else f"{self.nodes} nodes x {self.slots}, {self.rate}" + \
            (f", {self.delay} delay" if self.delay else "")
        return f"{self.model}{' fp16' if self.fp16 else ''}, {self.ranks} ranks, {where}, {self.backend}"


# 2-8 ranks, 1-4 emulated nodes, 100 Mbit to 10 Gbit, both models, fp16 and not. No added
# delay: hpdl emulate adds it with netem, which the kernel of the machine these figures come
# from lacks (`tc qdisc add ... netem`: "Specified qdisc kind is unknown"); DELAYED holds the
# configurations with delay, for a machine that has it (--delayed).
CONFIGS = (
    Config("edsr-baseline", 1, 2, backend="mpi"),
    Config("edsr-baseline", 1, 4),
    Config("edsr-baseline", 1, 8),
    Config("edsr-baseline", 1, 4, fp16=True),
    Config("edsr-baseline", 2, 1, "100mbit"),
    Config("edsr-baseline", 2, 1, "1gbit"),
    Config("edsr-baseline", 2, 2, "1gbit"),
    Config("edsr-baseline", 2, 2, "100mbit", fp16=True),
    Config("edsr-baseline", 4, 1, "1gbit"),
    Config("edsr-baseline", 4, 2, "10gbit"),
    Config("edsr", 1, 2, backend="mpi"),
    Config("edsr", 1, 4),
    Config("edsr", 2, 1, "1gbit"),
    Config("edsr", 2, 1, "10gbit", fp16=True),
    Config("edsr", 2, 2, "10gbit"),
)
DELAYED = (
    Config("edsr-baseline", 2, 1, "100mbit", "1ms"),
    Config("edsr-baseline", 2, 2, "1gbit", "500us"),
    Config("edsr-baseline", 4, 1, "1gbit", "1ms"),
    Config("edsr", 2, 2, "10gbit", "500us"),
)


def _largest_message(profile: str, fusion_threshold: int) -> int:
    from hpdl.profile.predict.predictor import step_shapes
    from hpdl.profile.schema import load

    shapes, _ = step_shapes(load(profile), profile)
    total = max(sum(g.nbytes for g in s.gradients) for s in shapes)
    largest = max(g.nbytes for s in shapes for g in s.gradients)
    need = max(min(total, fusion_threshold), largest)
    size = 4
    while size < need:
        size *= 2
    return size


def _launch(config: Config, command: Sequence[str]) -> List[str]:
    run = ["hpdl", "run", "-np", str(config.ranks), "--backend", config.backend, "--"] + list(command)
    if config.nodes == 1:
        return run
    emulate = ["hpdl", "emulate", "--nodes", str(config.nodes), "--slots", str(config.slots), "--rate", config.rate]
    if config.delay:
        emulate += ["--delay", config.delay]
    return emulate + ["--"] + run


def _json_of(argv: Sequence[str], timeout_s: float) -> Dict[str, Any]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"{shlex.join(argv)} failed (exit {done.returncode}): {last}")
    return json.loads(done.stdout[done.stdout.find("{"):])


def _curve(config: Config, profile: str, fusion_threshold: int, workdir: str, timeout_s: float,
           name: str) -> Tuple[str, List[str]]:
    """Measure the allreduce curve on ``config``'s placement up to the profile's largest message
    (float16 for fp16 configurations); return the file it is in and the command."""
    largest = _largest_message(profile, fusion_threshold)
    # The engine's path beside the raw backend's: the prediction takes the engine's own overhead
    # per round at this placement from their difference.
    bench = ["hpdl", "bench", "allreduce", "--json", "--max-size", str(largest), "--iterations", "100",
             "--iterations-large", "5" if largest > (16 << 20) else "20", "--warmup", "10", "--warmup-large", "2",
             "--paths", "backend,engine"]
    if config.fp16:
        bench += ["--dtype", "float16"]
    command = _launch(config, bench)
    path = os.path.join(workdir, name)
    with open(path, "w") as f:
        json.dump(_json_of(command, timeout_s), f)
    return path, command


def _predict(config: Config, profile: str, batch_size: int, curve_file: str, timeout_s: float,
             what_if: Optional[str] = None) -> Tuple[Dict[str, Any], List[str]]:
    """`hpdl profile predict` at ``config``'s ranks from the curve (both levels: it is the whole
    placement's), the library's own allreduce as measured; return the point and the command."""
    command = ["hpdl", "profile", "predict", profile, "--json", "-", "--batch-size", str(batch_size),
               "--ranks", str(config.ranks), "--gpus-per-node", str(config.slots), "--algorithm", "ring",
               "--backend", config.backend, "--network", f"intra=measured:{curve_file},inter=measured:{curve_file}"]
    if what_if:
        command += ["--what-if", what_if]
    wanted = what_if or "baseline"
    point = next(p for p in _json_of(command, timeout_s)["points"] if p["what_if"] == wanted)
    return point, command


def validate(config: Config, profile: str, batch_size: int, workdir: str, timeout_s: float,
             replay_steps: int) -> Dict[str, Any]:
    """Measure the curve, replay, predict; return the record."""
    from hpdl.config import Settings

    started = time.monotonic()
    curve_file, curve_command = _curve(config, profile, Settings().fusion_threshold, workdir, timeout_s,
                                       f"curve-{abs(hash(config))}.json")
    replay_command = ["hpdl", "bench", "replay", profile, "--json", "--batch-size", str(batch_size),
                      "--steps", str(replay_steps), "--warmup", "2"] + (["--fp16"] if config.fp16 else [])
    replay = _json_of(_launch(config, replay_command), timeout_s)
    point, predict_command = _predict(config, profile, batch_size, curve_file, timeout_s,
                                      "fp16" if config.fp16 else None)
    error = (point["step_s"] - replay["step_s"]) / replay["step_s"]
    return {"config": dataclasses.asdict(config), "describe": config.describe(), "replayed_step_s": replay["step_s"],
            "replayed_wait_s": replay["wait_s"], "compute_s": replay["compute_s"],
            "predicted_step_s": point["step_s"], "predicted_exposed_s": point["exposed_s"], "error": error,
            "replay_command": shlex.join(_launch(config, replay_command)),
            "curve_command": shlex.join(curve_command), "predict_command": shlex.join(predict_command),
            "seconds": time.monotonic() - started}


TRAINING = ["hpdl", "bench", "synthetic", "--model", "edsr-baseline", "--batch-size", "2", "--patch", "24",
            "--num-warmup", "2", "--num-iters", "5", "--num-batches-per-iter", "4", "--json"]


def training(rate: str, workdir: str, timeout_s: float) -> List[Dict[str, Any]]:
    """Real training at 2 ranks on one node (profiled) and across 2 emulated nodes, each against
    its prediction from the one-node profile and its own placement's curve."""
    profile = os.path.join(workdir, "training.json")
    records = []
    for config in (Config("edsr-baseline", 1, 2, backend="mpi"), Config("edsr-baseline", 2, 1, rate, backend="mpi")):
        command = _launch(config, TRAINING)
        if config.nodes == 1:  # hpdl run's own --profile, before the command
            command = command[:command.index("--")] + ["--profile", profile] + command[command.index("--"):]
        trained = _json_of(command, timeout_s)
        step = trained["batch_size"] / trained["img_sec_per_rank"]
        curve_file, _ = _curve(config, profile, 128 << 20, workdir, timeout_s, f"training-curve-{config.nodes}.json")
        point, predict = _predict(config, profile, 2, curve_file, timeout_s)
        records.append({"describe": f"real training, {config.describe()}", "trained_step_s": step,
                        "predicted_step_s": point["step_s"], "error": (point["step_s"] - step) / step,
                        "command": shlex.join(command), "predict_command": shlex.join(predict)})
        print(f"  {records[-1]['describe']}: trained {step * 1e3:.1f} ms, predicted {point['step_s'] * 1e3:.1f} ms, "
              f"error {records[-1]['error'] * 100:+.1f} %", file=sys.stderr, flush=True)
    return records


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a Markdown table (docs/predict.md quotes them)."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _write(path: Optional[str], records: List[Dict[str, Any]]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(records, f, indent=1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--training", action="store_true",
                        help="check against real training (EDSR-baseline, 2 ranks, 1 node and 2 emulated nodes)")
    parser.add_argument("--rate", default="100mbit", help="--training's link rate between the nodes (default 100mbit)")
    parser.add_argument("--profiles", default="",
                        help="NAME=FILE pairs, comma-separated, for the configurations' models "
                             "(edsr-baseline=..., edsr=...)")
    parser.add_argument("--batch-sizes", default="edsr-baseline=2,edsr=1",
                        help="NAME=N: the batch size per rank each profile was recorded with")
    parser.add_argument("--delayed", action="store_true",
                        help="run the configurations with added delay instead (needs netem in the kernel)")
    parser.add_argument("--only", default="", help="comma-separated configuration numbers (1-based) to run")
    parser.add_argument("--json", default=None, help="write every record to this file")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per command (default 600)")
    parser.add_argument("--replay-steps", type=int, default=40,
                        help="timed steps of each replay (default 40: the median of fewer varied by up to 18 %% "
                             "between two runs of one configuration)")
    args = parser.parse_args(argv)
    if args.training:
        with tempfile.TemporaryDirectory(prefix="hpdl-validate-") as workdir:
            records = training(args.rate, workdir, args.timeout)
        _table(["configuration", "trained step ms", "predicted step ms", "error"],
               [[r["describe"], _ms(r["trained_step_s"]), _ms(r["predicted_step_s"]), f"{r['error'] * 100:+.1f} %"]
                for r in records])
        _write(args.json, records)
        return 0
    profiles = dict(part.split("=", 1) for part in args.profiles.split(",") if part)
    batch_sizes = {k: int(v) for k, v in (part.split("=", 1) for part in args.batch_sizes.split(","))}
    configs = DELAYED if args.delayed else CONFIGS
    chosen = [int(n) for n in args.only.split(",") if n] or list(range(1, len(configs) + 1))
    records = []
    with tempfile.TemporaryDirectory(prefix="hpdl-validate-") as workdir:
        for number in chosen:
            config = configs[number - 1]
            if config.model not in profiles:
                print(f"{number}: skipped, no profile for {config.model}", file=sys.stderr)
                continue
            print(f"{number}/{len(configs)}: {config.describe()} ...", file=sys.stderr, flush=True)
            try:
                record = validate(config, profiles[config.model], batch_sizes[config.model], workdir, args.timeout,
                                  args.replay_steps)
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                print(f"{number}: {err}", file=sys.stderr)
                continue
            record["number"] = number
            records.append(record)
            print(f"  replayed {_ms(record['replayed_step_s'])} ms, predicted {_ms(record['predicted_step_s'])} ms, "
                  f"error {record['error'] * 100:+.1f} % ({record['seconds']:.0f} s)", file=sys.stderr, flush=True)
    _table(["#", "configuration", "compute ms", "replayed step ms", "predicted step ms", "error"],
           [[str(r["number"]), r["describe"], _ms(r["compute_s"]), _ms(r["replayed_step_s"]),
             _ms(r["predicted_step_s"]), f"{r['error'] * 100:+.1f} %"] for r in records])
    within = sum(1 for r in records if abs(r["error"]) <= 0.10)
    print(f"\n{within} of {len(records)} within 10 %")
    _write(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
