"""A spatial group simulated in one process: each rank a thread, the halo exchanges and the
group's collectives through queues. For checking every operation of the op table on every
dimension and both grid directions against one process, quickly and without a launcher; the
real communicators are checked by the multi-rank tests.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hpdl.torch.spatial import dispatch
from hpdl.torch.spatial.context import Context
from hpdl.torch.spatial.geometry import Grid, Part, SpatialError
from hpdl.torch.spatial.parallel import check_split
from hpdl.torch.spatial.parts import channels_last_part_of, flattened_part_of, part_of, tagged

_WAIT_S = 20.0


class _Shared:
    def __init__(self, size: int):
        self.size = size
        self.mail: Dict[Tuple[int, int], "queue.Queue[torch.Tensor]"] = {
            (a, b): queue.Queue() for a in range(size) for b in range(size)}
        self.barrier = threading.Barrier(size)
        self.slots: List[Any] = [None] * size
        self.failed = threading.Event()  # a rank raised: the others stop waiting for it


class ThreadGroupComm:
    """What the spatial layers use of a GroupComm, between threads."""

    def __init__(self, shared: _Shared, rank: int):
        self.shared, self.rank, self.size = shared, rank, shared.size
        self.communicating = True

    def exchange(self, sends, receives, label: str) -> None:
        for peer, tensor in sends:
            self.shared.mail[(self.rank, peer)].put(tensor.detach().clone())
        for peer, tensor in receives:
            tensor.copy_(self._receive(peer))

    def _receive(self, peer: int) -> torch.Tensor:
        box = self.shared.mail[(peer, self.rank)]
        for _ in range(int(_WAIT_S / 0.05)):
            try:
                return box.get(timeout=0.05)
            except queue.Empty:
                if self.shared.failed.is_set():
                    raise RuntimeError(f"rank {peer} failed; rank {self.rank} stops waiting for it") from None
        raise TimeoutError(f"rank {self.rank} waited {_WAIT_S} s for rank {peer}")

    def _everyone(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        self.shared.slots[self.rank] = tensor.detach().clone()
        self.shared.barrier.wait(_WAIT_S)
        out = list(self.shared.slots)
        self.shared.barrier.wait(_WAIT_S)
        return out

    def allreduce_sum(self, tensor: torch.Tensor, label: str) -> torch.Tensor:
        total = torch.stack(self._everyone(tensor)).sum(0)
        tensor.copy_(total)
        return tensor

    def allgather(self, tensor: torch.Tensor, first_dims, label: str) -> torch.Tensor:
        return torch.cat(self._everyone(tensor.contiguous()))


class _Call(torch.nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], Any]):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> Any:
        return self.fn(x)


class Outcome:
    """One rank's result: a value, or the error it raised."""

    def __init__(self, value: Any = None, error: Optional[BaseException] = None, grad: Optional[torch.Tensor] = None):
        self.value, self.error, self.grad = value, error, grad


def run_parts(grid: Tuple[int, int], fn: Callable[[torch.Tensor], Any], x: torch.Tensor,
              backward: bool = False) -> List[Outcome]:
    """Run ``fn`` on every rank's part of ``x`` (threads, one per rank) under the spatial mode;
    with ``backward``, also the gradient of the sum of every tensor output (weighted, so that
    it is not uniform) with respect to the part."""
    g = Grid(*grid)
    shared = _Shared(g.size)
    outcomes: List[Optional[Outcome]] = [None] * g.size

    def rank_main(rank: int) -> None:
        part = Part(g, rank, x.shape[-2], x.shape[-1])
        (r0, r1), (c0, c1) = part.rows, part.cols
        mine = x[..., r0:r1, c0:c1].detach().clone()
        if backward:
            mine.requires_grad_()
        tagged(mine, part)
        ctx = Context(g, rank, ThreadGroupComm(shared, rank), {}, random_base=1234)
        try:
            with dispatch.running(ctx):
                value = fn(mine)
            if any(flattened_part_of(t) is not None for t in _flat(value)):
                # As SpatialParallel refuses a model's output that is one (parallel.py).
                raise SpatialError("the result is a part flattened: reduce it, or keep the rows and columns")
            grad = None
            if backward:
                loss = _weighted_sum(value, g, rank)
                if loss is not None and loss.requires_grad:
                    loss.backward()
                    grad = mine.grad
            outcomes[rank] = Outcome(value, grad=grad)
        except BaseException as err:  # noqa: BLE001 - the outcome is compared by the caller
            outcomes[rank] = Outcome(error=err)
            shared.failed.set()
            try:
                shared.barrier.abort()
            except Exception:  # noqa: BLE001
                pass

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(g.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(_WAIT_S * 3)
    done = [o if o is not None else Outcome(error=TimeoutError("the rank did not finish")) for o in outcomes]
    if all(o.error is None for o in done) or refused_alike(done) is not None:
        return done
    # The ranks went different ways: SpatialParallel's first forward would have found it in
    # its check of every rank's part (shapes only) and refused alike on every rank. (Checked
    # only here, as it costs a dry run per rank.)
    try:
        check_split(_Call(fn), tuple(x.shape), grid, x.dtype)
    except SpatialError as refused:
        return [Outcome(error=refused) for _ in range(g.size)]
    return done


def _weighted_sum(value: Any, grid: Grid, rank: int) -> Optional[torch.Tensor]:
    """Every float tensor of ``value`` summed with weights that depend on the pixel's place in
    the whole map (a part's own share; a replicated result counted once, on the group's rank 0)."""
    tensors = [v for v in _flat(value) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad]
    total = None
    for t in tensors:
        part, last = _part_and_layout(t)
        if part is None:
            term = (t * _weights(t.shape)).sum() if rank == 0 else t.sum() * 0
        elif last:
            whole = _weights(t.shape[:-2] + (part.height, part.width))
            (r0, r1), (c0, c1) = part.rows, part.cols
            term = (t * whole[..., r0:r1, c0:c1]).sum()
        else:  # channels last: (..., h, w, C)
            whole = _weights(t.shape[:-3] + (part.height, part.width, t.shape[-1]))
            (r0, r1), (c0, c1) = part.rows, part.cols
            term = (t * whole[..., r0:r1, c0:c1, :]).sum()
        total = term if total is None else total + term
    return total


def _weights(shape) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64).reshape(shape) % 7 + 1) / 7


def one_process_gradient(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Optional[torch.Tensor]:
    whole = x.detach().clone().requires_grad_()
    value = fn(whole)
    tensors = [v for v in _flat(value) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad]
    if not tensors:
        return None
    sum(((t * _weights(t.shape)).sum() for t in tensors)).backward()
    return whole.grad


def _flat(value: Any) -> List[Any]:
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        out = []
        for v in value:
            out.extend(_flat(v))
        return out
    return [value]


def assemble(values: Sequence[Any]) -> Any:
    """The ranks' results put together: parts into the whole map, replicated results checked
    to be the same on every rank; tuples element by element."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        part, last = _part_and_layout(first)
        if part is None:
            for other in values[1:]:
                if _part_and_layout(other)[0] is not None or not _same(other, first):
                    raise AssertionError("a replicated result differs between ranks")
            return first
        if not last:  # channels last: assembled with the image dimensions last, then moved back
            return assemble([_image_last(v) for v in values]).movedim(-3, -1)
        whole = first.new_zeros(first.shape[:-2] + (part.height, part.width))
        for v in values:
            p = part_of(v)
            if p is None or (p.height, p.width) != (part.height, part.width):
                raise AssertionError("the ranks' results are not parts of one map")
            (r0, r1), (c0, c1) = p.rows, p.cols
            whole[..., r0:r1, c0:c1] = v
        return whole
    if isinstance(first, (list, tuple)) and not isinstance(first, torch.Size):
        items = [assemble([v[i] for v in values]) for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    for other in values[1:]:
        if other != first:
            raise AssertionError(f"a result differs between ranks: {first!r} and {other!r}")
    return first


def _part_and_layout(t: Any) -> Tuple[Optional[Part], bool]:
    """The part ``t`` holds and whether its image dimensions are its last two (else channels last)."""
    part = part_of(t)
    if part is not None:
        return part, True
    return channels_last_part_of(t), False


def _image_last(t: torch.Tensor) -> torch.Tensor:
    """A channels-last part with its channels moved before the image, marked as a part (a copy)."""
    part = channels_last_part_of(t)
    if part is None:
        raise AssertionError("the ranks' results are not parts of one map (channels last on some only)")
    return tagged(t.movedim(-1, -3).detach(), part)


def assemble_gradients(outcomes: List[Outcome], grid: Tuple[int, int], shape) -> torch.Tensor:
    g = Grid(*grid)
    whole = torch.zeros(shape, dtype=torch.float64)
    for rank, o in enumerate(outcomes):
        part = Part(g, rank, shape[-2], shape[-1])
        (r0, r1), (c0, c1) = part.rows, part.cols
        if o.grad is not None:
            whole[..., r0:r1, c0:c1] = o.grad
    return whole


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b) or (
            a.is_floating_point() and torch.allclose(a, b, rtol=1e-12, atol=1e-12, equal_nan=True)))
    return a == b


def equal(a: Any, b: Any, loose: bool = False) -> bool:
    """Whether the assembled result ``a`` is one process's ``b`` (float64: to rounding; ``loose``:
    to float32's, where a float32 tensor took part)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            return False
        if a.is_floating_point() or a.is_complex():
            # float64 to rounding; float32 and half as their kernels round on shorter rows
            rtol = {torch.float64: 1e-10, torch.complex128: 1e-10, torch.float32: 1e-5, torch.complex64: 1e-5}
            tolerance = max(rtol.get(a.dtype, 1e-2), 1e-5 if loose else 0.0)
            return bool(torch.allclose(a, b, rtol=tolerance, atol=tolerance * 1e-2, equal_nan=True))
        return bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(equal(x, y, loose) for x, y in zip(a, b))
    return a == b


def refused_alike(outcomes: List[Outcome]) -> Optional[str]:
    """The message when every rank refused with the same SpatialError, else None."""
    errors = [o.error for o in outcomes]
    if all(isinstance(e, SpatialError) for e in errors) and len({str(e) for e in errors}) == 1:
        return str(errors[0])
    return None
