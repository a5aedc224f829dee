"""The pieces of ``hpdl.sr.train`` that are not the training loop itself.

The learning-rate schedule, the moving average of the weights, the CSV (and TensorBoard) log,
validation sharded over the ranks, and errors that every rank agrees on. Like the trainer,
everything here talks to other ranks through the public ``hpdl.torch`` API only.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import math
import sys
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch
from torch import nn

import hpdl.torch as hvd
from hpdl.atomic_file import atomic_write
from hpdl.sr.config import ConfigError
from hpdl.sr.errors import CheckpointError, ModelMismatchError, SRDataError, TrainError
from hpdl.sr.evaluation import EvalResult, evaluate

__all__ = ["EMA", "MetricsLog", "agreed", "json_ready", "lr_at", "spatial_groups", "validate"]

T = TypeVar("T")

# Errors caused by the user's input (files, settings): reported as one line, never a traceback.
USER_ERRORS = (SRDataError, CheckpointError, ModelMismatchError, ConfigError, OSError)


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        return f"{err.filename}: {err.strerror}" if err.filename else err.strerror
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def agreed(what: str, fn: Callable[[], T]) -> T:
    """Run ``fn()`` on every rank; if it raised a user error on any rank, raise it on all of them.

    One rank failing alone (a missing file on its node, say) would otherwise leave the others
    waiting forever in their next collective.
    """
    try:
        result, error = fn(), None
    except USER_ERRORS as err:
        result, error = None, _one_line(err)
    errors = hvd.allgather_object(error, name=f"agreed.{what}")
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        prefix = "" if len(failed) == len(errors) or len(errors) == 1 else f"rank {rank}: "
        raise TrainError(prefix + message)
    return result


def lr_at(update: int, base_lr: float, warmup: int, decay_steps: int, gamma: float) -> float:
    """Learning rate of the update after ``update`` completed ones: linear warm-up, then step decay.

    A pure function of the update count, so a resumed run needs no scheduler state to continue.
    """
    lr = base_lr * (gamma ** (update // decay_steps) if decay_steps else 1.0)
    if warmup and update < warmup:
        lr *= (update + 1) / warmup
    return lr


class EMA:
    """An exponential moving average of a model's weights, kept in a copy of the model.

    Every rank keeps its own: the averaged gradients make every rank's weights, and hence their
    averages, identical, so no communication is needed.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        """Average into ``model`` (a second instance of the trained architecture)."""
        self.decay = decay
        self.model = model.eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the average towards ``model``'s current weights: ema = decay*ema + (1-decay)*w."""
        ema = [t for t in self.model.state_dict().values() if t.is_floating_point()]
        now = [t for t in model.state_dict().values() if t.is_floating_point()]
        torch._foreach_lerp_(ema, now, 1.0 - self.decay)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)


# -- logging ------------------------------------------------------------------------------------

TRAIN_COLUMNS = ("update", "epoch", "loss", "lr", "img_per_s", "elapsed_s")
VAL_COLUMNS = ("update", "psnr", "bicubic_psnr", "ssim", "bicubic_ssim", "images", "seconds")


def _write_rows(f: BinaryIO, columns: Sequence[str], rows: List[List[str]]) -> None:
    text = io.TextIOWrapper(f, encoding="utf-8", newline="")
    writer = csv.writer(text)
    writer.writerow(columns)
    writer.writerows(rows)
    text.flush()
    text.detach()  # the binary file stays open for atomic_write to close


class MetricsLog:
    """Rank 0's log: ``train_log.csv`` and ``val_log.csv`` in the run directory, plus TensorBoard
    event files in ``tb/`` (scalars, and pictures of validation crops) when
    ``torch.utils.tensorboard`` can be imported.

    On resume, rows past the checkpoint's update (written by the interrupted run after its last
    checkpoint) are dropped, so the files read as if the run had never stopped.
    """

    def __init__(self, out_dir: Path, resume_update: Optional[int], note: Callable[[str], None],
                 drop_val_at_resume: bool = False) -> None:
        """``drop_val_at_resume``: drop the validation rows of ``resume_update`` too (the run
        validates that update again)."""
        self._files = {}
        for kind, columns in (("train", TRAIN_COLUMNS), ("val", VAL_COLUMNS)):
            path = out_dir / f"{kind}_log.csv"
            kept = []
            if resume_update is not None:
                kept = _rows_up_to(path, resume_update - 1 if kind == "val" and drop_val_at_resume else resume_update)
            # The kept rows are written whole, then renamed over the old log: a job killed
            # meanwhile leaves the old log, never an empty or half-written one.
            atomic_write(path, functools.partial(_write_rows, columns=columns, rows=kept))
            f = open(path, "a", newline="", encoding="utf-8")
            self._files[kind] = (f, csv.writer(f), columns)
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            note("TensorBoard not installed (pip install tensorboard): writing the CSV logs only")
        else:
            # purge_step hides the events after the checkpoint, as the CSV truncation above does.
            # TensorBoard hides those at purge_step and later: the checkpoint's own update (its
            # loss, its validation) belongs to the run that is continued.
            self._tb = SummaryWriter(str(out_dir / "tb"),
                                     purge_step=resume_update + 1 if resume_update is not None else None)

    def write(self, kind: str, **values: Any) -> None:
        """Append one row (``kind`` is ``train`` or ``val``) and flush it."""
        f, writer, columns = self._files[kind]
        writer.writerow([_cell(values.get(c)) for c in columns])
        f.flush()
        if self._tb is not None:
            for key, value in values.items():
                if key != "update" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{kind}/{key}", value, values["update"])

    @property
    def shows_images(self) -> bool:
        """Whether ``image`` has somewhere to go (TensorBoard is installed)."""
        return self._tb is not None

    def image(self, tag: str, picture: Any, update: int) -> None:
        """Add a uint8 ``(H, W, 3)`` picture to TensorBoard at ``update``."""
        if self._tb is not None:
            self._tb.add_image(tag, picture, update, dataformats="HWC")
            self._tb.flush()

    def close(self) -> None:
        for f, _, _ in self._files.values():
            f.close()
        if self._tb is not None:
            self._tb.close()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)  # repr: every digit survives


def _rows_up_to(path: Path, update: int) -> List[List[str]]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        rows = list(csv.reader(f))[1:]
    return [r for r in rows if r and r[0].isdigit() and int(r[0]) <= update]


# -- validation ---------------------------------------------------------------------------------


def _assign(pairs: Any, size: int) -> List[List[int]]:
    """Split the images over ``size`` ranks with about equal pixel counts (largest first)."""
    shares: List[List[int]] = [[] for _ in range(size)]
    load = [0] * size
    for i in sorted(range(len(pairs)), key=lambda i: -_pixels(pairs, i)):
        least = load.index(min(load))  # ties go to the lowest rank, so every rank computes the same
        shares[least].append(i)
        load[least] += _pixels(pairs, i)
    return [sorted(share) for share in shares]


def _pixels(pairs: Any, i: int) -> int:
    h, w = pairs.lr_size(i)
    return h * w


class _Shard:
    """The pairs of a validation set at ``indices``, with the attributes ``evaluate`` reads."""

    def __init__(self, pairs: Any, indices: List[int]) -> None:
        self.pairs = pairs
        self.indices = indices
        self.scale = pairs.scale
        self.names = [pairs.names[i] for i in indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.pairs[self.indices[i]]

    def source(self, i: int) -> Path:
        return self.pairs.source(self.indices[i])


def validate(model: nn.Module, pairs: Any, space: str, tile: Optional[int], sharded: bool) -> Optional[EvalResult]:
    """PSNR/SSIM of ``model`` and of bicubic on the validation pairs.

    Sharded: the images are split over the ranks by size, every rank scores its share, and the
    per-image records are gathered, so the result (returned on every rank) is the same as one
    rank scoring them all. Not sharded: rank 0 scores all images and the others return None.
    """
    rank, size = hvd.rank(), hvd.size()
    if not sharded or size == 1:
        return agreed("validate", lambda: evaluate(model, pairs, pairs.scale, space, tile=tile) if rank == 0 else None)
    shares = _assign(pairs, size)
    result = agreed("validate", lambda: evaluate(model, _Shard(pairs, shares[rank]), pairs.scale, space, tile=tile))
    gathered = hvd.allgather_object(list(result.records), name="validate.records")
    records: List[Any] = [None] * len(pairs)
    for share, shard_records in zip(shares, gathered):
        for i, record in zip(share, shard_records):
            records[i] = record
    return dataclasses.replace(result, records=tuple(records))


def format_summary(summary: Dict[str, Any]) -> str:
    """Format the end-of-training summary as a two-column table."""
    rows: Sequence[Tuple[str, str]] = [
        ("model", summary["model"]),
        ("ranks", str(summary["world_size"]) + spatial_groups(summary["world_size"], summary.get("spatial", 1))),
        ("updates", f"{summary['updates']} ({summary['updates_this_run']} in this run)"),
        ("global batch", str(summary["global_batch"])),
        ("training time", f"{summary['train_seconds']:.1f} s (wall {summary['wall_seconds']:.1f} s)"),
        ("img/s (all ranks)", f"{summary['img_per_s_median']:.2f} median per update "
                              f"(10-90%: {summary['img_per_s_p10']:.2f}-{summary['img_per_s_p90']:.2f}; "
                              f"mean {summary['img_per_s']:.2f})"),
    ]
    if summary.get("psnr") is not None:
        space = summary["val_space"].upper()
        rows = list(rows) + [
            (f"bicubic PSNR ({space})", f"{summary['bicubic_psnr']:.2f} dB"),
            (f"trained PSNR ({space})", f"{summary['psnr']:.2f} dB ({summary['psnr'] - summary['bicubic_psnr']:+.2f})"),
            ("held-out images", str(summary["val_images"])) if summary.get("val_held_out", True)
            else ("validation images", f"{summary['val_images']} (the training images)"),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def spatial_groups(ranks: int, spatial: int) -> str:
    """`` (2 groups of spatial=2)`` for 4 ranks that split each patch by 2; nothing without spatial."""
    if spatial == 1:
        return ""
    groups = ranks // spatial
    return f" ({groups} group{'s' if groups != 1 else ''} of spatial={spatial})"


def json_ready(summary: Dict[str, Any]) -> Dict[str, Any]:
    """``summary`` with NaN and infinite numbers as None: JSON has no spelling for them."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()}


def say(message: str) -> None:
    """Print a line on rank 0 without breaking a progress bar."""
    if hvd.rank() == 0:
        try:
            from tqdm import tqdm

            tqdm.write(message, file=sys.stdout)
        except ImportError:
            print(message, flush=True)
