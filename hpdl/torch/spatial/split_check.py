"""The first forward's check of the split, before any work: the model run on shapes only (the
meta device, no communication) on every rank's part, each rank its own, and once more on the
whole image as one part; the group gathers the outcomes, and every rank judges them alike, so
that every rank refuses alike what cannot run split: a layer or call without a spatial version, a band thinner than a layer's halo, a part
PyTorch itself refuses, a forward that runs differently on different parts, or one that
computes with a part's own lengths where one process has the whole image's. A thin band is
named with the image size and grid that would fit. ``check_split`` runs the same check in one
process, without ``hvd.init()``.

What a forward does besides layers gets through the dry run and leaves no trace on the model
(_attributes_for_the_dry_run, _random_states_kept); the user's own forward hooks are left out
of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import pickle
import random
import sys
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from hpdl.torch.spatial import dispatch
from hpdl.torch.spatial.context import Context, track_modules
from hpdl.torch.spatial.geometry import Grid, Part, SpatialError, ThinBand
from hpdl.torch.spatial.parts import map_tensors, part_of, tagged

_SEARCH_LIMIT = 4096  # image sizes tried when suggesting one that fits


def check_split(module: nn.Module, shape: Sequence[int], grid: Sequence[int] = (1, 1),
                dtype: torch.dtype = torch.float32) -> None:
    """Refuse, in this process, what SpatialParallel's first forward would refuse on every rank:
    raise :class:`SpatialError` when ``module`` cannot run on inputs of ``shape`` (..., H, W)
    split into ``grid`` (rows, cols) bands (a layer it does not support, a band thinner than a
    layer's halo, a model that decides on a part's own size), naming the layer and what would
    fit. Shapes only (the meta device): no communication, no ``hvd.init()``, no memory for
    activations. Every rank's part is tried, as the first forward tries them.
    """
    layout = tuple(grid)
    if len(layout) != 2 or any(not isinstance(n, int) or n < 1 for n in layout):
        raise SpatialError(f"grid={grid!r}: expected (rows, cols) of positive integers")
    height, width = int(shape[-2]), int(shape[-1])
    if height < layout[0] or width < layout[1]:
        raise SpatialError(f"a {height} x {width} image cannot be split into {layout[0]}x{layout[1]} bands")
    dispatch.refuse_unsplittable_modules(module)
    names = {id(m): name for name, m in module.named_modules()}
    x = torch.empty(tuple(shape), dtype=dtype, device="meta")
    handles = track_modules(module)  # the running module's path, for the messages
    try:
        check(module, names, Part(Grid(*layout), 0, height, width), x, (), {})
    finally:
        for handle in handles:
            handle.remove()


def check(module: nn.Module, names, part: Part, x: torch.Tensor, args, kwargs, comm=None) -> None:
    """Dry-run the model on every rank's part of the image (shapes only), and on the whole image
    as one part, so that every rank refuses alike, before any work: a layer it does not support,
    a band too thin for a layer, a part PyTorch itself refuses, or a forward that runs
    differently on different parts. With the group's ``comm``, each rank dry-runs its own part
    (the last rank the whole image too) and the group gathers the outcomes, which every rank
    then judges alike, as if it had run them all: the check's time does not grow with the
    group. Without, this process runs them all, in rank order."""
    size = part.grid.size
    if comm is None or size == 1:
        outcomes = [_outcome(module, names, dataclasses.replace(part, rank=rank), x, args, kwargs)
                    for rank in range(size)]
        whole = _whole_record(module, names, part, x, args, kwargs) if size > 1 else None
    else:
        mine = _outcome(module, names, part, x, args, kwargs)
        whole = _whole_record(module, names, part, x, args, kwargs) if part.rank == size - 1 else None
        outcomes, whole = _gathered(comm, mine, whole)
    for refused, value in outcomes:  # the first rank's refusal, as a loop over the ranks meets it
        if refused:
            raise SpatialError(value)
    records = [value for _, value in outcomes]
    _compare_records(records)
    if whole is not None:
        _compare_with_one_process(records[0], whole)


def _outcome(module: nn.Module, names, part: Part, x: torch.Tensor, args, kwargs) -> Tuple[bool, Any]:
    """(False, the calls' record) of ``part``'s dry run, or (True, the refusal's message)."""
    try:
        return False, _dry_run(module, names, part, x, args, kwargs)
    except ThinBand as thin:
        return True, f"{thin}; {_fits_instead(module, names, part, x, thin.axis)}"
    except SpatialError as refused:
        return True, str(refused)
    except Exception as err:  # noqa: BLE001 - PyTorch's refusal of one part, said for every rank alike
        where, first = getattr(err, "hpdl_where", "the model's forward"), _first_line(err)
        unseen = _code_hpdl_does_not_see(err)
        if unseen is not None:
            return True, (f"{where}: {unseen} cannot run on a part: its calls run where hpdl does not see them, so "
                          "they would compute on the bare part (PyTorch said: "
                          f"{first}); call the Python function it was made from")
        if not _fits(module, names, Part(Grid(1, 1), 0, part.height, part.width), x, args, kwargs):
            return True, (f"{where}: PyTorch refused in the first forward's check of the split, which runs the "
                          f"model on shapes only (the meta device, no values): {first}; it refuses the whole image "
                          "alike, so the split is not the cause: the forward needs values or a device there (a "
                          "tensor read as an array, made on another device, or sized by its values)")
        return True, (f"{where}: on group rank {part.rank}'s part ({rows_and_cols(part)}) PyTorch refused: {first}; "
                      f"the image may be too small for {part.grid} bands")


def _code_hpdl_does_not_see(err: BaseException) -> Optional[str]:
    """What ran the calls that failed, where it is code whose calls the spatial mode does not see:
    a TorchScript function (its interpreter refused the mode), or a function compiled with
    torch.compile (dynamo failed in its guards); None otherwise."""
    if isinstance(err, torch.jit.Error) or str(err).startswith("The following operation failed in the TorchScript "
                                                                  "interpreter"):
        return "a TorchScript function (torch.jit.script) called in the forward"
    tb = err.__traceback__
    while tb is not None:
        if "/torch/_dynamo/" in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
            return "a function compiled with torch.compile called in the forward"
        tb = tb.tb_next
    return None


def _gathered(comm, mine: Tuple[bool, Any], whole: Optional[List[tuple]]) -> Tuple[List[Tuple[bool, Any]],
                                                                                    Optional[List[tuple]]]:
    """Every rank's outcome, in group rank order, and the whole image's record (from the last
    rank), on every rank: the dry runs' results are plain values (calls' names, places and
    numbers), pickled."""
    data = torch.frombuffer(bytearray(pickle.dumps((mine, whole))), dtype=torch.uint8)
    lengths = comm.allgather(torch.tensor([data.numel()], dtype=torch.int64), None, "split check: sizes").tolist()
    everything = comm.allgather(data, lengths, "split check").numpy().tobytes()
    outcomes, offset = [], 0
    for length in lengths:
        outcome, whole = pickle.loads(everything[offset:offset + length])
        outcomes.append(outcome)
        offset += length
    return outcomes, whole


_REFUSED = "a refusal"  # the record of a dry run on the whole image that was refused


def _whole_record(module: nn.Module, names, part: Part, x: torch.Tensor, args, kwargs) -> List[tuple]:
    """The record of a dry run on the whole image as one part (or of its refusal)."""
    one = Part(Grid(1, 1), 0, part.height, part.width)
    try:
        return _dry_run(module, names, one, x, args, kwargs)
    except Exception as err:  # noqa: BLE001 - the parts ran: the whole image must run alike
        return [(_REFUSED, getattr(err, "hpdl_where", "the model's forward"), (_first_line(err),), ())]


def _compare_with_one_process(record: List[tuple], whole: List[tuple]) -> None:
    """Refuse a forward that computes with a part's own lengths where the ranks' parts are
    alike, so that comparing them shows nothing (97 rows on 2 bands show it: 49 and 48; 96 do
    not). Python reads a length's own value, the part's, in arithmetic with a float first
    (``0.5 * h``, ``s.item() / x.numel()``), in ``int()`` of a length made a float
    (``int(h * 0.5)``), in ``torch.Size.numel()``, and in numpy or ``range``: one process
    computes with the whole image's.
    So the model runs once more on the whole image as one part (``whole``), whose lengths are the
    whole's, and every call must have the same numbers as on a part (``record``)."""
    if whole and whole[0][0] == _REFUSED:  # it ran on every part, not on the whole image
        raise SpatialError(f"the model's forward runs on the ranks' parts but not on the whole image as one part, as "
                           f"one process runs it: {whole[0][2][0]}")
    differing = _first_difference(record, whole)
    if differing is not None:
        step, mine, theirs = differing
        raise SpatialError(
            f"the model's forward computes with a part's own lengths: at call {step}, one process on the whole "
            f"image {_call_text(theirs)} where a part {_call_text(mine)}; {_OWN_LENGTHS}: write h // 2, "
            "round(h * 0.5) or math.floor(h * 0.5), put the length first (h * 0.5), or compute on tensors")


# Where Python reads a part's own length (its int value) instead of the whole image's.
_OWN_LENGTHS = ("Python reads a part's own length, not the whole image's, in int() of it, in arithmetic with a float "
                "first (0.5 * h, s.item() / x.numel()), in int() of a length made a float (int(h * 0.5)), in a "
                "torch.Size's numel() (x.shape[2:].numel(): write math.prod(x.shape[2:])), and in numpy or range()")


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _first_difference(first: List[tuple], other: List[tuple]) -> Optional[Tuple[int, Optional[tuple],
                                                                                 Optional[tuple]]]:
    """The first call (numbered from 1) where two dry runs' records differ, with both calls."""
    for step, (mine, theirs) in enumerate(itertools.zip_longest(first, other), start=1):
        if mine != theirs:
            return step, mine, theirs
    return None


def _compare_records(records: List[List[tuple]]) -> None:
    """Refuse a forward whose calls on the parts differ between ranks: it decided on a part's
    own numbers (``int(x.shape[-2])``), which one process would not."""
    for rank, record in enumerate(records[1:], start=1):
        differing = _first_difference(records[0], record)
        if differing is not None:
            step, mine, theirs = differing
            raise SpatialError(
                f"the model's forward runs differently on the ranks' parts: at call {step} on a part, group rank 0 "
                f"{_call_text(mine)} where group rank {rank} {_call_text(theirs)}; it decides on a part's own size: "
                f"{_OWN_LENGTHS}: decide on the lengths themselves (x.shape[-2] compares as the whole image's)")


def _call_text(call: Optional[tuple]) -> str:
    if call is None:
        return "has finished"
    what, where, args, kwargs = call
    shown = [a for a in args[1:] if a != "T"] + [f"{k}={v}" for k, v in kwargs]
    return f"calls {what}({', '.join(map(str, shown))}) in {where}"


def _dry_run(module: nn.Module, names, part: Part, x: torch.Tensor, args, kwargs) -> List[tuple]:
    state = {name: _for_the_dry_run(t)
             for name, t in itertools.chain(module.named_parameters(), module.named_buffers())}
    meta = tagged(torch.empty(x.shape[:-2] + part.local_size, dtype=x.dtype, device="meta"), part)

    def as_this_part(value: torch.Tensor) -> torch.Tensor:
        # Other inputs that are parts of a map (an image's mask, scattered too): the dry run's
        # rank's part of the same map, as the first input is; a whole tensor (a class label,
        # a per-channel scale) on the meta device with the parameters.
        other = part_of(value)
        if other is None:
            return value if value.is_meta else _for_the_dry_run(value)
        if part.grid.size == 1:  # the whole image as one part (_compare_with_one_process): each map whole
            theirs = Part(part.grid, 0, other.height, other.width)
        elif other.grid != part.grid:
            return value
        else:
            theirs = dataclasses.replace(other, rank=part.rank)
        return tagged(torch.empty(value.shape[:-2] + theirs.local_size, dtype=value.dtype, device="meta"), theirs)

    args, kwargs = map_tensors(tuple(args), as_this_part), map_tensors(dict(kwargs), as_this_part)
    ctx = Context(part.grid, part.rank, None, names, trace=[])
    # The mode entered last: what the dry run itself calls (no_grad) is not in the record.
    with torch.no_grad(), _random_states_kept(), _attributes_for_the_dry_run(module), dispatch.running(ctx):
        torch.func.functional_call(module, state, (meta,) + tuple(args), kwargs)
    return ctx.trace


@contextlib.contextmanager
def _attributes_for_the_dry_run(model: nn.Module) -> Iterator[None]:
    """The model's modules as a dry run needs them, then as it found them. Tensors a forward
    keeps on them besides parameters and buffers (a cache made at the first call) are on the
    meta device during the dry run, as the parameters are (see _dry_run for the ones of no
    dimensions); and what the dry run leaves on them (such a cache, made from meta tensors, or
    a buffer registered) is undone, or the real forward would use it, and the next part's dry
    run would run differently.

    The forward hooks of the user's own (on its modules, and global ones) are left out: a hook
    that logs or keeps activations (feature maps, Grad-CAM) would see each part's dry run (on
    the meta device, where reading values fails), and run once per part more than the forward
    runs. PyTorch's own (weight norm's, spectral norm's and pruning's pre-hooks, which make the
    weight) and hpdl's run."""
    kept = []
    contents = _Contents()
    for module in model.modules():
        tables = {key: dict(module.__dict__[key]) for key in ("_parameters", "_buffers", "_modules")
                  if key in module.__dict__}
        kept.append((module, dict(module.__dict__), tables))
        for key, value in module.__dict__.items():
            if key not in _MODULE_INTERNALS:
                contents.keep(value)
        for key, value in list(module.__dict__.items()):
            if isinstance(value, torch.Tensor) and not value.is_meta:
                module.__dict__[key] = _for_the_dry_run(value)
        for key in ("_forward_pre_hooks", "_forward_hooks"):  # restored with the rest of __dict__
            hooks = module.__dict__.get(key)
            if hooks:
                module.__dict__[key] = type(hooks)((k, h) for k, h in hooks.items() if not _users_hook(h))
    global_hooks = [nn.modules.module._global_forward_pre_hooks, nn.modules.module._global_forward_hooks]
    global_kept = [dict(hooks) for hooks in global_hooks]
    for hooks in global_hooks:  # read by name in torch's module: emptied in place, not replaced
        for k in [k for k, h in hooks.items() if _users_hook(h)]:
            del hooks[k]
    try:
        yield
    finally:
        contents.restore()
        for module, attributes, tables in kept:
            module.__dict__.clear()
            module.__dict__.update(attributes)
            for key, table in tables.items():
                module.__dict__[key].clear()
                module.__dict__[key].update(table)
        for hooks, was in zip(global_hooks, global_kept):
            hooks.clear()
            hooks.update(was)


_MODULE_INTERNALS = frozenset(nn.Module().__dict__)  # PyTorch's own tables on every module
_CONTAINERS_KEPT = 100_000  # past this many, the rest are left as they are (a cache of a dataset's size)


class _Contents:
    """The contents of the dicts, lists and sets a model keeps on its modules (a step counter in
    a dict, a cache of per-size tensors), and of those inside them, put back in place after the
    dry run: a dry run that changed them (``self.state["step"] += 1``) left them changed, once
    more on the rank that also dry-runs the whole image, so the ranks' forwards went different
    ways (a temperature from the counter, different on each rank; a branch on it ran a layer
    on one rank only, whose halo exchange waited for the stall timeout)."""

    def __init__(self):
        self.kept: List[Tuple[Any, Any]] = []
        self.seen: set = set()

    def keep(self, value: Any) -> None:
        stack = [value]
        while stack and len(self.kept) < _CONTAINERS_KEPT:
            item = stack.pop()
            if not isinstance(item, (dict, list, set)) or id(item) in self.seen:
                continue
            self.seen.add(id(item))
            copy = dict(item) if isinstance(item, dict) else list(item) if isinstance(item, list) else set(item)
            self.kept.append((item, copy))
            stack.extend(copy.values() if isinstance(copy, dict) else copy)

    def restore(self) -> None:
        for item, copy in self.kept:
            if isinstance(item, list):
                item[:] = copy
            else:
                item.clear()
                item.update(copy)


def _users_hook(hook: Any) -> bool:
    """Whether a forward hook is the user's own: neither PyTorch's nor hpdl's."""
    fn = getattr(hook, "func", hook)  # a functools.partial's function
    fn = getattr(fn, "__func__", fn)  # a bound method's
    where = getattr(fn, "__module__", None) or ""  # an object's: its class's module
    return not (where == "torch" or where.startswith(("torch.", "hpdl.")))


def _for_the_dry_run(t: torch.Tensor) -> torch.Tensor:
    """A parameter, buffer or kept tensor as the dry run uses it: on the meta device (shapes
    only), but a number held as a tensor of no dimensions stays one, a copy on the CPU (batch
    norm with momentum=None reads 1 / its batch count as a float)."""
    return t.detach().to("cpu", copy=True) if t.dim() == 0 else t.detach().to("meta")


@contextlib.contextmanager
def _random_states_kept() -> Iterator[None]:
    """Every dry run starts from the random states the real forward will see, and leaves them
    so: a model drawing random numbers in Python (stochastic depth) decides alike on every part."""
    python, cpu = random.getstate(), torch.random.get_rng_state()
    numpy_state = None
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy_state = numpy.random.get_state()
    try:
        yield
    finally:
        random.setstate(python)
        torch.random.set_rng_state(cpu)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


def _fits(module: nn.Module, names, part: Part, x: torch.Tensor, args=(), kwargs=None) -> bool:
    try:
        for rank in range(part.grid.size):
            _dry_run(module, names, dataclasses.replace(part, rank=rank), x, args, kwargs or {})
    except ThinBand:
        return False
    except Exception:  # noqa: BLE001 - any refusal: this size does not fit either
        return False
    return True


def _fits_instead(module: nn.Module, names, part: Part, x: torch.Tensor, axis: int) -> str:
    """The smallest image, and the largest grid, that would work (a sentence)."""
    what = ("height", "row") if axis == 0 else ("width", "column")
    length = part.length(axis)
    smallest = _first_fitting(length + 1, length + _SEARCH_LIMIT,
                              lambda n: _fits(module, names, _resized_part(part, axis, n), x))
    parts = part.grid.bands_along(axis)
    largest = next((k for k in range(parts - 1, 0, -1)
                    if _fits(module, names, _regridded_part(part, axis, k), x)), None)
    extent = "high" if axis == 0 else "wide"
    options = []
    if smallest is not None:
        options.append(f"an image at least {smallest} pixels {extent}")
    if largest is not None:
        options.append(f"at most {largest} {what[1]} band" + ("s" if largest > 1 else ""))
    return (f"an image {length} pixels {extent} is too small for {parts} {what[1]} bands: use "
            + (" or ".join(options) if options else f"another model (no {what[0]} up to "
                                                     f"{length + _SEARCH_LIMIT} works)"))


def _resized_part(part: Part, axis: int, length: int) -> Part:
    return part.resized(length, part.width) if axis == 0 else part.resized(part.height, length)


def _regridded_part(part: Part, axis: int, bands: int) -> Part:
    grid = Grid(bands, part.grid.cols) if axis == 0 else Grid(part.grid.rows, bands)
    return dataclasses.replace(part, grid=grid, rank=0)


def _first_fitting(low: int, high: int, fits) -> Optional[int]:
    """The smallest n in [low, high) for which ``fits(n)``, searched in growing steps then halving
    (a dry run per try: a few dozen, not thousands); None when none fits."""
    step, last_misfit = 1, low - 1
    n = low
    while n < high and not fits(n):
        last_misfit, n, step = n, n + step, step * 2
    if n >= high:
        return None
    while n - last_misfit > 1:
        middle = (last_misfit + n) // 2
        if fits(middle):
            n = middle
        else:
            last_misfit = middle
    return n


def rows_and_cols(part: Part) -> str:
    (r0, r1), (c0, c1) = part.rows, part.cols
    return f"rows {r0}-{r1 - 1} and columns {c0}-{c1 - 1} of a {part.height} x {part.width} image"
