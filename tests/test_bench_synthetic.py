"""`hpdl bench synthetic` and its models: architecture facts, argument errors, output format.

Only the format is checked: timing figures belong to docs/perf.md, not to tests.
"""

import json
import os
import re

import pytest
import torch

from hpdl.bench.models import build_workload, gradient_bytes, resnet50
from hpdl.bench.synthetic import SyntheticOptions, _train_loop
from hpdl.cli import main
from hpdl.sr.models import count_parameters
from ranks import run_ranks

TINY = ["--model", "edsr-baseline", "--batch-size", "1", "--patch", "8", "--num-iters", "2",
        "--num-batches-per-iter", "1", "--num-warmup", "1"]


def test_resnet50_matches_torchvision():
    model = resnet50()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032
    keys = model.state_dict().keys()
    for key in ("conv1.weight", "layer1.0.downsample.1.running_mean", "layer3.5.conv3.weight",
                "layer4.2.bn3.bias", "fc.weight"):
        assert key in keys
    assert [len(getattr(model, f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]
    with torch.no_grad():
        assert model.eval()(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


@pytest.mark.parametrize("name,params,hr", [("edsr-baseline", 1_369_859, 2 * 12), ("edsr", 40_729_603, 2 * 12)])
def test_edsr_workloads(name, params, hr):
    workload = build_workload(name, batch_size=2, scale=2, patch=12)
    assert count_parameters(workload.model) == params and gradient_bytes(workload.model) == 4 * params
    assert workload.inputs.shape == (2, 3, 12, 12) and workload.targets.shape == (2, 3, hr, hr)
    assert 0 <= workload.inputs.min() and workload.inputs.max() <= 255


@pytest.mark.parametrize("kwargs", [{"batch_size": 0}, {"model": "vgg16"}, {"scale": 5}, {"compare": ("nccl",)}, {"compare": ("ddp", "ddp")},
                                    {"num_warmup": -1}, {"repeats": 0}, {"device": "gpu"}, {"amp": "half"},
                                    {"amp": "fp16", "overlap_forward": True}])
def test_option_errors(kwargs):
    with pytest.raises(ValueError):
        SyntheticOptions(**kwargs)


def test_cli_error_is_one_line(capsys):
    assert main(["bench", "synthetic", "--batch-size", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hpdl: error: batch-size must be at least 1, got 0"]


def test_a_device_this_machine_lacks_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "synthetic", *TINY, "--device", "cuda"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "hpdl: error: --device: cuda requested but CUDA is not available"]


@pytest.mark.parametrize("amp,breakdown", [("bf16", []), ("fp16", ["--breakdown"])])
def test_mixed_precision_runs_through_the_benchmark(amp, breakdown, capsys):
    assert main(["bench", "synthetic", *TINY, "--amp", amp, "--device", "cpu", *breakdown, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["amp"] == amp and record["device"] == "cpu" and record["total_img_sec"] > 0
    assert ("phases_ms" in record) == bool(breakdown)


def test_compile_runs_every_compared_mode_through_torch_compile(capsys):
    # One process: hpdl at one rank beside the plain loop, both forwards compiled (inductor).
    assert main(["bench", "synthetic", *TINY, "--compile", "--compare", "plain,hpdl", "--repeats", "1",
                 "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["compile"] is True and record["compare"] == ["plain"]
    assert sorted(record["runs"]) == ["hpdl", "plain"] and all(v[0] > 0 for v in record["runs"].values())


@pytest.mark.multirank
def test_single_run_prints_horovod_lines_on_rank_0_only():
    out = run_ranks("bench_synthetic.py", 2, "mpiexec", args=TINY, timeout=180).stdout
    assert re.search(r"^Iter #0: \d+\.\d+ img/sec per rank$", out, re.M), out
    assert re.search(r"^Img/sec per rank: \d+\.\d+ \+-\d+\.\d+$", out, re.M), out
    assert re.search(r"^Total img/sec on 2 ranks: \d+\.\d+ \+-\d+\.\d+$", out, re.M), out
    assert out.count("Iter #1:") == 1 and out.count("Model: edsr-baseline") == 1, out


@pytest.mark.parametrize("timed", [False, True])
def test_lockstep_batch_waits_between_backward_and_update(timed):
    """The lockstep baseline's barrier sits where hpdl's synchronize() does, once per batch."""
    calls = []
    model = torch.nn.Linear(4, 1)
    model.weight.register_hook(lambda grad: calls.append("backward"))

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            calls.append("update")
            return super().step(closure)

    workload = type("Workload", (), {"inputs": torch.ones(2, 4), "targets": torch.zeros(2, 1),
                                     "loss": staticmethod(torch.nn.functional.mse_loss)})()
    phases = [] if timed else None
    step = _train_loop(model, Recording(model.parameters(), lr=0.1), workload, phases,
                       barrier=lambda: calls.append("barrier"))
    step()
    step()
    assert calls == ["backward", "barrier", "update"] * 2
    if timed:
        assert len(phases) == 2 and all(wait is not None and wait >= 0 for _, _, wait, _ in phases)


@pytest.mark.multirank
def test_the_compare_order_rotates_so_that_no_mode_always_runs_first():
    from hpdl.bench.synthetic import run_order

    modes = ["hpdl", "plain", "ddp"]
    orders = [run_order(modes, repeat) for repeat in range(6)]
    assert orders[:3] == [["hpdl", "plain", "ddp"], ["plain", "ddp", "hpdl"], ["ddp", "hpdl", "plain"]]
    assert orders[3:] == orders[:3]  # and round again
    assert all(sorted(order) == sorted(modes) for order in orders)  # every mode once per repeat
    firsts = [order[0] for order in orders[:3]]
    assert sorted(firsts) == sorted(modes)  # each first once in len(modes) repeats
    assert run_order(["hpdl"], 4) == ["hpdl"]


@pytest.mark.parametrize("launcher,n,compare", [("mpiexec", 2, ["plain", "ddp", "ceiling", "lockstep"]),
                                                ("torchrun", 2, ["ddp", "lockstep", "profiled"])])
def test_compare_json_reports_medians_and_ratios(launcher, n, compare):
    args = TINY + ["--compare", ",".join(compare), "--repeats", "2", "--json", "--breakdown"]
    out = run_ranks("bench_synthetic.py", n, launcher, args=args, timeout=240).stdout
    record = json.loads(out[out.index("{"):])
    assert record["benchmark"] == "synthetic" and record["ranks"] == n and record["compare"] == compare
    assert sorted(record["runs"]) == sorted(["hpdl", *compare])
    for name in compare:
        assert len(record["runs"]["hpdl"]) == 2 and len(record["runs"][name]) == 2
        assert record["ratio"][name] == pytest.approx(record["median"]["hpdl"] / record["median"][name])
        per_run = sorted(h / b for h, b in zip(record["runs"]["hpdl"], record["runs"][name]))
        assert record["paired_ratio"][name] == pytest.approx((per_run[0] + per_run[1]) / 2)
    # The breakdown: every mode, every rank; a wait phase for hpdl and lockstep only; the
    # phases' means add up to the step's mean.
    phases = record["phases_ms"]
    assert sorted(phases) == sorted(["hpdl", *compare]) and all(len(ranks) == n for ranks in phases.values())
    for mode, ranks in phases.items():
        for entry in ranks:
            assert (entry["wait"] is not None) == (mode in ("hpdl", "lockstep", "profiled")), (mode, entry)
            parts = [entry[p]["mean_ms"] for p in ("forward", "backward", "wait", "update") if entry[p]]
            assert all(part >= 0 for part in parts) and entry["step"]["mean_ms"] == pytest.approx(sum(parts))
    # CPU time per batch by thread group: the training thread always works; hpdl's engine only
    # in hpdl's runs (it is shut down around them, so it never competes with a baseline); DDP's
    # exchange runs on gloo's threads.
    cpu = record["cpu_ms_per_batch"]
    assert sorted(cpu) == sorted(phases) and all(len(ranks) == n for ranks in cpu.values())
    for mode, ranks in cpu.items():
        for entry in ranks:
            assert entry["training"] > 0 and 0 <= entry["node_idle"] <= 1, (mode, entry)
            assert (entry["hpdl"] > 0) == (mode in ("hpdl", "profiled")), (mode, entry)
            if mode == "ddp":
                assert entry["backend"] > 0, entry


@pytest.mark.multirank
def test_compare_ceiling_text():
    out = run_ranks("bench_synthetic.py", 3, "mpiexec",
                    args=TINY + ["--compare", "ceiling", "--repeats", "2", "--breakdown"], timeout=240).stdout
    assert re.search(r"^Run 2/2 ceiling: \d+\.\d+ img/sec per rank$", out, re.M), out
    assert re.search(r"^ceiling +\d+\.\d+ +\+-\d+\.\d+ +\d+\.\d+ ", out, re.M), out
    assert re.search(r"^Ratio hpdl/ceiling: \d+\.\d{3} \(median of the 2 runs' ratios: \d+\.\d{3}\)$", out, re.M), out
    assert out.count("Ratio") == 1, out
    for rank in range(3):
        assert re.search(rf"^hpdl +{rank}( +\d+\.\d \(\d+\.\d\)){{5}}$", out, re.M), out
        assert re.search(rf"^ceiling +{rank}( +\d+\.\d \(\d+\.\d\)){{2}} +- +\d+\.\d \(\d+\.\d\)"
                         rf" +\d+\.\d \(\d+\.\d\)$", out, re.M), out


@pytest.mark.parametrize("args, flags", [(["--scale", "3"], "--scale applies"), (["--patch", "24"], "--patch applies"),
                                         (["--scale", "2", "--patch", "48"], "--scale and --patch apply")])
def test_sr_sizes_given_to_resnet50_are_refused_not_ignored(args, flags, capsys):
    assert main(["bench", "synthetic", "--model", "resnet50", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hpdl: error: {flags} to the SR models (edsr-baseline, edsr, srresnet), not resnet50, which "
                   "trains on 224x224 images"]


# --- hpdl bench allreduce: sizes no message can have, or no memory can hold -----------------

def test_allreduce_min_size_below_one_element_is_refused(capsys, monkeypatch):
    from hpdl.bench.allreduce import AllreduceOptions
    from hpdl.torch import runtime

    with pytest.raises(ValueError, match=r"--min-size \(2 B\) is smaller than one float32 element \(4 B\)"):
        AllreduceOptions(min_bytes=2, max_bytes=8)
    monkeypatch.setattr(runtime, "job_communicator", lambda *a: pytest.fail("a communicator was created"))
    assert main(["bench", "allreduce", "--min-size", "0"]) == 2
    assert capsys.readouterr().err == ("hpdl: error: --min-size (0 B) is smaller than one float32 element (4 B); "
                                       "the smallest message is --min-size 4\n")


class _Ranks:
    """A communicator of ``size`` ranks on one host, as seen by rank ``rank``, whose other ranks answer ``others``."""

    def __init__(self, rank=0, size=2, others=None):
        self.rank, self.size, self.others = rank, size, others

    def host_names(self):
        return ["node"] * self.size

    def allgather_object(self, obj):
        return [obj if r == self.rank else self.others for r in range(self.size)]

    def barrier(self):
        pass


def test_allreduce_messages_beyond_the_hosts_memory_are_refused_before_any_is_made(monkeypatch):
    from hpdl.bench import allreduce

    monkeypatch.setattr(allreduce.torch, "ones", lambda *a, **k: pytest.fail("a message was allocated"))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    largest = 1 << memory.bit_length()  # a power of two above the memory: the largest size measured
    opts = allreduce.AllreduceOptions(min_bytes=largest, max_bytes=largest)
    with pytest.raises(allreduce.MessageMemoryError, match=r"^--max-size: messages of \d+ GiB need \d+ GiB on this "
                       rf"host \(1 x {largest} B on each of its 2 rank\(s\)\), more than its .* of memory$"):
        allreduce.run_allreduce(opts, _Ranks(), paths={"backend": lambda tensors: None})


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_allreduce_messages_that_cannot_be_allocated_end_every_rank_with_the_size(monkeypatch, failing_rank):
    from hpdl.bench import allreduce

    def ones(count, dtype):
        raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {count * 4} bytes")

    opts = allreduce.AllreduceOptions(min_bytes=1 << 20, max_bytes=1 << 20)
    problem = "cannot allocate the messages of 1 MiB (1 x 1048576 B on each rank): out of memory; lower --max-size"
    if failing_rank == 0:
        monkeypatch.setattr(allreduce.torch, "ones", ones)
    # Rank 0's view: it allocated, or not; rank 1 failed, or not. Both ranks end alike.
    comm = _Ranks(others=problem if failing_rank == 1 else None)
    with pytest.raises(allreduce.MessageMemoryError) as caught:
        allreduce.run_allreduce(opts, comm, paths={"backend": lambda tensors: lambda: None})
    assert str(caught.value) == problem


@pytest.mark.parametrize("text, error", [
    ("9" * 400, "--max-size: '99999999999999999999...' is more than 1 EiB"),
    ("1.5", "--max-size: '1.5' is not a whole number of bytes"),  # not 1 B, silently
    ("0.3K", "--max-size: '0.3K' is not a whole number of bytes"),
])
def test_allreduce_sizes_are_exact_or_refused(capsys, monkeypatch, text, error):
    from hpdl.formatting import parse_size
    from hpdl.torch import runtime

    assert parse_size("1.5K") == 1536 and parse_size(".5K") == 512 and parse_size("1024G") == 1 << 40
    monkeypatch.setattr(runtime, "job_communicator", lambda *a: pytest.fail("a communicator was created"))
    assert main(["bench", "allreduce", "--max-size", text]) == 2
    assert capsys.readouterr().err == f"hpdl: error: {error}\n"


def test_threads_beyond_any_pool_are_refused(capsys):
    # torch.set_num_threads(100000000) ends the process with a segmentation fault.
    assert main(["bench", "synthetic", "--threads", "100000000"]) == 2
    assert capsys.readouterr().err == "hpdl: error: threads must be at most 1024, got 100000000\n"


_NO_MEMORY = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
              "to allocate 12000000000000 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize("args, error", [
    (["--model", "edsr-baseline", "--patch", "1000000"],
     "out of memory training edsr-baseline with --batch-size 32 and --patch 1000000; lower them"),
    (["--batch-size", "100000000"], "out of memory training resnet50 with --batch-size 100000000; lower it"),
])
def test_a_batch_beyond_memory_is_one_line(capsys, monkeypatch, args, error):
    from hpdl.bench import synthetic

    def no_memory(opts, json_output=False):
        raise RuntimeError(_NO_MEMORY)

    monkeypatch.setattr(synthetic, "run_synthetic", no_memory)
    assert main(["bench", "synthetic", *args]) == 2
    assert capsys.readouterr().err == f"hpdl: error: {error}\n"


def test_a_pipeline_batch_beyond_memory_is_one_line(capsys, monkeypatch):
    from hpdl.sr import throughput

    monkeypatch.setattr(throughput, "measure_pipeline", lambda *a, **k: {"median": 1.0})
    monkeypatch.setattr(throughput, "measure_model", lambda *a, **k: (_ for _ in ()).throw(RuntimeError(_NO_MEMORY)))
    assert main(["bench", "pipeline", "--model-batch-size", "100000000"]) == 2
    assert capsys.readouterr().err == ("hpdl: error: out of memory with --batch-size 16, --model-batch-size 100000000 "
                                       "and --patch 48; lower them\n")


def test_allreduce_json_holds_the_tables_bandwidth_ratios():
    from hpdl.bench.allreduce import bandwidth_ratios, format_records

    records = [{"path": path, "size": size, "tensors": 1, "avg_us": 1.0, "min_us": 1.0, "max_us": 1.0,
                "algbw_GBps": bw, "busbw_GBps": bw, "iterations": 10, "rounds": 3}
               for path, size, bw in [("backend", 4, 2.0), ("backend", 8, 3.0), ("mpi4py", 4, 1.0), ("mpi4py", 8, 4.0)]]
    assert bandwidth_ratios(records) == [{"size": 4, "backend/mpi4py": 2.0}, {"size": 8, "backend/mpi4py": 0.75}]
    assert bandwidth_ratios(records[:2]) == []
    table = format_records(records, 2, "mpi", "float32").splitlines()
    assert table[-4:] == ["# bandwidth ratio against mpi4py (median of 3 alternating rounds)",
                          "Size  backend/mpi4py", "4              2.000", "8              0.750"]
