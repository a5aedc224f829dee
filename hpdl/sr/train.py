"""Train a super-resolution model data-parallel: ``hpdl sr train --config demo`` or ``train(load_config("demo"))``.

``train`` reads top to bottom like a training script: join the ranks, open the data, build the
model and optimizer, start (or resume), the training loop, the end; what each step involves is
in the functions below it. The same code runs as one process or as one rank of many
under ``hpdl run``, mpiexec, srun or torchrun: ``hvd.init()`` reads the launcher's environment.
Every rank trains on its own shard of each epoch and the optimizer averages the gradients, so
the weights stay identical everywhere. Rank 0 alone prints, logs and writes checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import hpdl.torch as hvd
from hpdl.atomic_file import atomic_write
from hpdl.sr.checkpoint import (capture_rng_state, load_checkpoint, make_checkpoint, refuse_nonfinite,
                                restore_rng_state, save_checkpoint)
from hpdl.sr.config import ConfigError, TrainConfig, resolve_device
from hpdl.sr.datasets import build_train_dataset, build_val_dataset, check_pairs, parse_range
from hpdl.sr.errors import CheckpointError, TrainError
from hpdl.sr.evaluation import keep_measurable
from hpdl.sr.models import build_model_from_config, count_parameters, load_pretrained
from hpdl.sr.registry import make_config
from hpdl.sr.out_dir import OutDirLock, earlier_run_refusal, prepare_out_dir, write_config
from hpdl.sr.sampler import ShardSampler
from hpdl.sr.spatial_train import patch_forward, spatial_layout
from hpdl.sr.threads import ThreadCount, thread_oversubscription, use_threads
from hpdl.sr.train_state import (EMA, MetricsLog, agreed, format_summary, json_ready, lr_at, say, spatial_groups,
                                 validate)
from hpdl.torch.mixed_precision import MixedPrecision

T = TypeVar("T")

# The validation crops shown in TensorBoard: how many images, and the crop side in HR pixels.
SAMPLE_IMAGES = 3
SAMPLE_CROP = 96

__all__ = ["TrainError", "format_summary", "json_ready", "train"]

COMPRESSION = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16, "bf16": hvd.Compression.bf16}

# The settings a sampler's resume state depends on (with the training images themselves).
SAMPLER_KEYS = ("data", "train_range", "repeat", "on_bad_image", "seed")

# Settings that change what is trained. Resuming with other values works but is no longer the
# same run, so it is pointed out; total_updates, val_every, out_dir and the like may change.
TRAJECTORY_KEYS = ("model", "scale", "n_resblocks", "n_feats", "data", "train_range", "patch_size", "batch_size",
                   "global_batch_size", "repeat", "augment", "lr", "betas", "eps", "lr_decay_steps", "gamma",
                   "warmup_updates", "scale_lr_with_world", "compression", "ema_decay", "seed", "downscaler", "amp")


def train(cfg: TrainConfig) -> Dict[str, Any]:
    """Train as ``cfg`` says and return a summary (PSNR, img/s, updates, time).

    The PSNR entries are None on ranks other than 0 when validation is not sharded.
    """
    wall_start = time.perf_counter()
    # Rank 0 holds out_dir's lock from before its first look at out_dir to the end, so that a
    # second run started in it meanwhile is refused instead of interleaving its files.
    with OutDirLock(Path(cfg.out_dir)) as lock:
        world = _join(cfg, lock)
        data = _open_data(cfg, world)
        model, optimizer, ema, base_lr = _model_and_optimizer(cfg, world)
        # With spatial=S, this rank's row band of each patch (spatial_train.py); else whole patches.
        net = patch_forward(model, world.layout, cfg.patch_size, compiled=cfg.compile)
        precision = agreed("amp", lambda: _mixed_precision(cfg.amp, world.device))
        progress = _start_or_resume(cfg, world, model, optimizer, ema, precision, data.sampler, lock)
        if progress.resumed and progress.update >= cfg.total_updates:
            # Finishing again would validate again (a second row for the same weights) and
            # replace the summary's throughput with that of a run of no updates.
            finished = _from_rank0("finished", lambda: _finished_summary(Path(cfg.out_dir), progress.update))
            if finished is not None:
                say(f"note: the run in out_dir={cfg.out_dir} ended at update {progress.update} and "
                    f"total_updates={cfg.total_updates}: nothing to train (raise total_updates to continue it)")
                return finished
        run = _Run(cfg, world, data, model, optimizer, ema, precision, base_lr, progress)
        say(run.describe())

        # The training loop: one update per batch, until total_updates.
        batches = _batches(data.loader, data.sampler, data.train_set)
        model.train()
        while progress.update < cfg.total_updates:
            step_start = time.perf_counter()
            step_in_pass, epoch, (lr_img, hr_img) = next(batches)
            lr_img, hr_img = lr_img.to(world.device, non_blocking=True), hr_img.to(world.device, non_blocking=True)
            lr = lr_at(progress.update, base_lr, cfg.warmup_updates, cfg.lr_decay_steps, cfg.gamma)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with precision.autocast():  # amp: the forward in 16 bits, the weights stay float32
                sr_part = net(net.scatter(lr_img))
            # L1, as EDSR: sharper than L2 and better PSNR. On this rank's part of the patches as on
            # the whole: SpatialParallel weighs each part's loss by its share of the pixels.
            loss = F.l1_loss(sr_part.float(), net.scatter(hr_img))
            optimizer.zero_grad(set_to_none=True)
            precision.backward(loss)  # the gradient allreduces start in here
            precision.step(optimizer)  # waits for them, then Adam (with overlap_forward: the next forward does)
            if ema is not None:
                optimizer.apply_pending_updates()  # the average needs this step's weights
                ema.update(model)
            run.count_update(net.whole_mean(loss, sr_part), lr, epoch, time.perf_counter() - step_start)
            run.validate_and_checkpoint(step_in_pass)
        return run.finish(wall_start)


# -- the steps of train() ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _World:
    """This rank's place in the job, and what follows from it."""

    rank: int
    size: int
    device: torch.device
    batch_size: int  # per replica: a rank, or a group of `spatial` ranks sharing each patch
    threads: ThreadCount  # torch's threads on this rank, and where the number came from
    layout: Optional[Any] = None  # hpdl.torch.spatial.Layout of the groups (spatial > 1)

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def replicas(self) -> int:
        """How many data-parallel replicas take different patches."""
        return self.layout.data if self.layout is not None else self.size

    @property
    def replica(self) -> int:
        return self.layout.replica if self.layout is not None else self.rank

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.replicas


@dataclasses.dataclass
class _Data:
    train_set: Any
    val_set: Any  # None when the run does not validate
    val_held_out: bool  # False: val_set is the training images (a layout without a validation split)
    sampler: ShardSampler
    loader: DataLoader


@dataclasses.dataclass
class _Progress:
    update: int = 0
    train_seconds: float = 0.0
    resumed: bool = False
    # The updates since the last train_log row when the checkpoint was written: (the row's update,
    # the sum of their losses averaged over ranks), so that the next row's mean covers them all.
    log_window: Optional[Tuple[int, float]] = None


def _on_rank0(what: str, fn: Callable[[], T]) -> Optional[T]:
    """Run ``fn`` on rank 0 alone (None elsewhere); a user error there is raised on every rank."""
    return agreed(what, lambda: fn() if hvd.rank() == 0 else None)


def _from_rank0(name: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 and return its result on every rank."""
    return hvd.broadcast_object(fn() if hvd.rank() == 0 else None, 0, name=f"train.{name}")


def _join(cfg: TrainConfig, lock: "OutDirLock") -> _World:
    """Join the job: device, threads, seeds and per-rank batch; refuse an out_dir holding an earlier
    run, or in use by a live one. Threads: ``threads``, else ``OMP_NUM_THREADS``, else this rank's
    share of its node's cores (hpdl/sr/threads.py).
    """
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    device = agreed("device", lambda: resolve_device(cfg.device, "device", hvd.local_gpu))
    if device.type == "cuda":
        # This rank's GPU is the current one from now on: allocations that name no index, and
        # the copies of pinned DataLoader batches, go there.
        torch.cuda.set_device(device)
    # Before any work, so that nothing of an earlier run is lost by mistake. Rank 0 owns out_dir
    # and decides; every rank raises its verdict alike. An out_dir that does not exist yet is
    # locked when it is made (prepare_out_dir): making it now would leave it behind after an error.
    refusal = _from_rank0("out_dir", lambda: _agreed_refusal(
        lambda: lock.refusal(existing_only=True) or earlier_run_refusal(Path(cfg.out_dir), cfg)))
    if refusal is not None:
        raise TrainError(refusal)
    if cfg.threads:
        warning = thread_oversubscription(cfg.threads)  # every rank takes part: it gathers
        if warning is not None:
            print(f"hpdl: warning: {warning}; the threads will contend for them", file=sys.stderr, flush=True)
    threads = use_threads(cfg.threads)
    # Per-rank seeds keep random draws (dropout, say) independent between ranks; the initial
    # weights all come from rank 0, so the models still start identical.
    if cfg.seed + size > 2**32:  # the config left room for MAX_SEED_RANKS ranks; this job has more
        raise TrainError(f"seed={cfg.seed}: seed + rank must fit 32 bits, and this job has {size} ranks")
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)
    layout = spatial_layout(cfg.spatial)  # groups of ranks sharing each patch, if spatial > 1
    replicas = size // cfg.spatial
    if cfg.global_batch_size and cfg.global_batch_size % replicas:
        over = f"{size} ranks" if cfg.spatial == 1 else f"{replicas} groups of spatial={cfg.spatial} ranks"
        raise TrainError(f"global_batch_size={cfg.global_batch_size} does not split over {over}")
    batch_size = cfg.global_batch_size // replicas if cfg.global_batch_size else cfg.batch_size
    return _World(rank, size, device, batch_size, threads, layout)


def _open_data(cfg: TrainConfig, world: _World) -> _Data:
    """Open the training patches (this rank's shard of each epoch) and the validation images.

    Every image is decoded and checked here, in the main process, so that a bad file fails now
    with its name; the DataLoader workers only crop memory-mapped arrays. A separate validation
    set is checked first, without decoding, so that its errors do not wait for the training set's.
    """
    validating = cfg.val_at_end or cfg.val_every > 0
    if validating and cfg.val_data:
        agreed("validation files", lambda: check_pairs(
            cfg.val_data, cfg.scale, "val", cache_dir=cfg.cache_dir, index_range=_range(cfg.val_range),
            max_pixels=cfg.max_pixels, limit_name="max_pixels"))
    train_set = agreed("train data", lambda: build_train_dataset(
        cfg.data, cfg.scale, patch_size=cfg.patch_size, repeat=cfg.repeat, augment=cfg.augment, seed=cfg.seed,
        cache_dir=cfg.cache_dir, index_range=_range(cfg.train_range), on_bad_image=cfg.on_bad_image,
        downscaler=cfg.downscaler, max_pixels=cfg.max_pixels, limit_name="max_pixels"))
    if len(train_set) // world.replicas < world.batch_size:
        who = "ranks" if world.layout is None else "groups of ranks"
        raise TrainError(f"{len(train_set)} patches per epoch give each of {world.replicas} {who} fewer than "
                         f"batch_size={world.batch_size}; raise repeat")
    val_set = agreed("validation data", lambda: _measurable(build_val_dataset(
        cfg.val_data or cfg.data, cfg.scale, cache_dir=cfg.cache_dir, index_range=_range(cfg.val_range),
        on_bad_image=cfg.on_bad_image, max_pixels=cfg.max_pixels, downscaler=cfg.downscaler,
        limit_name="max_pixels"), cfg)) if validating else None
    # DIV2K and the embedded photos have a validation split; any other layout is used whole, so
    # without a val_data of its own the run validates on what it trains on, and says so.
    held_out = val_set is None or val_set.layout in ("div2k", "embedded") or (
        cfg.val_data is not None and os.path.realpath(cfg.val_data) != os.path.realpath(cfg.data))
    if not held_out:
        say(f"note: data={cfg.data} has no validation split and val_data is not another set: validation "
            "scores the training images (set val_data= for held-out scores)")
    # The sampler gives each replica (a rank, or a group of ranks that split each patch) its share
    # of every epoch's permutation, the same number of samples on every replica (at most
    # replicas - 1 repeated to even them); drop_last keeps every batch full, so all ranks make as
    # many steps.
    sampler = ShardSampler(train_set, rank=world.replica, num_replicas=world.replicas, seed=cfg.seed)
    loader = DataLoader(train_set, batch_size=world.batch_size, sampler=sampler, num_workers=cfg.workers,
                        drop_last=True, pin_memory=world.device.type == "cuda")
    return _Data(train_set, val_set, held_out, sampler, loader)


def _model_and_optimizer(cfg: TrainConfig, world: _World) -> Tuple[torch.nn.Module, Any, Optional[EMA], float]:
    """Build the model, the distributed Adam over its trainable parameters, and the EMA; return the base lr.

    Frozen parameters (EDSR's MeanShift convs) have no gradient and stay out of the optimizer.
    """
    model = _build_model(cfg).to(world.device)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # With per-rank batches the global batch grows with the ranks; the linear scaling rule
    # (Goyal et al.) grows the lr with it, and the warm-up avoids the early instability.
    base_lr = cfg.lr * (world.replicas if cfg.scale_lr_with_world else 1)
    optimizer = torch.optim.Adam([p for _, p in named], lr=base_lr, betas=cfg.betas, eps=cfg.eps)
    # Every gradient's allreduce starts inside backward(), as soon as autograd has produced it;
    # step() waits for them and then runs Adam on the averaged gradients.
    # With overlap_forward, step() only starts the update: each module's parameters get theirs
    # when the next forward reaches it (or when they are saved), so the last gradients'
    # exchange overlaps that forward.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                         compression=COMPRESSION[cfg.compression],
                                         overlap_forward=model if cfg.overlap_forward else None)
    ema = EMA(_build_model(cfg).to(world.device), cfg.ema_decay) if cfg.ema_decay else None
    return model, optimizer, ema, base_lr


def _start_or_resume(cfg: TrainConfig, world: _World, model: torch.nn.Module, optimizer: Any,
                     ema: Optional[EMA], precision: MixedPrecision, sampler: ShardSampler,
                     lock: "OutDirLock") -> _Progress:
    """Start from scratch or from pretrained weights, or resume; leave every rank with rank 0's state."""
    out_dir = Path(cfg.out_dir)
    refusal = _from_rank0("out_dir.prepare", lambda: _agreed_refusal(lambda: prepare_out_dir(out_dir, cfg, lock)))
    if refusal is not None:
        raise TrainError(refusal)
    resume_path = _from_rank0("resume_path", lambda: _resume_path(cfg, out_dir))
    if resume_path is not None:
        return _resume(resume_path, cfg, world, model, optimizer, ema, precision, sampler)
    if cfg.pretrained:
        report = _on_rank0("pretrained", lambda: _load_pretrained(cfg.pretrained, model))
        say(f"started from {cfg.pretrained}: {report}")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    # A fresh optimizer has no state to send: broadcasting it would first create one with a
    # zero-gradient step, which advances Adam's step count.
    if ema is not None:
        ema.model.load_state_dict(model.state_dict())
    return _Progress()


def _resume(path: str, cfg: TrainConfig, world: _World, model: torch.nn.Module, optimizer: Any,
            ema: Optional[EMA], precision: MixedPrecision, sampler: ShardSampler) -> _Progress:
    """Continue the run of checkpoint ``path``: weights, optimizer, EMA, loss scale, data order and RNG streams.

    Rank 0 reads the checkpoint (only it needs the file) and sends the weights, the optimizer
    state and the small rest to the others.
    """
    state = _on_rank0("resume", lambda: _restore(path, cfg, model, optimizer, ema))
    state = hvd.broadcast_object(state, 0, name="train.state")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if ema is not None:
        hvd.broadcast_parameters([(f"ema.{k}", v) for k, v in ema.model.state_dict().items()], root_rank=0)
    precision.load_state_dict(state["scaler"])  # None from a run without loss scaling: a fresh scale
    try:
        sampler.load_state_dict(state["sampler"])
    except ValueError as err:  # e.g. another `repeat` or another set of images
        changed = [f"{k} ({state['config'].get(k)!r} -> {getattr(cfg, k)!r})" for k in SAMPLER_KEYS
                   if state["config"].get(k) != getattr(cfg, k)]
        raise TrainError(f"{path}: cannot continue its data order: {err}; the patches per epoch follow "
                         f"{', '.join(SAMPLER_KEYS)} and the images found"
                         + (f" (changed: {', '.join(changed)})" if changed else "")) from None
    if world.rank < len(state["rng"]):
        restore_rng_state(state["rng"][world.rank], world.device)
    now = cfg.to_dict()
    changed = ", ".join(f"{k} ({state['config'].get(k)!r} -> {now[k]!r})"
                        for k in TRAJECTORY_KEYS if state["config"].get(k) != now[k])
    say(f"resumed from {path} at update {state['update']}" + (f"; changed: {changed}" if changed else ""))
    before = len(state["rng"]), int(state["config"].get("spatial", 1))  # ranks, and ranks per patch
    if before != (world.size, cfg.spatial):
        before_replicas = before[0] // before[1]
        what = ""
        if not cfg.global_batch_size and before_replicas != world.replicas:
            # A per-replica batch: the global batch (and a lr scaled with the replicas) follows the replicas.
            what = (f": the global batch is {world.global_batch} patches per update, "
                    f"{world.batch_size * before_replicas} before")
            if cfg.scale_lr_with_world:
                what += f", and the lr is scaled by {world.replicas} instead of {before_replicas}"
        say(f"note: the checkpoint was written by {before[0]} ranks{spatial_groups(*before)}, this job has "
            f"{world.size}{spatial_groups(world.size, cfg.spatial)}{what}")
    window = state["log_window"]
    return _Progress(state["update"], state["train_seconds"], resumed=True,
                     log_window=(window["since"], window["loss_sum"]) if window else None)


class _Run:
    """The bookkeeping around the loop: counters, the log, validation, checkpoints and the end."""

    def __init__(self, cfg: TrainConfig, world: _World, data: _Data, model: torch.nn.Module, optimizer: Any,
                 ema: Optional[EMA], precision: MixedPrecision, base_lr: float, progress: _Progress) -> None:
        self.cfg, self.world, self.data, self.progress = cfg, world, data, progress
        self.model, self.optimizer, self.ema, self.base_lr = model, optimizer, ema, base_lr
        self.precision = precision
        self.out_dir = Path(cfg.out_dir)
        self.start_update = progress.update
        # Resumed at its end (killed before its summary was written): finish() validates again, so
        # the interrupted finish's validation row goes, as a row past the checkpoint would.
        validates_again = progress.resumed and progress.update >= cfg.total_updates and cfg.val_at_end
        self.log = MetricsLog(self.out_dir, progress.update if progress.resumed else None, say,
                              drop_val_at_resume=validates_again) if world.master else None
        if world.master:
            kept = write_config(self.out_dir, cfg.to_dict(), progress.update if progress.resumed else None)
            if kept:
                say(f"note: settings changed on resume: config.yaml holds them from update {progress.update + 1}, "
                    f"{kept} those before")
        self.bar = _progress(world.master and cfg.progress, cfg.total_updates, progress.update)
        self.loss_sum = torch.zeros((), device=world.device)
        self.logged_at = progress.update  # the update of the last train_log row
        if progress.log_window is not None:
            self.logged_at = progress.log_window[0]
            self.loss_sum += progress.log_window[1]
        # The first update of this rank whose loss was not finite (inf: none), kept on the device:
        # reading it every update would be a sync point per step on a GPU.
        self.first_nonfinite = torch.full((), math.inf, dtype=torch.float64, device=world.device)
        self.last_checkpoint: Optional[int] = progress.update if progress.resumed else None
        # img/s counts the updates of this run since the last row (or its start), over their time.
        self.timed_from, self.log_clock = progress.update, time.perf_counter()
        self.step_seconds: List[float] = []  # of every update of this run, for img/s
        self.last_scores: Optional[Dict[str, Any]] = None  # of the last validation

    def describe(self) -> str:
        """Return the line that says what is trained, on how many ranks, with what batches."""
        w, cfg = self.world, self.cfg
        ranks = f"{w.size} rank(s)" + spatial_groups(w.size, cfg.spatial)
        return (f"{self.model.config.describe()}, {count_parameters(self.model):,} parameters; {ranks} x "
                f"batch {w.batch_size} of {cfg.patch_size}px patches; {len(self.data.train_set)} patches per epoch; "
                f"{w.threads} on {w.device}"
                + (f", amp {cfg.amp}" if self.precision.enabled else ""))

    def count_update(self, loss: torch.Tensor, lr: float, epoch: int, seconds: float) -> None:
        """Count a finished update; every log_every updates, log the mean loss over ranks and img/s."""
        p, cfg = self.progress, self.cfg
        p.update += 1
        self.loss_sum += loss.detach()  # no .item() here: on a GPU that would be a sync point per step
        self.first_nonfinite = torch.where(torch.isfinite(loss.detach()), self.first_nonfinite,
                                           self.first_nonfinite.clamp(max=p.update))
        p.train_seconds += seconds
        self.step_seconds.append(seconds)
        self.bar.update(1)
        if p.update % cfg.log_every and p.update != cfg.total_updates:
            return
        # The mean over ranks and over the updates since the last line (a collective: all ranks).
        mean_loss = hvd.allreduce(self.loss_sum / (p.update - self.logged_at), name="train.loss").item()
        if not math.isfinite(mean_loss):  # on every rank alike: the mean is every rank's
            self.stop_if_diverged()
        now = time.perf_counter()
        img_per_s = (p.update - self.timed_from) * self.world.global_batch / (now - self.log_clock)
        if self.log is not None:
            self.log.write("train", update=p.update, epoch=epoch, loss=mean_loss, lr=lr, img_per_s=img_per_s,
                           elapsed_s=p.train_seconds)
        self.bar.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{lr:.2e}", img_s=f"{img_per_s:.1f}", refresh=False)
        self.loss_sum.zero_()
        self.logged_at, self.timed_from, self.log_clock = p.update, p.update, now

    def validate_and_checkpoint(self, step_in_pass: int) -> None:
        """Validate and write last.pt when they are due; neither counts as training time."""
        update, cfg = self.progress.update, self.cfg
        pause = time.perf_counter()
        # The last update's is finish()'s validation, with val_at_end; without it, it is one like any other.
        validating = cfg.val_every and update % cfg.val_every == 0 and (update < cfg.total_updates
                                                                        or not cfg.val_at_end)
        checkpointing = (cfg.ckpt_every and update % cfg.ckpt_every == 0) or update == cfg.total_updates
        if validating or checkpointing:
            self.stop_if_diverged()  # a checkpoint of NaN weights would replace the last good one
        if validating:
            self.validate()
        if checkpointing:
            self.checkpoint(step_in_pass)
        self.log_clock += time.perf_counter() - pause

    def stop_if_diverged(self) -> None:
        """Raise ``TrainError`` on every rank if a loss or a weight has become NaN or infinite.

        A collective: all ranks call it at the same points, and all raise alike. Nothing is
        saved after it, so out_dir keeps the last checkpoint written before.
        """
        models = [self.model] + ([self.ema.model] if self.ema is not None else [])
        finite_weights = all(bool(torch.isfinite(t).all()) for m in models for t in m.state_dict().values()
                             if t.is_floating_point())
        mark = self.first_nonfinite if finite_weights else self.first_nonfinite.clamp(max=self.progress.update)
        first = hvd.allreduce(mark, name="train.nonfinite", op=hvd.Min).item()
        if math.isinf(first):
            return
        kept = (f"; out_dir={self.out_dir} keeps last.pt of update {self.last_checkpoint}"
                if self.last_checkpoint is not None else " before the first checkpoint")
        raise TrainError(f"training diverged: the loss or the weights became NaN or infinite at update {int(first)} "
                         f"(lr={self.cfg.lr:g} too high?); stopped{kept}")

    @property
    def weights(self) -> torch.nn.Module:
        """The weights to use: the moving average if there is one."""
        return self.ema.model if self.ema is not None else self.model

    def validate(self) -> Optional[Dict[str, Any]]:
        """Score the weights on the validation images; rank 0 logs the means and a grid of sample crops."""
        cfg, update = self.cfg, self.progress.update
        result = validate(self.weights, self.data.val_set, cfg.val_space, cfg.val_tile or None, cfg.val_sharded)
        if result is None:
            return None  # not sharded, and not rank 0
        m = result.means()
        record = {"update": update, "psnr": m["psnr"], "bicubic_psnr": m["bicubic_psnr"], "ssim": m["ssim"],
                  "bicubic_ssim": m["bicubic_ssim"], "images": len(result.records),
                  "seconds": sum(r.seconds for r in result.records)}
        self.last_scores = record
        if self.log is not None:
            self.log.write("val", **record)
            if self.log.shows_images:
                self.log.image("val/samples", _sample_grid(self.weights, self.data.val_set), update)
            say(f"update {update}: {cfg.val_space.upper()}-PSNR {m['psnr']:.2f} dB "
                f"(bicubic {m['bicubic_psnr']:.2f}) on {len(result.records)} "
                f"{'held-out' if self.data.val_held_out else 'training'} images")
        return record

    def checkpoint(self, step_in_pass: int) -> None:
        """Write out_dir/last.pt with everything a resumed run needs (on rank 0; all ranks take part)."""
        # Every rank's RNG states go into the checkpoint, so every rank can continue its streams.
        rng = hvd.allgather_object(capture_rng_state(self.world.device), name="train.rng")
        # The losses since the last train_log row, which a resumed run's next row averages too.
        window = {"since": self.logged_at, "loss_sum": hvd.allreduce(self.loss_sum, name="train.loss_window").item()}
        p = self.progress
        _on_rank0("checkpoint", lambda: save_checkpoint(self.out_dir / "last.pt", make_checkpoint(
            self.model, optimizer=self.optimizer.state_dict(), ema=self.ema.state_dict() if self.ema else None,
            scaler=self.precision.state_dict(),
            # DataLoader workers fetch ahead of training: count what was trained on.
            sampler=self.data.sampler.state_dict(consumed=step_in_pass * self.world.batch_size), rng=rng,
            schedule={"update": p.update, "base_lr": self.base_lr}, update=p.update,
            train_seconds=p.train_seconds, world_size=self.world.size, config=self.cfg.to_dict(),
            log_window=window)))
        self.last_checkpoint = p.update

    def finish(self, wall_start: float) -> Dict[str, Any]:
        """Save the weights, validate them once more, draw the curves; return the summary."""
        self.bar.close()
        cfg, p, w = self.cfg, self.progress, self.world
        self.stop_if_diverged()
        _on_rank0("weights", lambda: save_checkpoint(self.out_dir / "model.pt",
                                                     make_checkpoint(self.weights, update=p.update)))
        if cfg.val_at_end and p.update > 0:
            scores = self.validate()
        else:  # the scores of these weights, if val_every validated them at the last update
            scores = self.last_scores if self.last_scores and self.last_scores["update"] == p.update else None
        summary = {
            "model": self.weights.config.describe(), "world_size": w.size, "spatial": cfg.spatial, "updates": p.update,
            "updates_this_run": p.update - self.start_update, "global_batch": w.global_batch,
            "patch_size": cfg.patch_size, "train_seconds": p.train_seconds,
            "wall_seconds": time.perf_counter() - wall_start,
            **_throughput(self.step_seconds, w.global_batch),
            "threads_per_rank": torch.get_num_threads(), "amp": cfg.amp, "val_space": cfg.val_space,
            "psnr": scores["psnr"] if scores else None, "bicubic_psnr": scores["bicubic_psnr"] if scores else None,
            "val_images": scores["images"] if scores else 0, "val_held_out": self.data.val_held_out,
            "out_dir": str(self.out_dir),
        }
        if self.log is not None:
            self.log.close()
            _draw_curves(self.out_dir)
            _write_json(self.out_dir / "summary.json", summary)
        return summary


# -- helpers of the set-up above ------------------------------------------------------------------


def _throughput(step_seconds: List[float], global_batch: int) -> Dict[str, float]:
    """img/s over the updates of this run: the mean (images / time), the median and 10-90th percentiles.

    The first update is left out (it pays for allocation and the first negotiations); the median
    and percentiles of the per-update rates are what a noisy shared machine cannot skew much.
    """
    steady = step_seconds[1:] or step_seconds
    if not steady:
        return {"img_per_s": 0.0, "img_per_s_median": 0.0, "img_per_s_p10": 0.0, "img_per_s_p90": 0.0}
    rates = sorted(global_batch / t for t in steady)
    return {"img_per_s": global_batch * len(steady) / sum(steady), "img_per_s_median": statistics.median(rates),
            "img_per_s_p10": rates[len(rates) // 10], "img_per_s_p90": rates[-1 - len(rates) // 10]}


def _measurable(val_set: Any, cfg: TrainConfig) -> Any:
    """``val_set``, once every image is known to be large enough to score (or, with
    on_bad_image=skip, without those that are not): now, not after training."""
    return keep_measurable(val_set, cfg.scale, cfg.val_space, cfg.on_bad_image)


def _mixed_precision(amp: str, device: torch.device) -> MixedPrecision:
    try:
        return MixedPrecision(amp, device)
    except ValueError as err:  # amp=fp16 on the CPU, bf16 on a GPU without it: a setting that cannot be met
        raise ConfigError(str(err)) from None


def _range(text: Optional[str]) -> Optional[Tuple[int, int]]:
    return parse_range(text) if text else None


def _build_model(cfg: TrainConfig) -> torch.nn.Module:
    return build_model_from_config(make_config(cfg.model, cfg.scale, cfg.n_resblocks, cfg.n_feats))


def _agreed_refusal(fn: Callable[[], Optional[str]]) -> Optional[str]:
    """``fn()``'s refusal, or the one line of the user error it raised (for ``_from_rank0``)."""
    try:
        return fn()
    except OSError as err:
        return f"{err.filename}: {err.strerror}" if err.filename and err.strerror else str(err)


def _finished_summary(out_dir: Path, update: int) -> Optional[Dict[str, Any]]:
    """On rank 0: the summary of the run in ``out_dir`` if it ended (model.pt and summary.json
    written) at ``update``; None if it was stopped before its end."""
    import json

    try:
        summary = json.loads((out_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    finished = isinstance(summary, dict) and summary.get("updates") == update and (out_dir / "model.pt").is_file()
    return summary if finished else None


def _resume_path(cfg: TrainConfig, out_dir: Path) -> Optional[str]:
    if cfg.resume is None:
        return None
    if cfg.resume == "auto":
        last = out_dir / "last.pt"
        return str(last) if last.is_file() else None
    return cfg.resume


def _restore(path: str, cfg: TrainConfig, model: torch.nn.Module, optimizer: Any, ema: Optional[EMA]):
    """On rank 0: load a training checkpoint into the model, optimizer and EMA; return the rest."""
    ckpt = load_checkpoint(path, model_name=model.config.name, scale=cfg.scale)
    theirs = ckpt["meta"].get("config", {})
    if theirs != model.config.to_dict():
        raise CheckpointError(f"{path}: checkpoint is for {build_model_from_config(theirs).config.describe()}, "
                              f"not {model.config.describe()}")
    missing = [k for k in ("optimizer", "sampler", "rng", "update", "config") if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: holds weights but no training state ({', '.join(missing)}); "
                              "start from it with pretrained= instead of resuming")
    if (ckpt.get("ema") is None) != (ema is None):
        raise CheckpointError(f"{path}: written with ema_decay={ckpt['config'].get('ema_decay')}; "
                              "resume with the same setting (0 or not)")
    try:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if ema is not None:
            ema.load_state_dict(ckpt["ema"])
    except (KeyError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path}: training state does not fit this run: {str(err).splitlines()[0]}") from None
    return {**{k: ckpt[k] for k in ("update", "sampler", "rng", "train_seconds", "config")},
            # None in checkpoints of earlier versions, and "scaler" of runs without loss scaling
            "log_window": ckpt.get("log_window"), "scaler": ckpt.get("scaler")}


def _load_pretrained(path: str, model: torch.nn.Module) -> str:
    """On rank 0: copy weights from a checkpoint; a different scale keeps this model's tail fresh."""
    ckpt = load_checkpoint(path)
    refuse_nonfinite(path, ckpt["model"])
    for note in ckpt["meta"].get("notes", []):
        say(f"note: {note}")
    same_scale = int(ckpt["meta"]["scale"]) == model.scale
    report = load_pretrained(model, ckpt["model"], strict_tail=same_scale)
    return f"{len(report.loaded)} tensors loaded" + (f", {len(report.skipped)} fresh (tail)" if report.skipped else "")


def _sample_grid(model: torch.nn.Module, val_set: Any) -> np.ndarray:
    """A grid of centre crops of the first few validation images: LR, bicubic, SR and HR."""
    from hpdl.sr.figures import sample_crops, sample_grid

    return sample_grid(sample_crops(model, val_set, range(min(SAMPLE_IMAGES, len(val_set))), SAMPLE_CROP))


def _draw_curves(out_dir: Path) -> None:
    try:
        from hpdl.sr.figures import plot_curves

        plot_curves(out_dir, note=lambda message: say(f"note: {message}"))
    except ImportError:
        say("matplotlib not installed (pip install 'hpdl[sr]'): no curves.png")


def _batches(loader: DataLoader, sampler: ShardSampler, dataset: Any) -> Iterator[Tuple[int, int, Any]]:
    """Yield ``(step in this pass, epoch, batch)`` forever, epoch after epoch.

    The sampler and the dataset learn the epoch before its iterator starts the workers: the
    permutation and every patch's crop are functions of (seed, epoch, index), which is what
    makes a resumed run draw exactly the batches the uninterrupted one would have.
    """
    epoch = sampler.epoch  # after a resume: the checkpoint's epoch, continued at its position
    while True:
        sampler.set_epoch(epoch)
        dataset.set_epoch(epoch)
        for step, batch in enumerate(loader, 1):
            yield step, epoch, batch
        epoch += 1


def _progress(enabled: bool, total: int, initial: int):
    from hpdl.sr.progress import progress_bar

    return progress_bar(total=total, initial=initial, enabled=enabled, desc="train", unit="upd")


def _write_json(path: Path, data: Dict[str, Any]) -> None:
    import json

    text = json.dumps(json_ready(data), indent=2, allow_nan=False) + "\n"
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))  # a kill never leaves half a summary
