"""What the ranks of a spatial group must agree on, compared across the group before any
halo moves, and refused on every rank alike, in one line, where some rank differs.

- The wrapping (:func:`on_wrapping`, when SpatialParallel is made): the grid, the loss
  reduction, the checkpointed blocks and the model's structure. Another grid pairs the halo
  exchanges wrongly; another model or reduction gives other gradients.
- Each forward's inputs (:func:`on_inputs`): the part's image size, batch, type, device, mode
  and graph (a rank with another size would wait for ever in the first halo exchange, one
  whose backward exchanges other halos would pair them wrongly), the image's content and the
  further inputs' (a mask, a class label: fingerprint.py), and the tensors scattered since the
  last check that are no input of the model (a loss's target), and the model's parameters (a
  rank not broadcast to, stepped by a plain optimizer, or that loaded a checkpoint alone).
  Another content computes a silently wrong result.
- At the start of each backward (:func:`on_later_scatters`, run by :func:`first_gradient_of`):
  the tensors scattered between the forward and its backward (a target scattered after it),
  before any gradient moves.
- Which collective call of the group each rank makes (:func:`on_call`, first in each forward,
  backward, ``net.gather`` and ``net.whole_mean``): the group's collectives pair by order, not
  by name, so a call made on some ranks only (``net.gather(y)`` under ``if hvd.rank() == 0:``)
  would pair with the others' next one, another call, and both would compute on each other's
  numbers (a logged loss silently wrong, then a misleading error, or a wait for ever). Each
  such call first gathers a fixed row naming it, which pairs alike whatever the call.
"""

from __future__ import annotations

import itertools
import math
import zlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from hpdl.torch.spatial import fingerprint
from hpdl.torch.spatial.comm import GroupComm
from hpdl.torch.spatial.geometry import Grid, Part, SpatialError
from hpdl.torch.spatial.parts import part_of


# The group's collective calls a user makes, which every rank of the group must make in the same
# order; a call's number in on_call's row is its place here, plus one.
CALLS = {"forward": "the model's forward", "backward": "the start of a backward", "gather": "net.gather",
         "whole_mean": "net.whole_mean"}
_CALL_NAMES = list(CALLS)


def on_call(comm: GroupComm, call: str, values: int = 0) -> None:
    """Refuse, on every rank of the group alike, a collective ``call`` (a key of CALLS) that
    another rank of the group does not make now: it made another call, or the same call on a
    map of other ``values`` (the number of values a gather returns)."""
    rows = comm.allgather(torch.tensor([[_CALL_NAMES.index(call) + 1, values]], dtype=torch.int64), [1] * comm.size,
                          "calls").tolist()
    if all(row == rows[0] for row in rows):
        return
    described = "; ".join(f"group rank {r}: {_call_text(code, count)}" for r, (code, count) in enumerate(rows))
    raise SpatialError(f"the ranks of the spatial group made different calls ({described}): the model's forward and "
                       "backward, net.gather and net.whole_mean are collective over the group, so every rank of the "
                       "group makes them, in the same order (not under `if hvd.rank() == 0:`)")


def _call_text(code: int, values: int) -> str:
    name = CALLS[_CALL_NAMES[code - 1]] if 0 < code <= len(_CALL_NAMES) else f"an unknown call ({code})"
    return name + (f" of {values} values" if values else "")


def _model_code(module: nn.Module) -> int:
    """A number for the model's structure (its modules' paths and types, its parameters' and
    buffers' names, shapes and types), the same on every rank that wraps the same model."""
    text = "\n".join([f"{name}:{type(m).__qualname__}" for name, m in module.named_modules()]
                     + [f"{name}:{tuple(t.shape)}:{t.dtype}"
                        for name, t in itertools.chain(module.named_parameters(), module.named_buffers())])
    return zlib.crc32(text.encode())


def on_wrapping(comm: GroupComm, grid: Grid, loss_reduction: str, loss_reductions: Sequence[str],
                blocks: Sequence[str], module: nn.Module) -> None:
    """Refuse, on every rank of the group alike, a wrapper made differently on some rank: another
    grid pairs the halo exchanges wrongly (a rank would compute on a wrong halo, or wait for one
    that never comes), another loss reduction or model gives other gradients, another set of
    checkpointed blocks other exchanges in backward."""
    if comm.size == 1:
        return
    mine = [grid.rows, grid.cols, loss_reductions.index(loss_reduction), len(blocks),
            zlib.crc32("\n".join(blocks).encode()), sum(p.numel() for p in module.parameters()), _model_code(module)]
    rows = comm.allgather(torch.tensor([mine], dtype=torch.int64), [1] * comm.size, "wrapping").tolist()
    if all(row == rows[0] for row in rows):
        return
    # Each field of a row: its columns, and how a rank's value reads.
    fields = [(0, 2, lambda row: f"grid ({row[0]}, {row[1]})"),
              (2, 3, lambda row: f"loss_reduction {loss_reductions[row[2]]!r}"),
              (3, 5, lambda row: f"{row[3]} checkpointed blocks ({row[4]:08x})"),
              (5, 7, lambda row: f"a model of {row[5]} parameters (structure {row[6]:08x})")]
    differing = [(a, b, text) for a, b, text in fields if any(row[a:b] != rows[0][a:b] for row in rows)]
    described = "; ".join(f"group rank {r}: " + ", ".join(text(row) for _a, _b, text in differing)
                          for r, row in enumerate(rows))
    raise SpatialError(f"the ranks of the spatial group made SpatialParallel differently ({described}): every rank "
                       "of the group must make it alike: the same model (its modules, and its parameters' shapes and "
                       "types), grid, checkpoint and loss_reduction")


def on_inputs(comm: GroupComm, x: torch.Tensor, part: Part, training: bool,
              further: Sequence[Tuple[str, torch.Tensor]], later: Sequence[Optional[torch.Tensor]], base: int,
              parameters: Sequence[Tuple[str, torch.Tensor]]) -> int:
    """Refuse a forward whose inputs differ between the ranks: ``x`` (this rank's part) and
    its image's fingerprint, the ``further`` inputs (:func:`further_inputs`), ``later``, the
    fingerprints of what this rank scattered that the forward does not take, and the model's
    ``parameters`` (named). Returns rank 0's ``base`` (the forward's base for the random
    streams), gathered with the rest."""
    lead = list(x.shape[:-2])[:_LEAD_DIMS]
    mine = [part.height, part.width, x.dim(), *(lead + [-1] * (_LEAD_DIMS - len(lead))),
            math.prod(x.shape[:-2]), _code(x.dtype), _code(x.device.type), int(training),
            int(torch.is_grad_enabled()), int(x.requires_grad), len(further), len(later)]
    prints_mine = fingerprint.numbers(x) + fingerprint.of_further_inputs(
        [t for _, t in further], lambda t: part_of(t) is not None)
    later_prints = fingerprint.slots([fingerprint.listed(f) for f in later])
    content = torch.tensor(prints_mine + later_prints, dtype=torch.float64).view(torch.int64).tolist()
    parameter_prints = fingerprint.of_parameters([p for _, p in parameters])
    held = fingerprint.summary(parameter_prints)
    gathered = comm.allgather(torch.tensor([mine + content + held + [base]], dtype=torch.int64), [1] * comm.size,
                              "inputs")
    rows = gathered[:, :len(mine)].tolist()
    if any(row[-1] != rows[0][-1] for row in rows):
        raise SpatialError(_scattered_counts_text([row[-1] for row in rows], "before this forward"))
    if any(row != rows[0] for row in rows):
        described = "; ".join(f"group rank {r}: {_input_text(row)}" for r, row in enumerate(rows))
        raise SpatialError(f"the ranks of the spatial group got different inputs ({described}): every rank of "
                           "the group must pass net.scatter(x) of the same x, and the same further inputs, in "
                           "the same grad mode")
    prints = gathered[:, len(mine):len(mine) + len(content)].contiguous().view(torch.float64).tolist()
    inputs = len(prints_mine)
    differing = _first_differing([p[:inputs] for p in prints])
    if differing is not None:
        raise SpatialError(_other_content(*differing, [name for name, _ in further]))
    _refuse_other_scatters([p[inputs:] for p in prints], "before this forward")
    summaries = gathered[:, -1 - len(held):-1].tolist()
    if any(s != summaries[0] for s in summaries):
        _refuse_other_parameters(comm, parameter_prints, [name for name, _ in parameters])
    return int(gathered[0, -1])


def _refuse_other_parameters(comm: GroupComm, prints: Sequence[int], names: Sequence[str]) -> None:
    """Every rank found that some rank holds other parameters (the same gathered summaries):
    gather each parameter's fingerprint to name the first that differs, and refuse."""
    everyone = comm.allgather(torch.tensor([list(prints)], dtype=torch.int64), [1] * comm.size,
                              "parameters").tolist()
    for index, name in enumerate(names):
        others = [r for r, row in enumerate(everyone) if row[index] != everyone[0][index]]
        if others:
            break
    else:  # the same values in other places: the summary weighs them by place
        name, others = "their order", [r for r, row in enumerate(everyone) if row != everyone[0]]
    raise SpatialError(f"the ranks of the spatial group hold different parameters: {_ranks_text(others)} other values "
                       f"than group rank 0 in {name}: every rank of the group must compute with the same model: "
                       "broadcast it from one rank after making or loading it (hvd.broadcast_parameters("
                       "net.state_dict(), root_rank=0)), and update it with hvd.DistributedOptimizer, which sums "
                       "the group's gradients (a plain optimizer steps each rank with its own part's)")


def on_later_scatters(comm: GroupComm, later: Sequence[Optional[torch.Tensor]]) -> None:
    """Refuse when the ranks scattered different tensors (``later``: their fingerprints)
    between a forward and the start of its backward."""
    content = fingerprint.slots([fingerprint.listed(f) for f in later])
    row = [len(later)] + torch.tensor(content, dtype=torch.float64).view(torch.int64).tolist()
    gathered = comm.allgather(torch.tensor([row], dtype=torch.int64), [1] * comm.size, "scattered tensors")
    counts = gathered[:, 0].tolist()
    if any(c != counts[0] for c in counts):
        raise SpatialError(_scattered_counts_text(counts, "between the forward and its backward"))
    _refuse_other_scatters(gathered[:, 1:].contiguous().view(torch.float64).tolist(),
                           "between the forward and its backward")


_LEAD_DIMS = 3  # the dimensions before the image's that the group compares one by one
_CODES: Dict[Any, int] = {}


def _code(value: Any) -> int:
    """A number for a dtype or device type, the same on every rank (the order of a fixed list)."""
    if not _CODES:
        known = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
                 torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, "cpu", "cuda", "meta"]
        _CODES.update({k: i for i, k in enumerate(known)})
    return _CODES.get(value, len(_CODES))


def further_inputs(args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Tuple[str, torch.Tensor]]:
    """The model's tensor inputs besides the image, named as the forward's call writes them
    (``argument 2``, ``keyword argument mask``), in an order every rank lists alike:
    positional, then keyword arguments by name; inside lists, tuples and dicts too."""
    found = [named for i, value in enumerate(args) for named in _tensors_in(f"argument {i + 2}", value)]
    return found + [named for key in sorted(kwargs) for named in _tensors_in(f"keyword argument {key}", kwargs[key])]


def _tensors_in(name: str, value: Any) -> Iterator[Tuple[str, torch.Tensor]]:
    """The tensors in ``value`` (a tensor, or lists, tuples and dicts of them), with their names."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors_in(f"{name}[{i}]", item)
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _tensors_in(f"{name}[{key!r}]", value[key])


def first_gradient_of(out: Any, action: Callable[[], None]) -> None:
    """Run ``action`` once, when the backward first reaches any tensor of the forward's
    ``out`` that requires a gradient (before the model's own backward, which follows it)."""
    due = [True]

    def hook(grad: torch.Tensor) -> None:
        if due[0]:
            due[0] = False
            action()

    for _name, tensor in _tensors_in("output", out):
        if tensor.requires_grad:
            tensor.register_hook(hook)


def _ranks_text(others: Sequence[int]) -> str:
    return f"group rank{'s' if len(others) > 1 else ''} {', '.join(str(r) for r in others)} " \
           f"{'have' if len(others) > 1 else 'has'}"


def _scattered_counts_text(counts: Sequence[int], when: str) -> str:
    each = ", ".join(f"group rank {r}: {c}" for r, c in enumerate(counts))
    return (f"the ranks of the spatial group scattered different numbers of tensors besides the model's inputs "
            f"{when} ({each}): every rank of the group must scatter the same tensors (the loss's target), in the "
            "same order")


def _first_differing(prints: Sequence[Sequence[float]]) -> Optional[Tuple[int, List[int]]]:
    """The first slot (SIZE numbers) of the ranks' ``prints`` where some rank differs from
    rank 0, and those ranks; None where all agree."""
    size = fingerprint.SIZE
    for slot in range(len(prints[0]) // size):
        others = fingerprint.differing([p[slot * size:(slot + 1) * size] for p in prints])
        if others:
            return slot, others
    return None


def _refuse_other_scatters(prints: Sequence[Sequence[float]], when: str) -> None:
    """Refuse when some rank scattered, besides the model's inputs, a tensor with other values
    than group rank 0 (``prints``: each rank's :func:`fingerprint.slots`)."""
    differing = _first_differing(prints)
    if differing is None:
        return
    slot, others = differing
    which = f"the {_ordinal(slot + 1)} of them" if slot < fingerprint.FURTHER_SLOTS else \
        f"one of them after the {_ordinal(fingerprint.FURTHER_SLOTS)}"
    raise SpatialError(
        f"the ranks of the spatial group scattered different tensors besides the model's inputs {when} "
        f"(a loss's target): in {which}, {_ranks_text(others)} other values than group rank 0: every rank "
        "of the group must scatter the same tensors (the same sample, crop and augmentation)")


def _ordinal(n: int) -> str:
    return {1: "first", 2: "second", 3: "third", 4: "fourth", 5: "fifth"}.get(n, f"{n}th")


def _other_content(slot: int, others: Sequence[int], names: Sequence[str]) -> str:
    """The refusal for ranks whose input (slot 0: the image; then the further inputs) has other
    values than group rank 0's."""
    ranks = _ranks_text(others)
    if slot == 0:
        return (f"the ranks of the spatial group scattered different images of the same size: {ranks} other pixels "
                f"than group rank 0: every rank of the group must pass net.scatter(x) of the same x (the same "
                "sample of the data set, the same crop and augmentation: seed the group's data loading alike, and "
                "step through it together)")
    index = slot - 1
    what = names[index] if index < fingerprint.FURTHER_SLOTS else \
        f"one of the inputs after {names[fingerprint.FURTHER_SLOTS - 1]}"
    return (f"the ranks of the spatial group passed the model different further inputs: {ranks} other values in "
            f"{what} than group rank 0: every rank of the group must pass the same ones (net.scatter of the same "
            "map, or the same whole tensor)")


def _input_text(row: List[int]) -> str:
    names = {i: k for k, i in _CODES.items()}
    height, width = row[0], row[1]
    lead = [d for d in row[3:3 + _LEAD_DIMS] if d >= 0]
    dtype, device, training, grad_mode, needs_grad = row[4 + _LEAD_DIMS:9 + _LEAD_DIMS]
    dtype_name = str(names.get(dtype, "?")).replace("torch.", "")
    further = row[9 + _LEAD_DIMS]
    further_text = f", and {further} further tensor input{'s' if further > 1 else ''}" if further else ""
    return (f"a part of a {height} x {width} image with leading dimensions {lead}, {dtype_name} on "
            f"{names.get(device, '?')}{'' if training else ', eval mode'}{'' if grad_mode else ', under no_grad'}"
            f"{', requiring grad' if needs_grad else ''}{further_text}")
