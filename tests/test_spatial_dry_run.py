"""The first forward's dry run on the meta device, as a user's forward meets it: lengths read as
truth values, and code whose calls the spatial mode does not see (TorchScript, torch.compile)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpdl.torch import spatial
from hpdl.torch.spatial.geometry import SpatialError
from test_spatial import _Lambda  # the layer that runs the body under test, defined once


def test_a_length_read_as_a_truth_value_decides_as_one_process():
    # `if h % 8:` read the part's own number (int's truth): refused at 12 rows on 2 bands (6 % 8),
    # where one process's 24 % 8 pads nothing.
    def pad_to_eight(y):
        h = y.shape[-2]
        return F.pad(y, [0, 0, 0, 8 - h % 8]) if h % 8 else y

    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), _Lambda(pad_to_eight))
    spatial.check_split(model, (1, 2, 24, 8), (2, 1))
    spatial.check_split(model, (1, 2, 20, 8), (2, 1))


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.erf(x / 1.41421))


def _max_plus_self(y):
    return F.max_pool2d(y, 3, 1, 1) + y


def test_code_whose_calls_hpdl_does_not_see_is_refused_naming_it():
    # A TorchScript function and a function compiled with torch.compile inside the forward were
    # refused as if the forward needed values or a device ("The following operation failed in the
    # TorchScript interpreter", dynamo's "name '___get_torch_function_mode_stack_at' is not defined").
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script's own
        scripted = torch.jit.script(_gelu)
    for body, what in ((scripted, "a TorchScript function"),
                       (torch.compile(_max_plus_self, backend="eager"), "a function compiled with torch.compile")):
        model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), _Lambda(body))
        with pytest.raises(SpatialError, match=rf"^1 \(_Lambda\): {what} .*called in the forward cannot run on a "
                                               r"part: its calls run where hpdl does not see them.*call the Python "
                                               r"function it was made from"):
            spatial.check_split(model, (1, 2, 12, 8), (2, 1))
