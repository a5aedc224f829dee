"""Every hpdl.torch collective against a single-process reference, on every dtype; the engine's
behaviour under the default settings (engine_behaviour.py's checks: fusion, the response cache,
gathering, poll) and SyncBatchNorm (sync_batch_norm.py's), in the same job: one start-up for all."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(__file__))

import torch
import engine_behaviour
import sync_batch_norm
from _common import ALL_DTYPES, adasum_reference, assert_equal, rank_tensor, run_main

import hpdl.torch as hvd
from hpdl.torch import runtime


def reduce_ref(tensors, op):
    dtype = tensors[0].dtype
    if dtype == torch.bool:
        stack = torch.stack(tensors)
        return stack.any(0) if op in (hvd.Sum, hvd.Max, hvd.Average) else stack.all(0)
    out = tensors[0].clone()
    for t in tensors[1:]:
        if op in (hvd.Sum, hvd.Average):
            out = out + t
        elif op == hvd.Product:
            out = out * t
        elif op == hvd.Min:
            out = torch.minimum(out, t)
        elif op == hvd.Max:
            out = torch.maximum(out, t)
    if op == hvd.Average:
        n = len(tensors)
        out = out / n if dtype.is_floating_point else torch.trunc(out.double() / n).to(dtype)
    return out


def check_allreduce(rank, size):
    for dtype in ALL_DTYPES:
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
            for shape in [(4,), (2, 3), ()]:
                seed = 3 + list(type(op)).index(op)
                mine = rank_tensor(rank, shape, dtype, seed)
                expected = reduce_ref([rank_tensor(r, shape, dtype, seed) for r in range(size)], op)
                assert_equal(hvd.allreduce(mine, op=op), expected, f"allreduce {op} {dtype} {shape}")
                t = mine.clone()
                hvd.allreduce_(t, op=op, name=f"inplace.{dtype}.{op}.{shape}")
                assert_equal(t, expected, f"allreduce_ {op} {dtype}")
                assert_equal(mine, rank_tensor(rank, shape, dtype, seed), "allreduce leaves its input alone")
    # average keyword and scale factors
    x = torch.full((3,), float(rank + 1))
    total = sum(range(1, size + 1))
    assert_equal(hvd.allreduce(x, average=False), torch.full((3,), float(total)), "average=False")
    assert_equal(hvd.allreduce(x, average=True), torch.full((3,), total / size), "average=True")
    assert_equal(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
                 torch.full((3,), float(total)), "scales")
    # non-contiguous in-place
    nc = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    hvd.allreduce_(nc, op=hvd.Sum)
    assert_equal(nc, torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * size, "non-contiguous in-place")
    # async + poll
    handles = [hvd.allreduce_async(torch.full((5,), float(i)), name=f"async.{i}", op=hvd.Sum) for i in range(30)]
    for i, h in enumerate(handles):
        assert_equal(hvd.synchronize(h), torch.full((5,), float(i * size)), f"async {i}")
        assert hvd.poll(h)
    # grouped
    tensors = [torch.full((i + 1,), float(rank)) for i in range(4)]
    outs = hvd.grouped_allreduce(tensors, op=hvd.Sum)
    for i, out in enumerate(outs):
        assert_equal(out, torch.full((i + 1,), float(sum(range(size)))), "grouped")
    hvd.grouped_allreduce_(tensors, op=hvd.Max)
    assert_equal(tensors[2], torch.full((3,), float(size - 1)), "grouped in place")
    # Integer averages are the exact quotient truncated: with 3 ranks, -234 * 13 / 3 is -1014, and
    # scaling by 13 * (1/3) in float64 gave -1013.
    for dtype in (torch.int32, torch.int64):
        t = torch.full((3,), -78, dtype=dtype)
        assert_equal(hvd.allreduce(t, op=hvd.Average, postscale_factor=13.0), torch.full((3,), -1014, dtype=dtype),
                     f"integer average with a postscale {dtype}")
        assert_equal(hvd.reducescatter(torch.full((size, 2), -78, dtype=dtype), op=hvd.Average, postscale_factor=13.0),
                     torch.full((1, 2), -1014, dtype=dtype), f"integer reducescatter average with a postscale {dtype}")
    # A group of several dtypes: each is reduced in its own (fusing them into one buffer of the
    # first's dtype summed float32 in float16 and int64 in float32).

    def mixed(r):
        return [torch.full((2,), 0.25 + r, dtype=torch.float16), torch.full((3,), (1 + 2 ** -20) * (r + 1)),
                torch.full((2,), 2 ** 40 + r, dtype=torch.int64), torch.full((2,), 1.0 + r, dtype=torch.float16)]

    for op in (hvd.Sum, hvd.Average):
        outs = hvd.grouped_allreduce(mixed(rank), op=op, name=f"mixed.{op}")
        for i, out in enumerate(outs):
            expected = reduce_ref([mixed(r)[i] for r in range(size)], op)
            assert_equal(out, expected, f"grouped {op} of mixed dtypes, member {i}")
            if op == hvd.Sum and out.dtype != torch.float16:
                assert torch.equal(out, expected), (f"grouped sum of mixed dtypes, member {i}", out, expected)
    check_adasum(rank, size)


def check_adasum(rank, size):
    if size & (size - 1):
        for call in (lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum),
                     lambda: hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1),
                                                      op=hvd.Adasum)):
            try:
                call()
                raise AssertionError("Adasum on a number of ranks that is no power of two should raise")
            except NotImplementedError as err:
                assert f"has {size}" in str(err) or "power" in str(err), err
        return
    for numel, dtype in [(1, torch.float64), (7, torch.float64), (33, torch.float32), (1000, torch.float64),
                         (9, torch.float16)]:
        vectors = [torch.randn(numel, generator=torch.Generator().manual_seed(7 * r + numel), dtype=torch.float64)
                   for r in range(size)]
        vectors[-1][: numel // 2] = 0  # a partly zero vector, and in the 1-element case a zero one
        expected = adasum_reference(vectors).to(dtype)
        tol = {torch.float16: 1e-2, torch.float32: 1e-5}.get(dtype, 1e-12)
        out = hvd.allreduce(vectors[rank].to(dtype), op=hvd.Adasum)
        assert torch.allclose(out.double(), expected.double(), rtol=tol, atol=tol), (numel, dtype, out, expected)
        inplace = vectors[rank].to(dtype).clone().reshape(1, -1)
        hvd.allreduce_(inplace, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.25)
        # Adasum is homogeneous of degree one: scaling every input scales the result.
        assert torch.allclose(inplace.double().flatten(), expected.double() * 0.5, rtol=tol, atol=tol), (numel, dtype)
    # A group: each tensor gets its own coefficients.
    pieces = [[torch.randn(n, generator=torch.Generator().manual_seed(31 * r + n), dtype=torch.float64)
               for n in (5, 1, 12)] for r in range(size)]
    outs = hvd.grouped_allreduce(pieces[rank], op=hvd.Adasum)
    for i, out in enumerate(outs):
        expected = adasum_reference([pieces[r][i] for r in range(size)])
        assert torch.allclose(out, expected, rtol=1e-12, atol=1e-12), (i, out, expected)
    # Refused with Horovod's type (its Adasum fails them in synchronize(): HorovodInternalError),
    # before any member of a group is submitted (the float one before it must not wait for ever).
    for call in (lambda: hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum),
                 lambda: hvd.grouped_allreduce([torch.ones(2), torch.ones(2, dtype=torch.int32)], op=hvd.Adasum)):
        try:
            call()
            raise AssertionError("Adasum of integers should raise")
        except hvd.HorovodInternalError as err:
            assert isinstance(err, RuntimeError) and "floating-point" in str(err) and "int32" in str(err), err
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Adasum, name="adasum.after"), torch.ones(2))


def check_autograd(rank, size):
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum)
    y.sum().backward()
    assert_equal(x.grad, torch.full((3,), float(size)), "allreduce gradient is the allreduce of gradients")
    x = torch.ones(rank + 1, 2, requires_grad=True)
    g = hvd.allgather(x)
    (g * torch.arange(g.shape[0]).unsqueeze(1)).sum().backward()
    offset = sum(r + 1 for r in range(rank))
    assert_equal(x.grad, torch.arange(offset, offset + rank + 1).float().unsqueeze(1).expand(rank + 1, 2),
                 "allgather gradient")
    x = torch.ones(2, requires_grad=True)
    hvd.broadcast(x, 0).sum().backward()
    assert_equal(x.grad, torch.ones(2) if rank == 0 else torch.zeros(2), "broadcast gradient")
    x = torch.arange(2 * size, dtype=torch.float32, requires_grad=True)
    out = hvd.alltoall(x)
    (out * (rank + 1)).sum().backward()
    assert_equal(x.grad, torch.tensor([float(d + 1) for d in range(size) for _ in range(2)]), "alltoall gradient")
    check_reducescatter_gradient(rank, size)
    check_grouped_autograd(rank, size)


def check_reducescatter_gradient(rank, size):
    # Horovod's convention: allgather of the output gradient, times size for Sum (no division
    # for Average), times the scale factors.
    for op, prescale, postscale, factor in [(hvd.Sum, 1.0, 1.0, size), (hvd.Average, 1.0, 1.0, 1.0),
                                            (hvd.Sum, 2.0, 0.25, size * 0.5), (hvd.Average, 3.0, 1.0, 3.0)]:
        x = torch.ones(2 * size, 2, requires_grad=True)
        out = hvd.reducescatter(x, op=op, prescale_factor=prescale, postscale_factor=postscale)
        (out * (rank + 1)).sum().backward()
        weights = torch.tensor([float(r + 1) for r in range(size) for _ in range(2)]).unsqueeze(1).expand(2 * size, 2)
        assert_equal(x.grad, weights * factor, f"reducescatter gradient {op} {prescale} {postscale}")


def check_grouped_autograd(rank, size):
    a = torch.full((3,), float(rank + 1), requires_grad=True)
    b = torch.full((2, 2), float(rank), requires_grad=True)
    outs = hvd.grouped_allreduce([a, b], op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5)
    total = float(sum(range(1, size + 1)))
    assert_equal(outs[0].detach(), torch.full((3,), 1.5 * total), "grouped allreduce with grad")
    (outs[0].sum() * 2 + outs[1].sum()).backward()
    # The backward is the grouped allreduce of the output gradients, same op and scales.
    assert_equal(a.grad, torch.full((3,), 2 * 1.5 * size), "grouped allreduce gradient")
    assert_equal(b.grad, torch.full((2, 2), 1.5 * size), "grouped allreduce gradient, second tensor")
    c = torch.full((2,), float(rank), requires_grad=True)
    outs = hvd.grouped_allreduce([c, c * 2])  # Average, and a non-leaf input
    (outs[0].sum() + outs[1].sum()).backward()
    assert_equal(c.grad, torch.full((2,), 3.0), "grouped average gradient")
    # The in-place and async forms accept tensors that require grad.
    d = torch.full((4,), float(rank), requires_grad=True)
    e = torch.full((4,), 1.0, requires_grad=True)
    hvd.grouped_allreduce_([d, e], op=hvd.Sum)
    assert_equal(d.detach(), torch.full((4,), float(sum(range(size)))), "grouped_allreduce_ with grad")
    outs = hvd.synchronize(hvd.grouped_allreduce_async([d, e], op=hvd.Sum))
    assert_equal(outs[1], torch.full((4,), float(size * size)), "grouped_allreduce_async with grad")
    hvd.synchronize(hvd.grouped_allreduce_async_([d, e], op=hvd.Max))
    assert_equal(e.detach(), torch.full((4,), float(size)), "grouped_allreduce_async_ with grad")

    # grouped_allgather: as allgather, tensor by tensor.
    x = torch.ones(rank + 1, 2, requires_grad=True)
    y = torch.ones(2, requires_grad=True)
    gx, gy = hvd.grouped_allgather([x, y * 1])
    (gx * torch.arange(gx.shape[0]).unsqueeze(1)).sum().backward(retain_graph=True)
    offset = sum(r + 1 for r in range(rank))
    assert_equal(x.grad, torch.arange(offset, offset + rank + 1).float().unsqueeze(1).expand(rank + 1, 2),
                 "grouped allgather gradient")
    (gy * (torch.arange(2 * size).float() + rank)).sum().backward()
    mean_rank = (size - 1) / 2
    assert_equal(y.grad, torch.arange(2 * rank, 2 * rank + 2).float() + mean_rank, "grouped allgather gradient 2")

    # grouped_reducescatter: as reducescatter, tensor by tensor.
    p = torch.ones(2 * size, requires_grad=True)
    q = torch.ones(size, 3, requires_grad=True)
    op_, oq = hvd.grouped_reducescatter([p, q], op=hvd.Sum)
    (op_.sum() * (rank + 1) + oq.sum()).backward()
    assert_equal(p.grad, torch.tensor([float((r + 1) * size) for r in range(size) for _ in range(2)]),
                 "grouped reducescatter gradient")
    assert_equal(q.grad, torch.full((size, 3), float(size)), "grouped reducescatter gradient 2")


def check_allgather_broadcast_alltoall_reducescatter(rank, size):
    for dtype in ALL_DTYPES:
        parts = [rank_tensor(r, (r + 1, 2), dtype, 9) for r in range(size)]
        assert_equal(hvd.allgather(parts[rank]), torch.cat(parts), f"allgather {dtype}")
        outs = hvd.grouped_allgather([parts[rank], parts[rank][:1]])
        assert_equal(outs[1], torch.cat([p[:1] for p in parts]), f"grouped allgather {dtype}")
        # Rank 0 brings no rows (gloo moves int16 as bytes: a 0-row tensor used to fail there).
        parts = [rank_tensor(r, (r, 2, 3), dtype, 10) for r in range(size)]
        assert_equal(hvd.allgather(parts[rank]), torch.cat(parts), f"allgather with 0 rows {dtype}")
        out, received = hvd.alltoall(parts[rank], splits=[rank] + [0] * (size - 1))
        assert_equal(out, torch.cat(parts) if rank == 0 else parts[0][:0], f"alltoall of 0 rows {dtype}")
        empty_rows = torch.zeros((2, 0), dtype=dtype)
        assert_equal(hvd.allgather(empty_rows), torch.zeros((2 * size, 0), dtype=dtype), f"allgather of empty rows {dtype}")
        out, _ = hvd.alltoall(torch.zeros((size, 0), dtype=dtype), splits=[1] * size)
        assert_equal(out, torch.zeros((size, 0), dtype=dtype), f"alltoall of empty rows {dtype}")
        for root in range(size):
            t = rank_tensor(rank, (3, 2), dtype, 4)
            assert_equal(hvd.broadcast(t, root), rank_tensor(root, (3, 2), dtype, 4), f"broadcast {dtype}")
            hvd.broadcast_(t, root)
            assert_equal(t, rank_tensor(root, (3, 2), dtype, 4), f"broadcast_ {dtype}")
        splits = [(rank + d) % 2 + 1 for d in range(size)]
        data = rank_tensor(rank, (sum(splits), 3), dtype, 6)
        out, received = hvd.alltoall(data, splits=splits)
        expected, exp_splits = [], []
        for src in range(size):
            s = [(src + d) % 2 + 1 for d in range(size)]
            start = sum(s[:rank])
            expected.append(rank_tensor(src, (sum(s), 3), dtype, 6)[start:start + s[rank]])
            exp_splits.append(s[rank])
        assert_equal(out, torch.cat(expected), f"alltoall {dtype}")
        assert received.tolist() == exp_splits, received
        if dtype != torch.bool:
            rows = 2 * size + 1
            full = [rank_tensor(r, (rows, 2), dtype, 8) for r in range(size)]
            summed = reduce_ref(full, hvd.Sum)
            counts = [rows // size + (1 if i < rows % size else 0) for i in range(size)]
            start = sum(counts[:rank])
            assert_equal(hvd.reducescatter(full[rank], op=hvd.Sum), summed[start:start + counts[rank]],
                         f"reducescatter {dtype}")
            outs = hvd.grouped_reducescatter([full[rank], full[rank]], op=hvd.Sum)
            assert_equal(outs[1], summed[start:start + counts[rank]], f"grouped reducescatter {dtype}")
    # Refusals raise the types Horovod raises, and leave no member of a group in flight.
    refusals = [
        (lambda: hvd.reducescatter(torch.tensor(1.0)), ValueError, "scalars"),
        (lambda: hvd.grouped_reducescatter([torch.ones(size), torch.tensor(1.0)]), ValueError, "scalars"),
        (lambda: hvd.reducescatter(torch.ones(size), op=hvd.Adasum), hvd.HorovodInternalError, "not Adasum"),
        (lambda: hvd.alltoall(torch.ones(size), splits=torch.ones(size)), ValueError, "1-D tensor of integers"),
        (lambda: hvd.alltoall(torch.ones(size), splits=torch.ones(1, size, dtype=torch.int32)), ValueError,
         "1-D tensor of integers"),
    ]
    for call, error, words in refusals:
        try:
            call()
            raise AssertionError(f"should raise {error.__name__}: {words}")
        except error as err:
            assert words in str(err), err
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    full = torch.ones(size, 2)
    outs = hvd.grouped_reducescatter([full, full], op=hvd.Sum, name="reducescatter.after")
    assert all(torch.equal(out, torch.full((1, 2), float(size))) for out in outs), outs
    out, received = hvd.alltoall(torch.ones(size), splits=torch.ones(size, dtype=torch.int64))
    assert torch.equal(out, torch.ones(size)) and received.tolist() == [1] * size, (out, received)


def check_objects_and_helpers(rank, size):
    assert hvd.broadcast_object({"from": rank, "data": [1, 2]}, root_rank=size - 1) == {"from": size - 1, "data": [1, 2]}
    assert hvd.allgather_object(("r", rank)) == [("r", r) for r in range(size)]
    # Unnamed, with objects of different types on the ranks (the usual idioms): no stall.
    config = {"lr": 0.1}
    assert hvd.broadcast_object(config if rank == 0 else None) == config
    assert hvd.allgather_object(0 if rank == 0 else 0.5) == [0] + [0.5] * (size - 1)
    # Functions travel by value (cloudpickle, as Horovod): a closure made on root only.
    offset = 10 * rank
    shift = hvd.broadcast_object(lambda x: x + offset, root_rank=0, name="closure")
    assert shift(1) == 1, "the closure broadcast is root's"
    # An object one rank cannot serialize: every rank raises, none waits for its bytes.
    unserializable = threading.Lock() if rank == size - 1 else "fine"
    try:
        hvd.allgather_object(unserializable, name="lock")
        raise AssertionError("allgather_object of a lock should raise")
    except ValueError as err:
        assert f"rank {size - 1}" in str(err), err
        if rank != size - 1:  # the ranks whose object was fine name the rank that failed, not theirs
            assert str(err) == (f"allgather_object 'lock': rank {size - 1} could not serialize its object "
                                "(the error on each says why)"), err
    try:
        hvd.broadcast_object(threading.Lock() if rank == 0 else None, root_rank=0, name="lock")
        raise AssertionError("broadcast_object of a lock should raise")
    except ValueError as err:
        assert "root rank 0" in str(err), err
    assert hvd.broadcast_object("after", root_rank=0, name="after") == "after", "usable after the errors"
    model = torch.nn.Linear(3, 2)
    torch.manual_seed(rank)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0))
    assert all(torch.equal(gathered[0], g) for g in gathered), "broadcast_parameters"
    opt = torch.optim.Adam(model.parameters(), lr=0.1 * (rank + 1))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.1, opt.param_groups[0]["lr"]
    if size > 1:
        # A model with a layer more on the last rank: every rank raises (no stall), naming it.
        uneven = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(2 if rank < size - 1 else 3)])
        for call in (lambda: hvd.broadcast_parameters(uneven.state_dict(), root_rank=0),
                     lambda: hvd.broadcast_optimizer_state(torch.optim.Adam(uneven.parameters()), root_rank=0)):
            try:
                call()
                raise AssertionError("broadcasting tensors root does not have should raise")
            except ValueError as err:
                assert f"rank {size - 1} has '2.bias', '2.weight'" in str(err) or "'state.0.4" in str(err), err
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # usable afterwards
    sparse = torch.sparse_coo_tensor([[rank]], [float(rank + 1)], (size,), check_invariants=False)
    with warnings.catch_warnings(record=True) as caught:  # torch warns once per process: the first build
        warnings.simplefilter("always")
        result = hvd.sparse_allreduce_async(sparse, name="sparse", op=hvd.Sum)()
    assert not [w for w in caught if "invariant" in str(w.message)], [str(w.message) for w in caught]
    assert_equal(result.to_dense(), torch.arange(1, size + 1, dtype=torch.float32), "sparse allreduce")


def check_horovod_spellings(rank, size):
    """What scripts written for Horovod pass: its op numbers, reducescatter's positional order,
    an unsupported dtype refused on the calling rank with a ValueError."""
    # Horovod's ops are its C++ enum's integers: Average 0, Sum 1, Adasum 2, Min 3, Max 4, Product 5.
    x = torch.tensor([float(rank + 1), 2.0])
    assert_equal(hvd.allreduce(x, op=1, name="int.sum"), reduce_ref([torch.tensor([float(r + 1), 2.0])
                                                                     for r in range(size)], hvd.Sum), "op=1")
    assert_equal(hvd.allreduce(x, op=3, name="int.min"), torch.tensor([1.0, 2.0]), "op=3")
    for bad in (6, -1, True, "sum"):
        try:
            hvd.allreduce(x, op=bad)
            raise AssertionError(f"op={bad!r} should raise")
        except ValueError as err:
            assert "unknown reduction op" in str(err), err
    rows = torch.arange(2.0 * size).reshape(size, 2) * (rank + 1)
    expected = sum(torch.arange(2.0 * size).reshape(size, 2) * (r + 1) for r in range(size))[rank:rank + 1]
    # Horovod's order: (tensor, name, compression, op, process_set, prescale, postscale).
    out = hvd.reducescatter(rows, None, hvd.Compression.none, hvd.Sum, hvd.global_process_set, 2.0, 0.5)
    assert_equal(out, expected, "reducescatter positionally")
    out = hvd.synchronize(hvd.reducescatter_async(rows, "rs.pos", hvd.Sum, hvd.global_process_set, 3.0))
    assert_equal(out, expected * 3, "reducescatter_async positionally")
    for call in (lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64), name="complex"),
                 lambda: hvd.grouped_allreduce([torch.ones(2), torch.ones(2, dtype=torch.complex64)], name="cgroup"),
                 lambda: hvd.allgather(torch.ones(2, dtype=torch.complex128), name="complex.gather")):
        try:
            call()
            raise AssertionError("a complex tensor should be refused")
        except ValueError as err:
            assert "complex" in str(err) and "not supported" in str(err), err
    # Nothing of the refused group was submitted: the same name works at once on every rank.
    assert_equal(hvd.grouped_allreduce([torch.ones(2)] * 2, name="cgroup", op=hvd.Sum)[1],
                 torch.full((2,), float(size)), "a name refused before is free")


def check_ordering(rank, size):
    # Ranks submit the same named tensors in different orders; names match them up.
    names = [f"order.{i}" for i in range(25)]
    order = names if rank % 2 == 0 else names[::-1]
    handles = {n: hvd.allreduce_async(torch.full((4,), float(int(n.split('.')[1]))), name=n, op=hvd.Sum) for n in order}
    for n, h in handles.items():
        assert_equal(hvd.synchronize(h), torch.full((4,), float(int(n.split('.')[1]) * size)), f"ordering {n}")


def check_duplicate_name(rank, size):
    if size == 1:
        return  # alone, an op completes before a second submit can race it; 2+ ranks test this
    # Rank 0's op stays in flight until the others submit theirs, which they do only after
    # rank 0 has tried the duplicate and told them so.
    if rank == 0:
        h = hvd.allreduce_async(torch.zeros(8), name="dup")
        try:
            hvd.allreduce_async(torch.zeros(8), name="dup")
            raise AssertionError("duplicate name in flight should raise ValueError")
        except ValueError as err:
            assert "dup" in str(err)
        hvd.broadcast_object("checked", root_rank=0, name="dup.sync")
    else:
        hvd.broadcast_object(None, root_rank=0, name="dup.sync")
        h = hvd.allreduce_async(torch.zeros(8), name="dup")
    hvd.synchronize(h)
    hvd.synchronize(hvd.allreduce_async(torch.zeros(8), name="dup"))  # allowed again once done


def check_process_sets(rank, size):
    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    odds = hvd.add_process_set([r for r in range(size) if r % 2 == 1]) if size > 1 else None
    mine = evens if rank % 2 == 0 else odds
    assert mine.included() and mine.rank() == mine.ranks.index(rank)
    out = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, process_set=mine)
    assert out.item() == float(sum(mine.ranks)), out
    root = mine.ranks[-1]
    assert hvd.broadcast(torch.tensor([rank]), root, process_set=mine).item() == root
    assert hvd.allgather(torch.tensor([rank]), process_set=mine).tolist() == mine.ranks
    hvd.barrier(process_set=mine)
    x = torch.full((2,), float(rank), requires_grad=True)
    outs = hvd.grouped_allreduce([x, x * 3], op=hvd.Sum, process_set=mine)
    assert_equal(outs[1].detach(), torch.full((2,), 3.0 * sum(mine.ranks)), "grouped allreduce in a process set")
    (outs[0].sum() + outs[1].sum()).backward()
    assert_equal(x.grad, torch.full((2,), 4.0 * mine.size()), "grouped allreduce gradient in a process set")
    hvd.barrier(process_set=mine)
    # An unnamed call on some ranks only, then one on every rank: that one has the same name
    # everywhere (unnamed calls are numbered per process set; a global count put the odd
    # ranks one ahead, and the allreduce below waited for ever for a name no peer gave).
    if odds is not None and odds.included():
        hvd.allreduce(torch.ones(1), process_set=odds)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == float(size), "an unnamed call after a subset's"
    hvd.remove_process_set(evens)
    if odds is not None:
        hvd.remove_process_set(odds)
    assert evens.process_set_id is None
    hvd.barrier()


def check_join(rank, size):
    # Rank 0 joins at once; the others allreduce twice more and see rank 0 contribute zeros.
    if rank == 0:
        last = hvd.join()
    else:
        for i in range(2):
            out = hvd.allreduce(torch.ones(3), op=hvd.Sum, name=f"join.ar.{i}")
            assert_equal(out, torch.full((3,), float(size - 1)), "allreduce with a joined rank")
        # Only allreduce runs beside a joined rank: the others raise on every rank, naming it.
        for kind, call in (("allgather", lambda: hvd.allgather(torch.ones(1), name="join.ag")),
                           ("broadcast", lambda: hvd.broadcast(torch.ones(1), root_rank=size - 1, name="join.bc"))):
            try:
                call()
                raise AssertionError(f"{kind} beside a joined rank should raise")
            except hvd.HorovodInternalError as err:
                assert f"{kind} of tensor" in str(err) and "rank 0 called join()" in str(err), err
                assert "sparse_as_dense" not in str(err), err  # DistributedOptimizer's advice, not the API's
        last = hvd.join()
    # The last to join is one of the ranks that allreduced first (which of them, when they join
    # in different rounds, depends on timing), and every rank names the same one.
    assert (last in range(1, size)) if size > 1 else last == 0, last
    assert hvd.allgather_object(last) == [last] * size, "join() names the same last rank everywhere"
    # The last rank to join submitted an allreduce just before (the others have joined): it
    # runs before join() returns, with zeros from the others (it used to stay pending for ever).
    if rank == size - 1:
        time.sleep(0.3)  # the others join first
        handle = hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="join.pending")
        assert hvd.join() == rank, "the last rank to join is named"
        assert_equal(hvd.synchronize(handle), torch.ones(3), "allreduce submitted by the last rank to join")
    else:
        assert hvd.join() == size - 1, "the last rank to join is named"


def check_timeline(rank, size):
    path = os.path.join(tempfile.gettempdir(), f"hpdl-timeline-{os.getpid()}.json")
    hvd.start_timeline(path)
    for i in range(3):
        hvd.allreduce(torch.ones(10), name=f"tl.{i}")
    hvd.grouped_allreduce([torch.ones(3), torch.ones(4)], name="tlgroup")
    hvd.stop_timeline()
    if rank == 0:
        records = json.load(open(path))
        assert "start_time_since_epoch_in_micros" in records[0]["args"], records[0]
        names = {r.get("name") for r in records}
        for phase in ("NEGOTIATE_ALLREDUCE", "ALLREDUCE"):
            assert phase in names, (phase, names)
        if size > 1:
            assert any(n and n.endswith("_ALLREDUCE") and n != "NEGOTIATE_ALLREDUCE" and n != "ALLREDUCE" for n in names), names
            assert "MEMCPY_IN_FUSION_BUFFER" in names and "MEMCPY_OUT_FUSION_BUFFER" in names, names
        pids = {r["args"]["name"]: r["pid"] for r in records if r.get("name") == "process_name" and r["pid"]}
        assert "tl.0" in pids and "tlgroup.1" in pids, pids
        os.unlink(path)


def check_init(rank, size):
    assert hvd.mpi_enabled() != hvd.gloo_enabled(), "exactly one of MPI and gloo carries the job"
    assert (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()) == (rank, size, 0, 1)
    assert hvd.is_initialized() and hvd.is_homogeneous()
    # The build queries answer what this installation has.
    import importlib.util
    assert hvd.mpi_built() == (importlib.util.find_spec("mpi4py") is not None)
    assert hvd.gloo_built() == torch.distributed.is_gloo_available()
    assert bool(hvd.nccl_built()) == torch.distributed.is_nccl_available()
    assert hvd.mpi_enabled() or hvd.gloo_built()


# name -> check, in the order they run; each prints "CHECK <name> OK" or "CHECK <name> FAIL" per rank.
CHECKS = {
    "init": check_init,
    "allreduce": check_allreduce,
    "autograd": check_autograd,
    "allgather-broadcast-alltoall-reducescatter": check_allgather_broadcast_alltoall_reducescatter,
    "objects-and-helpers": check_objects_and_helpers,
    "horovod-spellings": check_horovod_spellings,
    "ordering": check_ordering,
    "duplicate-name": check_duplicate_name,
    "process-sets": check_process_sets,
    "timeline": check_timeline,
    "join": check_join,
    "sync-batch-norm": sync_batch_norm.check_all,
    "fusion": engine_behaviour.check_fusion,
    "response-cache": engine_behaviour.check_cache,
    "gathering": engine_behaviour.check_gathering,
    "backward-ends-its-gathering": engine_behaviour.check_backward_ends_its_gathering,
    "poll-in-flight": engine_behaviour.check_poll_in_flight,
}


def check_shutdown_and_init_again(rank, size):
    hvd.shutdown()
    assert not hvd.is_initialized()
    assert not hvd.mpi_enabled() and not hvd.gloo_enabled(), "neither is enabled while hpdl is not running"
    hvd.init()
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name="again").tolist() == [float(size)] * 2
    hvd.shutdown()


# Every name a job reports on, in order (the test gives each its own id); the last two shut down.
CHECK_NAMES = list(CHECKS) + ["shutdown-names-the-rank", "shutdown-and-init-again"]


def main():
    hvd.init()
    if sys.argv[1:] == ["adasum"]:  # the Adasum checks alone, for set sizes beyond the usual layouts
        check_adasum(hvd.rank(), hvd.size())
        hvd.shutdown()
        print("OK adasum", flush=True)
        return
    rank, size = hvd.rank(), hvd.size()
    # A failed check is reported and the next one runs, so one failure does not hide the others
    # (a check that fails on one rank inside a collective may leave the others waiting: the
    # harness's timeout then ends the job, with the lines printed so far).
    failed = []
    for name, check in CHECKS.items():
        failed += [name] if not _report(name, check, rank, size) else []
    stats = runtime.engine().stats()
    for name, check in (("shutdown-names-the-rank", engine_behaviour.check_shutdown_names_the_rank),
                        ("shutdown-and-init-again", check_shutdown_and_init_again)):
        failed += [name] if not _report(name, check, rank, size) else []
    if failed:
        sys.exit(1)
    if rank == 0:
        print(f"OK torch api: size={size} stats={stats}", flush=True)


def _report(name, check, rank, size) -> bool:
    try:
        check(rank, size)
    except Exception:  # noqa: BLE001 - reported per check, with its traceback
        import traceback
        sys.stderr.write(f"[rank {rank}] check {name} failed:\n{traceback.format_exc()}")
        _record(f"CHECK {name} FAIL rank={rank};")
        return False
    _record(f"CHECK {name} OK rank={rank};")
    return True


def _record(line: str) -> None:
    # One write per record: print() writes the newline apart, and the launcher may put another
    # rank's record between the two.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    run_main(main)
