"""One image upscaled by several ranks: ``hpdl run -np 4 -- hpdl sr upscale IN OUT --ckpt C --spatial``.

The one-process upscale computes the image in overlapping tiles (upscale.py: each tile's
window is its box extended by the receptive-field radius), row of tiles after row of tiles.
Here the rows of tiles are split into contiguous bands, one per rank, as evenly as possible
with the earlier bands larger (the spatial layers' rule, ``hpdl.torch.spatial.bands``),
and every rank computes its tiles exactly as the one process does: the same boxes and windows
(``upscale.tile_rows``), the same forward and quantisation. A convolution's result depends on
the extent of its input, not on which process computes it, so the output is the one process's
to the byte, whatever the number of ranks.

Rank 0 alone holds the image and the output (it read the one and writes the other, through the
command's own checks and writers); the ranks work in rounds: in round k, every rank computes
the k-th row of tiles of its band, from the input rows rank 0 sent it (its window rows, full
width), and sends the output rows to rank 0, which places them. Every exchange is an
``hvd.alltoall`` of the public API, in which a rank sends rows to rank 0 only or receives them
from it only. Every rank knows the image's size and the tiles, so all make the same calls in
the same order; a rank whose band is shorter takes part with no rows.

The rounds are not in lock step: the exchanges are asynchronous, and each rank keeps up to
``LOOKAHEAD`` rounds of them under way, the input rows of its next rounds on their way in and
the output rows of its last ones on their way out, while it computes. So a rank slowed for a
row of tiles (by another process on its cores, or rank 0 by its placing) catches up on the
next ones instead of holding every rank at each round; a rank waits only when it is
``LOOKAHEAD`` rounds ahead, or at the end for the last rank to finish. The other ranks hold the
input and output rows of at most ``LOOKAHEAD + 1`` rows of tiles at a time, so the input need
not be on their nodes and their memory does not grow with the image's height.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

import hpdl.torch as hvd
from hpdl.sr.models import receptive_field_radius
from hpdl.sr.inference import Tile, as_image, image_forward, run_tile, tile_progress, tile_rows
from hpdl.torch.spatial import bands

__all__ = ["LOOKAHEAD", "MAX_MESSAGE_BYTES", "idle_ranks", "upscale_image_in_bands"]

# Bytes one alltoall moves at most; larger rounds go in several. MPI counts and displacements
# are 32-bit integers, so a message must stay well under 2 GiB.
MAX_MESSAGE_BYTES = 256 * 2**20
# Rounds of exchanges a rank keeps under way while it computes (the rows of tiles it may run
# ahead of the slowest rank); each holds a row of tiles' input and output rows.
LOOKAHEAD = 2


def idle_ranks(h: int, tile: int, size: int) -> int:
    """How many of ``size`` ranks get no row of tiles of an image ``h`` rows high."""
    return max(0, size - -(-h // tile))


@torch.no_grad()
def upscale_image_in_bands(model: nn.Module, image: Optional[np.ndarray], shape: Tuple[int, int], scale: int, *,
                           tile: int, ensemble: bool = False, progress: bool = False) -> Optional[np.ndarray]:
    """Super-resolve a uint8 ``(h, w, 3)`` image on every rank of the job; return it on rank 0.

    Collective: every rank calls it with the same model weights, ``shape`` (the image's
    ``(h, w)``), ``scale``, ``tile`` and ``ensemble``. ``image`` is the image on rank 0 (None
    elsewhere); the result is ``upscale_image(model, image, tile=tile, ensemble=ensemble)``'s,
    byte for byte, on rank 0 and None elsewhere. ``progress``: a bar over all ranks' tiles
    on rank 0 (it learns of the other ranks' tiles as their rows arrive).
    """
    rank, size = hvd.rank(), hvd.size()
    h, w = shape
    rows = tile_rows(h, w, tile, receptive_field_radius(model))
    mine = bands(len(rows), size)  # the rows of tiles of every rank
    rounds = max(stop - start for start, stop in mine)
    forward = image_forward(model, ensemble)
    out = np.empty((h * scale, w * scale, 3), dtype=np.uint8) if rank == 0 else None

    def at(k: int) -> List[Optional[int]]:
        """The k-th row of tiles of every rank's band (None past the end of a shorter band)."""
        return [start + k if start + k < stop else None for start, stop in mine]

    def send_inputs(k: int) -> "_Rows":
        return _scatter_rows(image, [_window_rows(rows[i]) if i is not None else (0, 0) for i in at(k)], (w, 3),
                             rank, f"upscale.rows_in.{k}")

    with tile_progress(sum(map(len, rows)), progress and rank == 0) as bar:

        def arrived(k: int, outputs: "_Rows") -> None:
            gathered = outputs.result()
            if rank == 0:
                _place(out, gathered, at(k), rows, scale)
                bar.update(sum(len(rows[i]) for r, i in enumerate(at(k)) if i is not None and r != 0))

        inputs = deque(send_inputs(k) for k in range(min(LOOKAHEAD, rounds)))
        outputs: Deque[Tuple[int, _Rows]] = deque()
        for k in range(rounds):
            received = inputs.popleft().result()
            if k + LOOKAHEAD < rounds:
                inputs.append(send_inputs(k + LOOKAHEAD))
            row = at(k)[rank]
            if row is not None:
                output = _upscale_row(forward, received, rows[row], _window_rows(rows[row])[0], scale, bar.update)
            else:
                output = np.empty((0, w * scale, 3), dtype=np.uint8)
            counts = [_box_rows(rows[i], scale) if i is not None else 0 for i in at(k)]
            outputs.append((k, _gather_rows(output, counts, (w * scale, 3), rank, f"upscale.rows_out.{k}")))
            if len(outputs) > LOOKAHEAD:
                arrived(*outputs.popleft())
        while outputs:
            arrived(*outputs.popleft())
    return out


def _window_rows(row: List[Tile]) -> Tuple[int, int]:
    """The image rows a row of tiles reads: its windows' (all tiles of a row share them)."""
    ya, yb, _, _ = row[0].window
    return ya, yb


def _box_rows(row: List[Tile], scale: int) -> int:
    """The output rows a row of tiles gives."""
    y0, y1, _, _ = row[0].box
    return (y1 - y0) * scale


def _upscale_row(forward, received: np.ndarray, row: List[Tile], first_row: int, scale: int,
                 tile_done: Callable[[int], object]) -> np.ndarray:
    """The output rows of one row of tiles, from the image rows ``received`` (from ``first_row`` on);
    ``tile_done(1)`` after each tile."""
    lr = torch.from_numpy(received).permute(2, 0, 1).unsqueeze(0)  # a uint8 view, as upscale_image's
    y0, y1, _, _ = row[0].box
    out = np.empty(((y1 - y0) * scale, received.shape[1] * scale, 3), dtype=np.uint8)
    for t in row:
        s, piece = run_tile(forward, lr, t, first_row)
        _, _, x0, x1 = t.box
        out[:, x0 * s : x1 * s] = as_image(piece)
        tile_done(1)
    return out


def _place(out: np.ndarray, gathered: np.ndarray, at: Sequence[Optional[int]], rows: List[List[Tile]],
           scale: int) -> None:
    """Put the rows of tiles gathered on rank 0 (in rank order) where they belong in ``out``."""
    offset = 0
    for i in at:
        if i is None:
            continue
        y0 = rows[i][0].box[0] * scale
        count = _box_rows(rows[i], scale)
        out[y0 : y0 + count] = gathered[offset : offset + count]
        offset += count


class _Rows:
    """Rows on their way: the asynchronous alltoalls of one exchange, and what makes their result."""

    def __init__(self, handles: List[Any], keep: List[Any], finish: Callable[[List[Any]], np.ndarray]) -> None:
        self.handles, self.keep, self.finish = handles, keep, finish  # keep: the buffers sent, until sent

    def result(self) -> np.ndarray:
        """Wait for the rows and return them."""
        done = [hvd.synchronize(handle) for handle in self.handles]
        self.keep = []
        return self.finish(done)


def _scatter_rows(image: Optional[np.ndarray], windows: Sequence[Tuple[int, int]], row_shape: Tuple[int, ...],
                  rank: int, name: str) -> _Rows:
    """Start sending every rank its rows ``windows[r]`` of rank 0's ``image`` (in chunks of at most
    ``MAX_MESSAGE_BYTES``); the result is this rank's rows."""
    counts = [b - a for a, b in windows]
    chunk = _chunk_rows(row_shape, len(windows))
    handles, keep = [], []
    for start in range(0, max(counts), chunk):
        spans = [(a + min(start, n), a + min(start + chunk, n)) for (a, _), n in zip(windows, counts)]
        if rank == 0:
            send = np.concatenate([image[a:b] for a, b in spans]) if image is not None else None
            splits = [b - a for a, b in spans]
        else:
            send, splits = np.empty((0,) + tuple(row_shape), dtype=np.uint8), [0] * len(windows)
        tensor = torch.from_numpy(np.ascontiguousarray(send))
        keep.append(tensor)
        handles.append(hvd.alltoall_async(tensor, splits, name=f"{name}.{start}"))

    def finish(done: List[Any]) -> np.ndarray:
        pieces = [received.numpy() for received, _ in done]
        if not pieces:
            return np.empty((0,) + tuple(row_shape), dtype=np.uint8)
        return np.concatenate(pieces) if len(pieces) != 1 else pieces[0]

    return _Rows(handles, keep, finish)


def _gather_rows(rows: np.ndarray, counts: Sequence[int], row_shape: Tuple[int, ...], rank: int, name: str) -> _Rows:
    """Start sending every rank's ``rows`` (``counts[r]`` of them on rank r) to rank 0, in chunks of at
    most ``MAX_MESSAGE_BYTES``; the result is them all in rank order on rank 0 (empty elsewhere)."""
    size = len(counts)
    chunk = _chunk_rows(row_shape, size)
    handles, keep = [], []
    for start in range(0, max(counts), chunk):
        mine = torch.from_numpy(np.ascontiguousarray(rows[start : start + chunk]))
        keep.append(mine)
        handles.append(hvd.alltoall_async(mine, [len(mine)] + [0] * (size - 1), name=f"{name}.{start}"))

    def finish(done: List[Any]) -> np.ndarray:
        pieces: List[List[np.ndarray]] = [[] for _ in range(size)]
        for received, got in done:
            for r, piece in enumerate(torch.split(received, got.tolist() if torch.is_tensor(got) else list(got))):
                pieces[r].append(piece.numpy())
        flat = [p for per_rank in pieces for p in per_rank]
        return np.concatenate(flat) if flat else np.empty((0,) + tuple(row_shape), dtype=np.uint8)

    return _Rows(handles, keep, finish)


def _chunk_rows(row_shape: Tuple[int, ...], ranks: int) -> int:
    """Rows per rank in one alltoall, so that rank 0 sends or receives at most ``MAX_MESSAGE_BYTES``."""
    row_bytes = int(np.prod(row_shape))
    return max(1, MAX_MESSAGE_BYTES // (row_bytes * ranks))
