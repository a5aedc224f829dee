"""The cost models under ``hpdl profile predict``: the --network spec and its presets, measured
curves (hpdl bench allreduce --json, OSU osu_allreduce), the allreduce algorithms' formulas.

Every expected time is worked out by hand in the comment beside it. MiB = 1048576 B; a
bandwidth of B GB/s is beta = 1/(B x 1e9) s per byte.

tests/predict_samples/bench_allreduce.json has the layout that
``hpdl run -np 4 -- hpdl bench allreduce --json --paths backend,mpi4py`` prints (keys, order,
the bandwidth columns computed as the benchmark does), with round times in place of measured
ones, which a shared 2-core machine made too noisy to read. osu_allreduce.txt follows OSU
5.x's printout (a title, ``# Size       Avg Latency(us)``, one row per size).
"""

import json
import math
from pathlib import Path

import pytest

from hpdl.profile.predict.allreduce_cost import (AlgorithmError, Placement, allreduce_cost, check_allreduce,
                                                 hierarchical_allreduce_time, ring_allreduce_time,
                                                 tree_allreduce_time)
from hpdl.profile.predict.curves import (CurveError, MeasuredCurve, algorithm_bandwidth, bus_bandwidth,
                                         read_bench_curve, read_curve, read_osu_curve, scale_time_to_ranks)
from hpdl.profile.predict.network import (LEVELS, AlphaBeta, Network, NetworkSpecError, parse_bandwidth,
                                          parse_latency, parse_network)
from hpdl.profile.predict.presets import PRESETS, markdown_table

SAMPLES = Path(__file__).resolve().parent / "predict_samples"
BENCH = str(SAMPLES / "bench_allreduce.json")
OSU = str(SAMPLES / "osu_allreduce.txt")
MIB = 1 << 20
US = 1e-6


def approx(seconds):
    return pytest.approx(seconds, rel=1e-12, abs=1e-18)


# --- the formulas -------------------------------------------------------------------------

def test_ring_at_4_ranks_of_1_mib():
    # 2(p-1) alpha = 6 x 2 us = 12 us; 2(p-1)/p n beta = 1.5 x 1048576 B / 10e9 B/s = 157.2864 us.
    assert ring_allreduce_time(MIB, 4, 2 * US, 1 / 10e9) == approx(169.2864 * US)


def test_tree_at_4_and_5_ranks_of_1_mib():
    # 2 n beta = 2 x 1048576 / 10e9 = 209.7152 us. p=4: ceil(log2 4) = 2, 4 x 2 us = 8 us.
    assert tree_allreduce_time(MIB, 4, 2 * US, 1 / 10e9) == approx(217.7152 * US)
    # p=5: ceil(log2 5) = 3, 6 x 2 us = 12 us.
    assert tree_allreduce_time(MIB, 5, 2 * US, 1 / 10e9) == approx(221.7152 * US)


def test_hierarchical_2_nodes_of_4():
    # intra 1 us, 100 GB/s; inter 5 us, 10 GB/s per rank's stream; g = 4, N = 2, n = 1 MiB.
    # 2(g-1) alpha_i = 6 us; 2 (g-1)/g n beta_i = 1.5 x 1048576 / 100e9 = 15.72864 us;
    # 2(N-1) alpha_e = 10 us; 2 (N-1)/N (n/g) beta_e = 262144 / 10e9 = 26.2144 us. Sum 57.94304 us.
    assert hierarchical_allreduce_time(MIB, 2, 4, 1 * US, 1 / 100e9, 5 * US, 1 / 10e9) == approx(57.94304 * US)


def test_hierarchical_on_one_node_is_the_ring_among_its_ranks():
    # With N = 1 the inter term 2(N-1) alpha_e + 2 (N-1)/N (n/g) beta_e is 0 whatever the inter
    # link, and what is left, 2(g-1) alpha_i + 2 (g-1)/g n beta_i, is the ring over g ranks.
    for g in (1, 2, 3, 4, 8):
        ring = ring_allreduce_time(MIB, g, 1 * US, 1 / 100e9)
        assert hierarchical_allreduce_time(MIB, 1, g, 1 * US, 1 / 100e9, 99.0, 99.0) == ring
    network = Network(intra=AlphaBeta("x", 100e9, 1 * US))
    placement = Placement(ranks=4, ranks_per_node=8)
    assert (allreduce_cost(network, placement, MIB, "hierarchical").seconds
            == allreduce_cost(network, placement, MIB, "ring").seconds)


def test_one_rank_costs_nothing():
    assert ring_allreduce_time(MIB, 1, 1.0, 1.0) == 0.0
    assert tree_allreduce_time(MIB, 1, 1.0, 1.0) == 0.0
    assert hierarchical_allreduce_time(MIB, 1, 1, 1.0, 1.0, 1.0, 1.0) == 0.0
    cost = allreduce_cost(Network(), Placement(1, 4), MIB, "auto")  # no level needed at all
    assert (cost.seconds, cost.algorithm) == (0.0, "none")


def _two_levels():
    return Network(intra=AlphaBeta("fast", 100e9, 1 * US), inter=AlphaBeta("slow", 10e9, 5 * US))


@pytest.mark.parametrize("nics, expected_us", [
    # The 4 local ranks' inter-node allreduces share the node's NICs: beta_e per stream =
    # (4 / min(4, nics)) / 10e9. Intra and latency terms as above: 6 + 15.72864 + 10 us.
    (1, 6 + 15.72864 + 10 + 104.8576),  # 262144 B x 4 / 10e9 = 104.8576 us
    (2, 6 + 15.72864 + 10 + 52.4288),  # x 2
    (4, 57.94304),  # one NIC per rank: the formula with the NIC's own beta
    (8, 57.94304),  # more NICs than ranks add nothing
])
def test_hierarchical_across_nodes_shares_the_nics(nics, expected_us):
    cost = allreduce_cost(_two_levels(), Placement(8, 4, nics_per_node=nics), MIB, "hierarchical")
    assert cost.seconds == approx(expected_us * US)
    assert cost.algorithm == "hierarchical"


def test_flat_ring_across_nodes_is_bound_by_the_slower_level():
    # p = 8: 14 steps. intra: 14 x 1 us + 1.75 x 1048576 / 100e9 = 32.35008 us;
    # inter: 14 x 5 us + 1.75 x 1048576 / 10e9 = 253.5008 us; each step waits for the slower.
    cost = allreduce_cost(_two_levels(), Placement(8, 4), MIB, "ring")
    assert cost.seconds == approx(253.5008 * US)
    # One rank per node: only the inter level, the same figure.
    assert allreduce_cost(Network(inter=_two_levels().inter), Placement(8, 1), MIB, "ring").seconds == approx(
        253.5008 * US)


def test_auto_takes_the_cheapest_and_ring_among_equals():
    network, placement = _two_levels(), Placement(8, 4)
    each = {a: allreduce_cost(network, placement, MIB, a).seconds for a in ("ring", "tree", "hierarchical")}
    auto = allreduce_cost(network, placement, MIB, "auto")
    assert auto.seconds == min(each.values())
    assert auto.algorithm == min(each, key=each.get) == "hierarchical"  # 136.58624 us, the others above 250
    assert auto.assumptions[0].startswith("auto:")
    # One node: hierarchical is the ring exactly; the tie goes to the ring.
    assert allreduce_cost(network, Placement(4, 4), 64 * MIB, "auto").algorithm == "ring"
    # Small messages: the tree's log2 p latency steps win.
    assert allreduce_cost(network, Placement(512, 1), 1024, "auto").algorithm == "tree"


def test_algorithms_refused_in_one_line():
    network = _two_levels()
    with pytest.raises(AlgorithmError, match=r"unknown allreduce algorithm 'butterfly'; algorithms: ring, tree, "
                                             r"hierarchical, auto"):
        allreduce_cost(network, Placement(8, 4), MIB, "butterfly")
    with pytest.raises(AlgorithmError, match="6 ranks at 4 per node leave 2 on the last") as err:
        allreduce_cost(network, Placement(6, 4), MIB, "hierarchical")
    assert "\n" not in str(err.value)
    # auto passes over hierarchical there, and says so.
    auto = allreduce_cost(network, Placement(6, 4), MIB, "auto")
    assert auto.algorithm in ("ring", "tree") and "not hierarchical" in auto.assumptions[0]


@pytest.mark.parametrize("network, placement, missing", [
    (Network(inter=AlphaBeta("e", 1e9, 0.0)), Placement(8, 4), "intra"),
    (Network(inter=AlphaBeta("e", 1e9, 0.0)), Placement(2, 4), "intra"),
    (Network(intra=AlphaBeta("i", 1e9, 0.0)), Placement(8, 4), "inter"),
    (Network(intra=AlphaBeta("i", 1e9, 0.0)), Placement(2, 1), "inter"),
])
def test_a_level_the_placement_crosses_must_be_given(network, placement, missing):
    with pytest.raises(NetworkSpecError, match=f"the network has no {missing} level") as err:
        check_allreduce(network, placement, "ring")
    assert "\n" not in str(err.value) and "presets: nvlink2" in str(err.value)


def test_a_level_the_placement_does_not_cross_may_be_left_out():
    assert allreduce_cost(Network(inter=AlphaBeta("e", 10e9, 0.0)), Placement(2, 1), MIB, "ring").seconds == approx(
        MIB / 10e9)  # p = 2: 2 x 1/2 x n beta
    assert allreduce_cost(Network(intra=AlphaBeta("i", 10e9, 0.0)), Placement(2, 4), MIB, "ring").seconds == approx(
        MIB / 10e9)


def test_placement():
    assert (Placement(8, 4).nodes, Placement(8, 4).ranks_on_node, Placement(8, 4).even) == (2, 4, True)
    assert (Placement(2, 4).nodes, Placement(2, 4).ranks_on_node, Placement(2, 4).even) == (1, 2, True)
    assert (Placement(6, 4).nodes, Placement(6, 4).even) == (2, False)
    assert Placement(1, 4).levels_used() == () and Placement(8, 1).levels_used() == ("inter",)
    with pytest.raises(ValueError, match="ranks_per_node must be a whole number of at least 1"):
        Placement(4, 0)


# --- bus bandwidth --------------------------------------------------------------------------

def test_bus_bandwidth_conversion():
    # nccl-tests: busbw = algbw x 2(p-1)/p. At p=4 the factor is 1.5, at 8 it is 1.75, at 2 it is 1.
    assert bus_bandwidth(10e9, 4) == pytest.approx(15e9)
    assert algorithm_bandwidth(15e9, 4) == pytest.approx(10e9)
    assert bus_bandwidth(10e9, 2) == 10e9 and bus_bandwidth(10e9, 1) == 0.0
    # 1 ms at 2 ranks is 1.5 ms at 4 and 1.75 ms at 8, the bus bandwidth held; 0 at one rank.
    assert scale_time_to_ranks(1e-3, 2, 4) == pytest.approx(1.5e-3)
    assert scale_time_to_ranks(1e-3, 2, 8) == pytest.approx(1.75e-3)
    assert scale_time_to_ranks(1e-3, 4, 1) == 0.0
    with pytest.raises(ValueError, match="one rank"):
        scale_time_to_ranks(1e-3, 1, 4)
    with pytest.raises(ValueError, match="one rank"):
        algorithm_bandwidth(1e9, 1)


# --- the spec ---------------------------------------------------------------------------------

def test_spec_with_figures():
    network = parse_network("intra=nvlink:150GB/s:2us,inter=ib-edr:12.5GB/s:1.5us")
    assert (network.intra.label, network.intra.bandwidth, network.intra.latency) == ("nvlink", 150e9, 2e-6)
    assert (network.inter.label, network.inter.bandwidth, network.inter.latency) == ("ib-edr", 12.5e9, 1.5e-6)
    assert network.inter.beta == 1 / 12.5e9 and network.inter.alpha == 1.5e-6
    assert network.intra.source == "given in the spec"  # a label that is a preset's name takes the figures given


def test_spec_with_presets():
    bare = parse_network("nvlink2, ib-edr")  # each bare preset fills its own level
    assert bare == parse_network("intra=nvlink2,inter=ib-edr")
    assert (bare.intra.bandwidth, bare.inter.bandwidth) == (150e9, 12.5e9)
    alone = parse_network("ib-edr")
    assert alone.intra is None and alone.inter.label == "ib-edr"  # no intra level guessed
    assert parse_network("inter=pcie3").inter.bandwidth == PRESETS["pcie3"].bandwidth  # any level may take any preset
    assert len(bare.describe()) == 2 and bare.describe()[0].startswith("intra: nvlink2: 150 GB/s")


@pytest.mark.parametrize("text, bytes_per_second", [
    ("12.5GB/s", 12.5e9), ("100Gbit/s", 12.5e9), ("800Mbit/s", 1e8), ("1 KiB/s", 1024), ("2MiB/s", 2 * 2 ** 20),
    ("1GiB/s", 2 ** 30), ("1e3MB/s", 1e9), ("500KB/s", 5e5), ("7B/s", 7), (".5GB/s", 5e8),
])
def test_bandwidth_units(text, bytes_per_second):
    assert parse_bandwidth(text) == pytest.approx(bytes_per_second)


@pytest.mark.parametrize("text, seconds", [
    ("1.5us", 1.5e-6), ("500ns", 5e-7), ("2ms", 2e-3), ("1s", 1.0), ("0us", 0.0), ("3 µs", 3e-6),
])
def test_latency_units(text, seconds):
    assert parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize("spec, message", [
    ("", "the network spec is empty; give LEVEL=PRESET"),
    ("ib-fdr", "'ib-fdr' is neither a preset nor LEVEL=...; presets: nvlink2, pcie3, shm, ib-edr"),
    ("inter=ib-fdr", "unknown network preset 'ib-fdr' in 'inter=ib-fdr'; presets: nvlink2"),
    ("node=shm", "unknown level 'node' in 'node=shm'; levels: intra, inter"),
    ("intra=nvlink:150GBps:2us", "bad bandwidth '150GBps' in 'intra=nvlink:150GBps:2us': write a number and a unit "
                                 "among B/s, KB/s, MB/s, GB/s, KiB/s, MiB/s, GiB/s, Mbit/s, Gbit/s"),
    ("intra=nvlink:150Gb/s:2us", "bad bandwidth '150Gb/s'"),  # bits or bytes? refused, not guessed
    ("intra=nvlink:150GB/s:2", "bad latency '2' in 'intra=nvlink:150GB/s:2': write a number and a unit among ns, us"),
    ("intra=nvlink:150GB/s:-2us", "bad latency '-2us'"),
    ("intra=nvlink:0GB/s:2us", "bad bandwidth '0GB/s' in 'intra=nvlink:0GB/s:2us': it must be more than 0"),
    ("intra=nvlink:150GB/s", "'intra=nvlink:150GB/s' needs LABEL:BANDWIDTH:LATENCY (e.g. intra=nvlink:150GB/s:2us)"),
    ("intra=a:b:c:d", "'intra=a:b:c:d' needs LABEL:BANDWIDTH:LATENCY"),
    ("intra=nv link:1GB/s:1us", "bad label 'nv link' in 'intra=nv link:1GB/s:1us'"),
    ("intra=shm,intra=pcie3", "level intra given twice in the network spec: 'intra=shm' and 'intra=pcie3'"),
    ("nvlink2,pcie3", "level intra given twice in the network spec: 'nvlink2' and 'pcie3'"),
    ("intra=shm,,inter=ib-edr", "an empty part in the network spec"),
    ("inter=measured:", "'inter=measured:' names no file"),
    ("inter=measured:/no/such/file.json", "cannot read measured curve /no/such/file.json"),
])
def test_bad_specs_are_refused_in_one_line(spec, message):
    with pytest.raises(NetworkSpecError) as err:
        parse_network(spec)
    assert message in str(err.value)
    assert "\n" not in str(err.value)
    assert isinstance(err.value, ValueError)


# --- presets ------------------------------------------------------------------------------------

def test_presets_figures():
    expected = {  # bytes/s per direction, seconds per message
        "nvlink2": (6 * 25e9, 0.47e-6),  # 6 links x 25 GB/s per direction, not the 300 GB/s of both
        "pcie3": (8e9 * 16 * 128 / 130 / 8, 1.0e-6),  # 8 GT/s x 16 lanes, 128b/130b: 15.75 GB/s
        "shm": (3e9, 6e-6),
        "ib-edr": (12.5e9, 2.7e-6),  # 100 Gbit/s
        "ib-hdr": (25e9, 2.7e-6),  # 200 Gbit/s
        "10gbe": (1.25e9, 25e-6), "25gbe": (3.125e9, 25e-6), "100gbe": (12.5e9, 25e-6),
    }
    assert list(PRESETS) == list(expected)
    for name, (bandwidth, latency) in expected.items():
        assert (PRESETS[name].bandwidth, PRESETS[name].latency) == pytest.approx((bandwidth, latency)), name
    for preset in PRESETS.values():
        assert preset.level in LEVELS and preset.source and "\n" not in preset.source
        assert parse_network(preset.name).level(preset.level).source == f"preset: {preset.source}"


def test_docs_show_the_presets_as_declared():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "predict.md").read_text()
    assert markdown_table() in docs, "docs/predict.md's preset table differs from presets.markdown_table()"


# --- measured curves: hpdl bench allreduce --json --------------------------------------------------

def test_bench_curve_takes_the_backend_path_and_its_rank_count():
    curve = read_bench_curve(BENCH)
    assert (curve.ranks, curve.sizes, curve.label) == (4, (4096, 65536, 1048576), "bench_allreduce.json")
    assert "path backend" in curve.source
    assert curve.time(65536) == approx(40 * US)  # a measured size: its own time
    assert read_bench_curve(BENCH, bench_path="mpi4py").time(65536) == approx(50 * US)


def test_the_engines_overhead_is_the_median_difference_of_its_path_over_the_backends(tmp_path):
    # Without the engine's path, none is known; with it, the median over the sizes both timed.
    assert read_bench_curve(BENCH).engine_overhead_s is None
    data = json.loads(Path(BENCH).read_text())
    extra_us = {4096: 900.0, 65536: 1000.0, 1048576: 1500.0}
    backend = {r["size"]: r["avg_us"] for r in data["records"] if r["path"] == "backend"}
    data["records"] += [{"path": "engine", "size": size, "tensors": 1, "avg_us": backend[size] + extra}
                        for size, extra in extra_us.items()]
    both = tmp_path / "both.json"
    both.write_text(json.dumps(data))
    curve = read_bench_curve(str(both))
    assert curve.engine_overhead_s == approx(1000 * US) and "the engine's overhead 1 ms" in curve.source
    assert curve.time(65536) == approx(40 * US)  # the curve itself is still the backend's


def test_a_round_costs_the_measured_engine_overhead_at_the_placement_measured(tmp_path):
    from hpdl.profile.predict.predictor import NEGOTIATION_BYTES, round_overhead

    measured = MeasuredCurve("c", 4, (4, 1024), (10 * US, 20 * US), "test", engine_overhead_s=0.003)
    network = Network(intra=measured, inter=measured)
    cost = lambda nbytes, negotiation=False: measured.time_at_ranks(nbytes, 4, extrapolate=True)  # noqa: E731
    assert round_overhead(network, Placement(4, 4), cost) == 0.003
    assert round_overhead(network, Placement(4, 2), cost) == 0.003  # across nodes: inter's, the same file
    # At another rank count the overhead measured does not hold: the negotiation alone, from the curve.
    assert round_overhead(network, Placement(8, 8), cost) == cost(NEGOTIATION_BYTES) != 0.003


def test_bench_curve_interpolates_log_log():
    curve = read_bench_curve(BENCH)
    # Between (4096 B, 20 us) and (65536 B, 40 us) the exponent is log(2)/log(16) = 1/4; at
    # 16384 = 4096 x 4: 20 x 4^(1/4) = 20 sqrt(2) = 28.2843 us (linearly it would be 24 us).
    assert curve.time(16384) == approx(20 * math.sqrt(2) * US)
    # Between (65536, 40 us) and (1048576, 400 us): 262144 is 4 = 16^(1/2) times the first,
    # so 40 x 10^(1/2) = 126.491 us.
    assert curve.time(262144) == approx(40 * math.sqrt(10) * US)


def test_bench_curve_at_other_rank_counts():
    curve = read_bench_curve(BENCH)
    # Measured at 4 ranks (factor 1.5); at 8 (1.75): 400 us x 1.75 / 1.5 = 466.667 us; at 2 (1): 266.667 us.
    assert curve.time_at_ranks(MIB, 8) == approx(400 * US * 7 / 6)
    assert curve.time_at_ranks(MIB, 2) == approx(400 * US / 1.5)
    assert curve.time_at_ranks(MIB, 1) == 0.0


def test_curve_refuses_sizes_outside_its_range_unless_asked():
    curve = read_bench_curve(BENCH)
    with pytest.raises(CurveError, match=r"bench_allreduce.json: 2097152 B lies outside the measured "
                                         r"4096-1048576 B") as err:
        curve.time(2 * MIB)
    assert "\n" not in str(err.value)
    with pytest.raises(CurveError, match="outside"):
        curve.time(1024)
    assert curve.time(2 * MIB, extrapolate=True) == approx(800 * US)  # 400 us at 1 MiB, bandwidth held
    assert curve.time(1024, extrapolate=True) == approx(20 * US)  # the smallest size's time, a floor


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _bench(**changes):
    data = json.loads(Path(BENCH).read_text())
    data.update(changes)
    return json.dumps(data)


@pytest.mark.parametrize("text, kwargs, message", [
    ("[1, 2]", {}, "is not `hpdl bench allreduce --json` output (no 'benchmark': 'allreduce'"),
    ("{not json", {}, "is not `hpdl bench allreduce --json` output: Expecting property name"),
    (_bench(benchmark="synthetic"), {}, "is not `hpdl bench allreduce --json` output"),
    (_bench(ranks=1), {}, "measured at 1 rank(s), which moves nothing"),
    (_bench(records=[dict(r, tensors=200) for r in json.loads(Path(BENCH).read_text())["records"]]), {},
     "path backend timed 200 tensors per call; a curve needs one allreduce per call (--tensors 1)"),
    (_bench(records=[dict(r, path="engine" if r["path"] == "backend" else r["path"])
                     for r in json.loads(Path(BENCH).read_text())["records"]]), {},
     "holds the paths engine, mpi4py; name the one to use"),
    (_bench(), {"bench_path": "engine"}, "has no path 'engine'; it has backend, mpi4py"),
    (_bench(records=[{"path": "backend", "size": 4}]), {}, "a record lacks a usable 'avg_us'"),
])
def test_bad_bench_files_are_refused_in_one_line(tmp_path, text, kwargs, message):
    with pytest.raises(CurveError) as err:
        read_bench_curve(_write(tmp_path, "b.json", text), **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


# --- measured curves: OSU osu_allreduce ------------------------------------------------------------

def test_osu_curve():
    curve = read_osu_curve(OSU, ranks=8)
    assert (curve.ranks, curve.sizes[0], curve.sizes[-1], len(curve.sizes)) == (8, 4, MIB, 19)
    assert curve.time(4096) == approx(12 * US) and curve.time(MIB) == approx(2052 * US)
    # Between (4096, 12 us) and (8192, 20 us) the exponent is log2(20/12) = log2(5/3) = 0.73697;
    # at 6144 = 4096 x 1.5: 12 x 1.5^0.73697 = 16.179 us (linearly, 16 us).
    assert curve.time(6144) == approx(12 * 1.5 ** math.log2(5 / 3) * US)
    assert curve.time(6144) == pytest.approx(16.179 * US, rel=1e-4)
    assert read_curve(OSU, ranks=8) == curve  # text is read as OSU's


def test_osu_full_output_takes_the_average_column(tmp_path):
    # osu_allreduce -f (OMB 5.9's and 7.x's layout; 7.x adds the datatype line).
    text = ("# OSU MPI Allreduce Latency Test v7.3\n# Datatype: MPI_FLOAT.\n"
            "# Size       Avg Latency(us)   Min Latency(us)   Max Latency(us)  Iterations\n"
            "4                       7.61              6.38              8.84        1000\n"
            "8                       6.63              5.55              7.71        1000\n")
    curve = read_osu_curve(_write(tmp_path, "full.txt", text), ranks=2)
    assert curve.sizes == (4, 8) and curve.seconds == approx((7.61 * US, 6.63 * US))


@pytest.mark.parametrize("text, message", [
    ("# OSU MPI Broadcast Latency Test v5.9\n# Size       Avg Latency(us)\n4     1.0\n",
     "'OSU MPI Broadcast Latency Test v5.9' is not osu_allreduce's output"),
    ("Size Latency\n4 1.0\n", "has no '# Size  Avg Latency(us)' header: not osu_allreduce output"),
    ("# Size       Avg Latency(us)\n4     1.0\n# Size       Avg Latency(us)\n4     1.0\n",
     ":3: a second table; give one osu_allreduce run per file"),
    ("# Size       Avg Latency(us)\n4     1.0\n4     2.0\n", "size 4 B appears twice"),
    ("# Size       Avg Latency(us)\n4     abc\n", ":2: '4     abc' is not a row of size and latency"),
    ("# Size       Avg Latency(us)\n", "no measured sizes"),
    ("# Size       Avg Latency(us)\n4     0.00\n", "size 4 B has a time of 0.0 s; times must be positive"),
])
def test_bad_osu_files_are_refused_in_one_line(tmp_path, text, message):
    with pytest.raises(CurveError) as err:
        read_osu_curve(_write(tmp_path, "o.txt", text), ranks=4)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_read_curve_tells_the_formats_apart_and_needs_osus_rank_count():
    assert read_curve(BENCH) == read_bench_curve(BENCH)
    with pytest.raises(CurveError, match="does not say how many ranks ran it; give the rank count"):
        read_curve(OSU)
    with pytest.raises(CurveError, match="was measured at 4 ranks"):
        read_curve(BENCH, ranks=8)


def test_a_measured_curve_is_checked():
    with pytest.raises(CurveError, match="sizes must be positive, distinct and ascending"):
        MeasuredCurve("c", 2, (8, 4), (1.0, 1.0), source="here")


# --- measured curves in the spec and in the costs ------------------------------------------------

def test_spec_with_measured_levels():
    network = parse_network(f"intra=measured:{OSU}@8,inter=measured:{BENCH}")
    assert isinstance(network.intra, MeasuredCurve) and network.intra.ranks == 8
    assert isinstance(network.inter, MeasuredCurve) and network.inter.ranks == 4
    with pytest.raises(NetworkSpecError, match=r"does not say how many ranks ran it.*\(in 'inter=measured:") as err:
        parse_network(f"inter=measured:{OSU}")
    assert "\n" not in str(err.value)


def test_costs_over_measured_levels():
    osu = read_osu_curve(OSU, ranks=8)
    # Flat, one node of 4: the curve at 4096 B, 12 us at 8 ranks, times 1.5 / 1.75 = 10.2857 us.
    cost = allreduce_cost(Network(intra=osu), Placement(4, 4), 4096, "ring")
    assert cost.seconds == approx(12 * US * 1.5 / 1.75)
    assert any("measured curve stands for the library's own algorithm" in a for a in cost.assumptions)
    assert allreduce_cost(Network(intra=osu), Placement(4, 4), 4096, "tree").seconds == cost.seconds
    # Hierarchical, 2 nodes of 4, one NIC: the inter curve (4 ranks, 40 us at 64 KiB) answers
    # the 4 shards of n/4 as one allreduce of n = 65536 B over 2 nodes: 40 us x 1 / 1.5 =
    # 26.667 us; the intra ring 2 x 3 x 1 us + 1.5 x 65536 / 100e9 = 6.98304 us.
    network = Network(intra=AlphaBeta("fast", 100e9, 1 * US), inter=read_bench_curve(BENCH))
    cost = allreduce_cost(network, Placement(8, 4), 65536, "hierarchical")
    assert cost.seconds == approx(40 * US / 1.5 + 6.98304 * US)
    # With 4 NICs each shard of 16384 B has its own: 20 sqrt(2) us (interpolated) / 1.5.
    cost = allreduce_cost(network, Placement(8, 4, nics_per_node=4), 65536, "hierarchical")
    assert cost.seconds == approx(20 * math.sqrt(2) * US / 1.5 + 6.98304 * US)


def test_extrapolation_is_refused_unless_asked_and_then_said():
    network = Network(inter=read_bench_curve(BENCH))
    with pytest.raises(CurveError, match="outside the measured"):
        allreduce_cost(network, Placement(4, 1), 4 * MIB, "ring")
    cost = allreduce_cost(network, Placement(4, 1), 4 * MIB, "ring", extrapolate=True)
    assert cost.seconds == approx(1600 * US)  # 400 us at 1 MiB, x 4 at the measured 4 ranks
    assert any("sizes above 1048576 B extrapolated" in a for a in cost.assumptions)
    inside = allreduce_cost(network, Placement(4, 1), MIB, "ring", extrapolate=True)
    assert not any("extrapolated" in a for a in inside.assumptions)
