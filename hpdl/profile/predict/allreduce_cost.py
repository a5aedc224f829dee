"""The time of one allreduce of n bytes over p ranks, by algorithm, on a network's levels.

The alpha-beta formulas (alpha: seconds per message, beta: seconds per byte, the inverse of the
bandwidth per direction; docs/predict.md has them with their sources):

- ring: ``2(p-1) alpha + 2 (p-1)/p n beta``: a reduce-scatter and an allgather of p-1 steps
  each, every step moving n/p bytes through every rank at once.
- tree: ``2 ceil(log2 p) alpha + 2 n beta``: a pipelined double binary tree (NCCL's tree;
  Sanders, Speck and Träff 2009), reduce up then broadcast down, ceil(log2 p) levels each way,
  in the limit of many pipeline chunks (their fill is left out); each rank receives and sends
  about n bytes each way.
- hierarchical (hpdl's HierarchicalCommunicator; Horovod's hierarchical allreduce): a
  reduce-scatter among the g ranks of a node, an allreduce of the n/g shard among the N nodes
  (the g local ranks each run one, at once), an allgather in the node:
  ``2(g-1) alpha_intra + 2 (g-1)/g n beta_intra + 2(N-1) alpha_inter + 2 (N-1)/N (n/g) beta_inter``,
  which is ``ring(n, g, intra) + ring(n/g, N, inter)``; with N = 1 the second term is 0 and it
  is the ring among the node's ranks, exactly.

A flat algorithm (ring, tree) whose ranks span nodes crosses both levels; each of a ring's
steps is as slow as the slower level, so its time is the larger of the two levels' times (the
tree is taken alike, as NCCL's: a chain in the node, the tree between nodes). In the
hierarchical one the g concurrent inter-node allreduces share the node's NICs: beta_inter is
the share of one, ``g / (min(g, nics) x bandwidth)`` (with one NIC per rank, the NIC's own).

A level given by a measured curve answers both flat algorithms with the curve (what the library
measured, whatever algorithm it used), scaled to p by bus bandwidth (curves.py).
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import List, Tuple

from hpdl.profile.predict.curves import MeasuredCurve
from hpdl.profile.predict.network import AlphaBeta, Level, Network, NetworkSpecError
from hpdl.profile.predict.presets import INTER, INTRA, PRESETS

__all__ = ["ALGORITHMS", "AlgorithmError", "Placement", "AllreduceCost", "ring_allreduce_time",
           "tree_allreduce_time", "hierarchical_allreduce_time", "check_allreduce", "allreduce_cost"]

# "auto" is the cheapest of the others by this model, message by message.
ALGORITHMS = ("ring", "tree", "hierarchical", "auto")


class AlgorithmError(ValueError):
    """An algorithm that is unknown or cannot run on a placement; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """How a job's ranks sit on nodes: ``ranks`` in all, filling nodes of ``ranks_per_node``
    in order; ``nics_per_node`` network adapters each node's ranks share between nodes."""

    ranks: int
    ranks_per_node: int
    nics_per_node: int = 1

    def __post_init__(self) -> None:
        for name in ("ranks", "ranks_per_node", "nics_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")

    @property
    def nodes(self) -> int:
        """Nodes in use: the last may hold fewer ranks than the others."""
        return -(-self.ranks // self.ranks_per_node)

    @property
    def ranks_on_node(self) -> int:
        """The ranks of a full node (of the only one, when the job fits in one)."""
        return min(self.ranks, self.ranks_per_node)

    @property
    def even(self) -> bool:
        """Whether every node holds the same number of ranks."""
        return self.ranks % self.ranks_on_node == 0

    def levels_used(self) -> Tuple[str, ...]:
        """The levels an allreduce over these ranks crosses."""
        return tuple(name for name, used in ((INTRA, self.ranks_on_node > 1), (INTER, self.nodes > 1)) if used)

    def describe(self) -> str:
        nics = f", {self.nics_per_node} NICs per node" if self.nics_per_node > 1 else ""
        return f"{self.ranks} ranks on {self.nodes} node(s) of {self.ranks_on_node}{nics}"


@dataclasses.dataclass(frozen=True)
class AllreduceCost:
    """One allreduce's predicted seconds, the algorithm costed (auto resolved), and what was
    assumed: lines that depend on the network, the placement and the algorithm, not on the
    size, so that a prediction can show each once."""

    seconds: float
    algorithm: str
    assumptions: Tuple[str, ...]


def ring_allreduce_time(nbytes: float, ranks: int, alpha: float, beta: float) -> float:
    """Return ``2(p-1) alpha + 2 (p-1)/p n beta``: a ring allreduce (0 at one rank)."""
    return 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * nbytes * beta


def tree_allreduce_time(nbytes: float, ranks: int, alpha: float, beta: float) -> float:
    """Return ``2 ceil(log2 p) alpha + 2 n beta``: a pipelined double binary tree (0 at one rank)."""
    if ranks == 1:
        return 0.0
    return 2 * math.ceil(math.log2(ranks)) * alpha + 2 * nbytes * beta


def hierarchical_allreduce_time(nbytes: float, nodes: int, ranks_per_node: int, intra_alpha: float,
                                intra_beta: float, inter_alpha: float, inter_beta: float) -> float:
    """Return reduce-scatter and allgather among a node's g ranks plus an allreduce of n/g among N nodes.

    ``inter_beta`` is seconds per byte of each rank's own inter-node stream (the share of its NIC).
    """
    g = ranks_per_node
    return (ring_allreduce_time(nbytes, g, intra_alpha, intra_beta)
            + ring_allreduce_time(nbytes / g, nodes, inter_alpha, inter_beta))


def check_allreduce(network: Network, placement: Placement, algorithm: str) -> None:
    """Refuse, before any costing, what :func:`allreduce_cost` could not answer for this placement.

    Raises:
        AlgorithmError: an unknown algorithm, or hierarchical on nodes of unequal rank counts.
        NetworkSpecError: the network lacks a level the placement crosses.
    """
    if algorithm not in ALGORITHMS:
        raise AlgorithmError(f"unknown allreduce algorithm {algorithm!r}; algorithms: {', '.join(ALGORITHMS)}")
    if algorithm == "hierarchical" and not placement.even:
        raise AlgorithmError(
            f"hierarchical allreduce needs the same number of ranks on every node: {placement.ranks} ranks at "
            f"{placement.ranks_per_node} per node leave {placement.ranks % placement.ranks_per_node} on the last "
            "(hpdl then reduces through node leaders, which this model does not cost)")
    for name in placement.levels_used():
        if network.level(name) is None:
            why = "several ranks share a node" if name == INTRA else "the ranks span several nodes"
            raise NetworkSpecError(
                f"the network has no {name} level, which {placement.describe()} need ({why}); add {name}=PRESET, "
                f"{name}=LABEL:BANDWIDTH:LATENCY or {name}=measured:FILE; presets: {', '.join(PRESETS)}")


def allreduce_cost(network: Network, placement: Placement, nbytes: float, algorithm: str = "auto",
                   extrapolate: bool = False) -> AllreduceCost:
    """Return the predicted time of one allreduce of ``nbytes`` over ``placement``'s ranks.

    Args:
        network: the levels (network.parse_network).
        placement: the ranks, ranks per node and NICs per node.
        nbytes: the message (a fused buffer's bytes).
        algorithm: one of ``ALGORITHMS``; ``auto`` takes the cheapest by this model.
        extrapolate: let a measured curve answer sizes outside its range (said in the assumptions).

    Raises:
        AlgorithmError, NetworkSpecError: as :func:`check_allreduce`.
        curves.CurveError: a size outside a curve's range, without ``extrapolate``.
    """
    check_allreduce(network, placement, algorithm)
    if nbytes < 0:
        raise ValueError(f"an allreduce of {nbytes} bytes")
    if placement.ranks == 1:
        return AllreduceCost(0.0, "none", ("one rank: an allreduce moves nothing and costs 0 s",))
    if algorithm != "auto":
        seconds, notes = _COSTS[algorithm](network, placement, nbytes, extrapolate)
        return AllreduceCost(seconds, algorithm, notes + _level_notes(network, placement))
    candidates = [a for a in ALGORITHMS if a != "auto" and (a != "hierarchical" or placement.even)]
    costs = {a: _COSTS[a](network, placement, nbytes, extrapolate) for a in candidates}
    chosen = min(candidates, key=lambda a: costs[a][0])  # the first of equals: ring before the others
    skipped = "" if placement.even else " (not hierarchical: the nodes hold unequal rank counts)"
    auto = (f"auto: the cheapest of {', '.join(candidates)} by this model, message by message{skipped}; "
            "a library picks by its own tuning, so this is the model's best case")
    seconds, notes = costs[chosen]
    return AllreduceCost(seconds, chosen, (auto,) + notes + _level_notes(network, placement))


def _flat(kind: str):
    """The cost of a flat algorithm (ring or tree): the slowest of the levels its ranks cross."""
    formula = ring_allreduce_time if kind == "ring" else tree_allreduce_time

    def cost(network: Network, placement: Placement, nbytes: float, extrapolate: bool) -> Tuple[float, Tuple[str, ...]]:
        p, used = placement.ranks, placement.levels_used()
        notes: List[str] = []
        times = [_level_time(name, network.level(name), formula, nbytes, p, extrapolate, notes) for name in used]
        if kind == "ring":
            note = (f"ring over {placement.describe()}: 2(p-1) = {2 * (p - 1)} steps of n/p bytes, "
                    f"2(p-1)/p n through each rank")
        else:
            note = (f"tree (pipelined double binary tree) over {placement.describe()}: 2 ceil(log2 p) = "
                    f"{2 * math.ceil(math.log2(p))} steps of latency, 2n bytes through each rank")
        if len(used) > 1:
            note += "; each step as slow as the slower level (intra, inter), the node's ring or tree crossing one NIC"
        return max(times), (note, *notes)

    return cost


def _hierarchical(network: Network, placement: Placement, nbytes: float,
                  extrapolate: bool) -> Tuple[float, Tuple[str, ...]]:
    g, nodes = placement.ranks_on_node, placement.nodes
    # The g local ranks run their inter-node allreduces at once, over min(g, nics) NICs.
    adapters = min(g, placement.nics_per_node)
    share = g / adapters
    notes: List[str] = []
    inside = _level_time(INTRA, network.intra, ring_allreduce_time, nbytes, g, extrapolate, notes) if g > 1 else 0.0
    across = 0.0
    if nodes > 1:
        inter = network.inter
        if isinstance(inter, AlphaBeta):
            across = ring_allreduce_time(nbytes / g, nodes, inter.alpha, inter.beta * share)
        else:  # g shards of n/g through `adapters` NICs: as one allreduce of n/adapters on each
            across = _level_time(INTER, inter, ring_allreduce_time, nbytes / adapters, nodes, extrapolate, notes)
    if nodes == 1:
        note = f"hierarchical over {placement.describe()}: one node, so the ring among its ranks"
    else:
        note = (f"hierarchical over {placement.describe()}: reduce-scatter among a node's {g} rank(s), allreduce of "
                f"n/{g} among the {nodes} nodes, allgather in the node")
        if g > 1:
            note += f"; the {g} inter-node allreduces run at once over {adapters} NIC(s) per node"
    return inside + across, (note, *notes)


_COSTS = types.MappingProxyType({"ring": _flat("ring"), "tree": _flat("tree"), "hierarchical": _hierarchical})


def _level_time(name: str, level: Level, formula, nbytes: float, ranks: int, extrapolate: bool,
                notes: List[str]) -> float:
    """One level's time at ``ranks``: its formula, or its curve (noting an extrapolation in ``notes``)."""
    if isinstance(level, AlphaBeta):
        return formula(nbytes, ranks, level.alpha, level.beta)
    if extrapolate and level.outside(nbytes):
        notes.append(f"{name}: sizes above {level.sizes[-1]} B extrapolated from the curve, its largest size's "
                     "bandwidth held" if nbytes > level.sizes[-1] else
                     f"{name}: sizes below {level.sizes[0]} B extrapolated from the curve, its smallest size's "
                     "time taken")
    return level.time_at_ranks(nbytes, ranks, extrapolate)


def _level_notes(network: Network, placement: Placement) -> Tuple[str, ...]:
    """What each level used stands on: its figures, or its curve and how it was carried to p."""
    notes: List[str] = []
    for name in placement.levels_used():
        level = network.level(name)
        notes.append(f"{name}: {level.describe()}")
        if isinstance(level, MeasuredCurve):
            notes.append(f"{name}: the measured curve stands for the library's own algorithm (not the ring or tree "
                         f"formula), carried from {level.ranks} ranks to others by bus bandwidth, 2(p-1)/p; "
                         "its latency term is not rescaled, so it is underestimated at more ranks")
    return tuple(notes)
