"""Adasum, Horovod's adaptive summation, by recursive vector-halving and distance-doubling.

Two vectors combine as ``a' = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b`` (a coefficient is 1
where its vector's squared norm is below 1e-8): orthogonal vectors add, equal ones average.
The ranks of a power-of-two group combine in levels L = 1, 2, 4, ...: rank r pairs with
r ^ L; the left member (bit L clear) keeps the first half of its current piece of every tensor
and receives its partner's first half, the right member keeps the second halves. The vectors
being combined at level L are those of the left and right halves of each block of 2L ranks;
their pieces lie spread over that block, so the three dot products are summed over it. After
the last level every rank holds 1/size of the result, and an allgather assembles it.

Each tensor gets its own coefficients, as in Horovod's fused Adasum; all tensors of a batch
share each level's exchange and dot-product gather.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from hpdl.comm import Communicator

_NORM_FLOOR = 1e-8  # Horovod's: below it a vector's coefficient stays 1

Piece = Tuple[int, int]  # (offset, length) within a flattened tensor


def combine(a: torch.Tensor, b: torch.Tensor, dot: float, a_normsq: float, b_normsq: float) -> torch.Tensor:
    """Return the Adasum combination of ``a`` and ``b`` (in float64) given their full dot products."""
    a_coeff = 1.0 - dot / a_normsq * 0.5 if a_normsq >= _NORM_FLOOR else 1.0
    b_coeff = 1.0 - dot / b_normsq * 0.5 if b_normsq >= _NORM_FLOOR else 1.0
    return a.double() * a_coeff + b.double() * b_coeff


def _halve(piece: Piece, left: bool) -> Tuple[Piece, Piece]:
    """Split a piece into (kept, sent) halves; the left member keeps the first, smaller half."""
    offset, length = piece
    first = length >> 1
    if left:
        return (offset, first), (offset + first, length - first)
    return (offset + first, length - first), (offset, first)


def final_pieces(numel: int, size: int) -> List[Piece]:
    """Where each rank's piece of a ``numel``-element tensor lies after the last level."""
    out = []
    for rank in range(size):
        piece, level = (0, numel), 1
        while level < size:
            piece = _halve(piece, not rank & level)[0]
            level <<= 1
        out.append(piece)
    return out


def adasum_(comm: Communicator, tensors: Sequence[torch.Tensor]) -> None:
    """Replace every (contiguous, floating-point) tensor with the Adasum of all ranks' tensors.

    ``comm.size`` must be a power of two; the caller checks it.
    """
    size, rank = comm.size, comm.rank
    flats = [t.view(-1) for t in tensors]
    pieces: List[Piece] = [(0, f.numel()) for f in flats]
    level = 1
    while level < size:
        left = not rank & level
        halves = [_halve(piece, left) for piece in pieces]
        kept = [flat.narrow(0, *keep) for flat, (keep, _) in zip(flats, halves)]
        received = _exchange(comm, rank ^ level, [flat.narrow(0, *sent) for flat, (_, sent) in zip(flats, halves)],
                             [k.numel() for k in kept])
        # Orient every pair as (left group's vector, right group's vector) on both partners.
        pairs = [(mine, theirs) if left else (theirs, mine) for mine, theirs in zip(kept, received)]
        dots = _block_dot_products(comm, level, pairs)
        for mine, (a, b), (dot, a_normsq, b_normsq) in zip(kept, pairs, dots.tolist()):
            mine.copy_(combine(a, b, dot, a_normsq, b_normsq))
        pieces = [keep for keep, _ in halves]
        level <<= 1
    _assemble(comm, flats, pieces)


def _exchange(comm: Communicator, partner: int, outgoing: List[torch.Tensor], incoming: List[int]) -> List[torch.Tensor]:
    """Send ``outgoing`` to ``partner`` and receive pieces of the ``incoming`` lengths from it."""
    splits, recv_splits = [0] * comm.size, [0] * comm.size
    splits[partner], recv_splits[partner] = sum(t.numel() for t in outgoing), sum(incoming)
    data, _ = comm.alltoall(torch.cat(outgoing), splits, recv_splits)
    return list(torch.split(data, incoming))


def _block_dot_products(comm: Communicator, level: int, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """(a.b, |a|^2, |b|^2) per tensor, summed over this rank's block of 2 * ``level`` ranks."""
    partial = torch.tensor([[torch.dot(a.double(), b.double()).item(), torch.dot(a.double(), a.double()).item(),
                             torch.dot(b.double(), b.double()).item()] for a, b in pairs], dtype=torch.float64)
    gathered = comm.allgather(partial.reshape(1, -1), first_dims=[1] * comm.size).view(comm.size, len(pairs), 3)
    block = comm.rank // (2 * level) * (2 * level)
    return gathered[block:block + 2 * level].sum(0)


def _assemble(comm: Communicator, flats: List[torch.Tensor], pieces: List[Piece]) -> None:
    """Give every rank the whole result from each rank's final pieces."""
    mine = torch.cat([flat.narrow(0, *piece) for flat, piece in zip(flats, pieces)])
    layouts = [final_pieces(flat.numel(), comm.size) for flat in flats]  # per tensor, per rank
    lengths = [sum(layout[r][1] for layout in layouts) for r in range(comm.size)]
    gathered = comm.allgather(mine, first_dims=lengths)
    for r, chunk in enumerate(torch.split(gathered, lengths)):
        if r == comm.rank:
            continue
        parts = torch.split(chunk, [layout[r][1] for layout in layouts])
        for flat, layout, part in zip(flats, layouts, parts):
            flat.narrow(0, *layout[r]).copy_(part)
