"""Models, data and checks shared by the DistributedOptimizer scripts (one process per rank)."""

from __future__ import annotations

import copy
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import hpdl.torch as hvd

BATCH = 12  # the global batch: divisible by 1, 2, 3, and by 2 again per rank for accumulation
CLASSES = 5


class BranchNet(nn.Module):
    """A small conv net with two parallel branches; ``reverse`` computes them in the other order.

    Autograd runs the later-recorded branch first, so reversing the forward order reverses the
    order in which the branches' gradients (and their allreduces) arrive.
    """

    def __init__(self, reverse: bool = False):
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.left = nn.Conv2d(6, 6, 3, padding=1)
        self.right = nn.Conv2d(6, 6, 1)
        self.head = nn.Linear(6 * 4 * 4, CLASSES)
        self.reverse = reverse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        if self.reverse:
            b = self.right(x)
            a = self.left(x)
        else:
            a = self.left(x)
            b = self.right(x)
        x = F.max_pool2d(F.relu(a + b), 2)
        return self.head(x.flatten(1))


def make_pair(seed: int = 0, reverse: bool = False) -> Tuple[nn.Module, nn.Module]:
    """Return (model for the distributed run, identical model for the one-process reference)."""
    torch.manual_seed(seed)
    model = BranchNet(reverse=reverse)
    reference = copy.deepcopy(model)
    reference.reverse = False
    return model, reference


def batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same on every rank."""
    gen = torch.Generator().manual_seed(1234 + step)
    x = torch.randn(BATCH, 3, 8, 8, generator=gen)
    y = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    return x, y


def shard(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's contiguous slice of the global batch."""
    per = t.shape[0] // size
    return t[rank * per:(rank + 1) * per]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def flat_params(model: nn.Module) -> torch.Tensor:
    """All parameters in name order, as one vector."""
    return torch.cat([p.detach().reshape(-1) for _, p in sorted(model.named_parameters())])


def assert_close(model: nn.Module, reference: nn.Module, what: str, rtol: float, atol: float) -> None:
    """Fail naming the first parameter of ``model`` that differs from ``reference``."""
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if not torch.allclose(p, ref[name], rtol=rtol, atol=atol):
            diff = (p - ref[name]).abs().max().item()
            raise AssertionError(f"{what}: parameter {name} differs from the one-process reference by {diff:.3g} "
                                 f"(rtol {rtol}, atol {atol})")


def assert_ranks_equal(model: nn.Module, what: str) -> None:
    """Fail unless every rank holds exactly rank 0's parameters."""
    mine = flat_params(model)
    root = hvd.broadcast(mine, 0, name=f"check.{what}")
    if not torch.equal(mine, root):
        raise AssertionError(f"{what}: rank {hvd.rank()} parameters differ from rank 0's by "
                             f"{(mine - root).abs().max().item():.3g}")


def grads_by_name(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def params_for(model: nn.Module, reverse_order: bool) -> List[torch.Tensor]:
    """The model's parameters, in reverse registration order when asked (as odd ranks do)."""
    params = list(model.parameters())
    return params[::-1] if reverse_order else params


OptimizerFactory = Callable[[List[torch.Tensor]], torch.optim.Optimizer]
