"""Shared helpers for scripts that run under mpiexec or torchrun (one process per rank)."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import Dict, Iterator, Optional

import torch

ALL_DTYPES = [
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool,
]


def rank_tensor(rank: int, shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor that depends on (rank, seed), small enough that sums stay exact in every dtype."""
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        # Multiples of 1/4 in [-4, 4]: exactly representable, sums of a few exact in fp16/bf16.
        return (torch.randint(-16, 17, shape, generator=gen).to(torch.float64) / 4).to(dtype)
    low = 0 if dtype == torch.uint8 else -5
    return torch.randint(low, 6, shape, generator=gen).to(dtype)


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Fail with a message naming ``what`` unless the tensors agree (exact for integers)."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: got {actual.dtype}{tuple(actual.shape)}, expected {expected.dtype}{tuple(expected.shape)}")
    if expected.dtype.is_floating_point:
        ok = torch.allclose(actual.double(), expected.double(), rtol=1e-2 if expected.element_size() == 2 else 1e-6, atol=1e-3)
    else:
        ok = torch.equal(actual, expected)
    if not ok:
        raise AssertionError(f"{what}: values differ\n got {actual.flatten()[:8]}\n exp {expected.flatten()[:8]}")


def adasum_pair(a, b):
    """Horovod's pairwise Adasum, evaluated directly in float64."""
    dot, a_normsq, b_normsq = a.dot(b), a.dot(a), b.dot(b)
    a_coeff = 1 - dot / a_normsq / 2 if a_normsq >= 1e-8 else 1.0
    b_coeff = 1 - dot / b_normsq / 2 if b_normsq >= 1e-8 else 1.0
    return a_coeff * a + b_coeff * b


def adasum_reference(vectors):
    """The recursion on whole vectors: pairs at distance 1, then 2, 4, ... (rank order)."""
    vectors = [v.double().flatten() for v in vectors]
    while len(vectors) > 1:
        vectors = [adasum_pair(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def run_main(main) -> None:
    """Run ``main()``; on any exception print it and exit 1 at once, so no rank is left waiting."""
    import faulthandler

    budget = float(os.environ.get("HPDL_TEST_TIMEOUT", "0"))
    if budget > 10:
        # Print every thread's stack shortly before the harness kills a hung job.
        faulthandler.dump_traceback_later(budget - 5, exit=False)
    try:
        main()
        faulthandler.cancel_dump_traceback_later()
    except BaseException:  # noqa: BLE001 - any failure must end this rank visibly
        rank = os.environ.get("PMI_RANK", os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?")))
        sys.stderr.write(f"[rank {rank}] FAILED\n{traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)


def option_arg(argv: list, option: str, default: Optional[str] = None) -> Optional[str]:
    """Take ``option VALUE`` out of ``argv`` (in place); return VALUE (``default`` without it)."""
    if option not in argv:
        return default
    at = argv.index(option)
    value = argv[at + 1]
    del argv[at:at + 2]
    return value


def device_arg(argv: list) -> str:
    """Take ``--device cpu|cuda`` out of ``argv`` (in place); return it (default cpu)."""
    return option_arg(argv, "--device", "cpu")


@contextlib.contextmanager
def engine_with(settings: Dict[str, str]) -> Iterator[None]:
    """hvd.init() under these HPDL_* settings (read at init), hvd.shutdown() after, the environment
    then as before: checks under other settings in the same job, without starting another."""
    import hpdl.torch as hvd

    before = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    hvd.init()
    try:
        yield
    finally:
        hvd.shutdown()
        for key, value in before.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


def rank_device(name: str) -> torch.device:
    """This rank's device after hvd.init(): its GPU (hvd.local_gpu(), made current) for "cuda".

    TF32 off: the checks compare against float32 references computed on other batch splits.
    """
    import hpdl.torch as hvd

    if name != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", hvd.local_gpu())
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return device
