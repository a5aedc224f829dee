"""Train EDSR data-parallel: ``hpdl sr train --config demo`` or ``train(load_config("demo"))``.

The script reads top to bottom: distributed set-up, data, model and optimizer, start or
resume, the training loop, the end. The same code runs as one process or as one rank of many
under ``hpdl run``, mpiexec, srun or torchrun: ``hvd.init()`` reads the launcher's environment.
Every rank trains on its own shard of each epoch and the optimizer averages the gradients, so
the weights stay identical everywhere. Rank 0 alone prints, logs and writes checkpoints.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import hpdl.torch as hvd
from hpdl.sr.checkpoint import capture_rng_state, load_checkpoint, make_checkpoint, restore_rng_state, save_checkpoint
from hpdl.sr.config import TrainConfig, resolve_device
from hpdl.sr.datasets import build_train_dataset, build_val_dataset, parse_range
from hpdl.sr.errors import CheckpointError
from hpdl.sr.models import build_model_from_config, count_parameters, load_pretrained
from hpdl.sr.registry import make_config
from hpdl.sr.sampler import ShardSampler
from hpdl.sr.train_state import EMA, MetricsLog, TrainError, agreed, format_summary, lr_at, say, validate

__all__ = ["TrainError", "format_summary", "train"]

COMPRESSION = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16, "bf16": hvd.Compression.bf16}

# What a run writes into out_dir: any of them there means an earlier run.
RUN_FILES = ("last.pt", "model.pt", "train_log.csv", "val_log.csv", "summary.json", "config.yaml")

# Settings that change what is trained. Resuming with other values works but is no longer the
# same run, so it is pointed out; total_updates, val_every, out_dir and the like may change.
TRAJECTORY_KEYS = ("model", "scale", "n_resblocks", "n_feats", "data", "train_range", "patch_size", "batch_size",
                   "global_batch_size", "repeat", "augment", "lr", "betas", "eps", "lr_decay_steps", "gamma",
                   "warmup_updates", "scale_lr_with_world", "compression", "ema_decay", "seed", "downscaler")


def train(cfg: TrainConfig) -> Dict[str, Any]:
    """Train as ``cfg`` says and return a summary (PSNR, img/s, updates, time).

    The PSNR entries are None on ranks other than 0 when validation is not sharded.
    """
    wall_start = time.perf_counter()

    # -------------------------------------------------------------------------------------
    # Distributed set-up. One process per core is the usual layout on CPUs, so by default each
    # rank takes its share of the node's cores; more threads than cores only adds contention.
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    master = rank == 0
    device = agreed("device", lambda: resolve_device(cfg.device, "device", hvd.local_rank()))
    out_dir = Path(cfg.out_dir)
    # Before any work, so that nothing of an earlier run is lost by mistake. Rank 0 owns out_dir
    # and decides; every rank raises its verdict alike.
    refusal = hvd.broadcast_object(_earlier_run_refusal(out_dir, cfg) if master else None, 0, name="train.out_dir")
    if refusal is not None:
        raise TrainError(refusal)
    cores = _cpu_count()
    if master and cfg.threads > cores:
        print(f"hpdl: warning: threads={cfg.threads} is more than the {cores} cores this process can use; "
              "the threads will contend for them", file=sys.stderr, flush=True)
    torch.set_num_threads(cfg.threads or max(1, cores // hvd.local_size()))
    # Per-rank seeds keep random draws (dropout, say) independent between ranks; the initial
    # weights all come from rank 0 below, so the models still start identical.
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)
    if cfg.global_batch_size:
        if cfg.global_batch_size % size:
            raise TrainError(f"global_batch_size={cfg.global_batch_size} does not split over {size} ranks")
        batch_size = cfg.global_batch_size // size
    else:
        batch_size = cfg.batch_size
    global_batch = batch_size * size

    # -------------------------------------------------------------------------------------
    # Data. Every image is decoded and checked here, in the main process, so that a bad file
    # fails now with its name; the DataLoader workers only crop memory-mapped arrays.
    train_set = agreed("train data", lambda: build_train_dataset(
        cfg.data, cfg.scale, patch_size=cfg.patch_size, repeat=cfg.repeat, augment=cfg.augment, seed=cfg.seed,
        cache_dir=cfg.cache_dir, index_range=_range(cfg.train_range), on_bad_image=cfg.on_bad_image,
        downscaler=cfg.downscaler))
    if len(train_set) // size < batch_size:
        raise TrainError(f"{len(train_set)} patches per epoch give each of {size} ranks fewer than batch_size="
                         f"{batch_size}; raise repeat")
    validating = cfg.val_at_end or cfg.val_every > 0
    val_set = agreed("validation data", lambda: build_val_dataset(
        cfg.val_data or cfg.data, cfg.scale, cache_dir=cfg.cache_dir, index_range=_range(cfg.val_range),
        on_bad_image=cfg.on_bad_image, downscaler=cfg.downscaler)) if validating else None
    # The sampler gives each rank a disjoint share of every epoch's permutation, the same number
    # of samples on every rank; drop_last keeps every batch full, so all ranks make as many steps.
    sampler = ShardSampler(train_set, rank=rank, num_replicas=size, seed=cfg.seed)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler, num_workers=cfg.workers,
                        drop_last=True, pin_memory=device.type == "cuda")

    # -------------------------------------------------------------------------------------
    # Model and optimizer. The frozen MeanShift convs have no gradient and stay out of both.
    model = _build_model(cfg).to(device)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # With per-rank batches the global batch grows with the ranks; the linear scaling rule
    # (Goyal et al.) grows the lr with it, and the warm-up avoids the early instability.
    base_lr = cfg.lr * (size if cfg.scale_lr_with_world else 1)
    optimizer = torch.optim.Adam([p for _, p in named], lr=base_lr, betas=cfg.betas, eps=cfg.eps)
    # Every gradient's allreduce starts inside backward(), as soon as autograd has produced it;
    # step() waits for them and then runs Adam on the averaged gradients.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                         compression=COMPRESSION[cfg.compression])
    ema = EMA(_build_model(cfg).to(device), cfg.ema_decay) if cfg.ema_decay else None

    # -------------------------------------------------------------------------------------
    # Start or resume. Rank 0 reads the checkpoint (only it needs the file) and then sends the
    # weights, the optimizer state and the small rest to the others.
    agreed("out_dir", lambda: _prepare_out_dir(out_dir, cfg) if master else None)
    resume_path = hvd.broadcast_object(_resume_path(cfg, out_dir) if master else None, 0, name="train.resume_path")
    state = agreed("resume", lambda: _restore(resume_path, cfg, model, optimizer, ema) if master else None)
    state = hvd.broadcast_object(state, 0, name="train.state")
    if state is None and cfg.pretrained:
        report = agreed("pretrained", lambda: _load_pretrained(cfg.pretrained, model) if master else None)
        say(f"started from {cfg.pretrained}: {report}")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if state is not None:
        # A fresh optimizer has no state to send; broadcasting it would first create one with
        # a zero-gradient step, which advances Adam's step count. After resuming there is one.
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if ema is not None:
        if state is not None:
            hvd.broadcast_parameters([(f"ema.{k}", v) for k, v in ema.model.state_dict().items()], root_rank=0)
        else:
            ema.model.load_state_dict(model.state_dict())
    update, train_seconds = 0, 0.0
    if state is not None:
        update, train_seconds = state["update"], state["train_seconds"]
        try:
            sampler.load_state_dict(state["sampler"])
        except ValueError as err:  # e.g. another `repeat` or another set of images
            raise TrainError(f"{resume_path}: cannot continue its data order: {err}") from None
        if rank < len(state["rng"]):
            restore_rng_state(state["rng"][rank])
        now = cfg.to_dict()
        changed = ", ".join(f"{k} ({state['config'].get(k)!r} -> {now[k]!r})"
                            for k in TRAJECTORY_KEYS if state["config"].get(k) != now[k])
        say(f"resumed from {resume_path} at update {update}" + (f"; changed: {changed}" if changed else ""))
        if len(state["rng"]) != size:
            say(f"note: the checkpoint was written by {len(state['rng'])} ranks, this job has {size}")
    start_update = update
    say(f"{model.config.describe()}, {count_parameters(model):,} parameters; {size} rank(s) x batch "
        f"{batch_size} of {cfg.patch_size}px patches; {len(train_set)} patches per epoch; "
        f"{torch.get_num_threads()} thread(s) per rank on {device}")

    log = MetricsLog(out_dir, start_update if state is not None else None, say) if master else None
    if master and state is None:
        _write_config(out_dir / "config.yaml", cfg)
    bar = _progress(master and cfg.progress, cfg.total_updates, update)

    def evaluate_now() -> Optional[Dict[str, Any]]:
        result = validate(ema.model if ema else model, val_set, cfg.val_space, cfg.val_tile or None,
                          cfg.val_sharded)
        if result is None:
            return None  # not sharded, and not rank 0
        m = result.means()
        record = {"update": update, "psnr": m["psnr"], "bicubic_psnr": m["bicubic_psnr"], "ssim": m["ssim"],
                  "bicubic_ssim": m["bicubic_ssim"], "images": len(result.records),
                  "seconds": sum(r.seconds for r in result.records)}
        if log is not None:
            log.write("val", **record)
            say(f"update {update}: {cfg.val_space.upper()}-PSNR {m['psnr']:.2f} dB "
                f"(bicubic {m['bicubic_psnr']:.2f}) on {len(result.records)} held-out images")
        return record

    def checkpoint(step_in_pass: int) -> None:
        # Every rank's RNG states go into the checkpoint, so every rank can continue its streams.
        rng = hvd.allgather_object(capture_rng_state(), name="train.rng")

        def write() -> None:
            if master:
                save_checkpoint(out_dir / "last.pt", make_checkpoint(
                    model, optimizer=optimizer.state_dict(), ema=ema.state_dict() if ema else None,
                    # DataLoader workers fetch ahead of training: count what was trained on.
                    sampler=sampler.state_dict(consumed=step_in_pass * batch_size), rng=rng,
                    schedule={"update": update, "base_lr": base_lr}, update=update,
                    train_seconds=train_seconds, world_size=size, config=cfg.to_dict()))
        agreed("checkpoint", write)  # a full disk on rank 0 stops every rank, not just rank 0

    # -------------------------------------------------------------------------------------
    # The training loop: one update per batch, until total_updates.
    batches = _batches(loader, sampler, train_set)
    loss_sum, logged_at, log_clock = torch.zeros((), device=device), update, time.perf_counter()
    step_seconds: List[float] = []  # of every update of this run, for img/s
    model.train()
    while update < cfg.total_updates:
        step_start = time.perf_counter()
        step_in_pass, epoch, (lr_img, hr_img) = next(batches)
        lr_img, hr_img = lr_img.to(device, non_blocking=True), hr_img.to(device, non_blocking=True)
        lr = lr_at(update, base_lr, cfg.warmup_updates, cfg.lr_decay_steps, cfg.gamma)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = F.l1_loss(model(lr_img), hr_img)  # L1, as EDSR: sharper than L2 and better PSNR
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # the gradient allreduces start in here
        optimizer.step()  # waits for them, then Adam
        if ema is not None:
            ema.update(model)
        update += 1
        loss_sum += loss.detach()  # no .item() here: on a GPU that would be a sync point per step
        seconds = time.perf_counter() - step_start
        train_seconds += seconds
        step_seconds.append(seconds)
        bar.update(1)

        if update % cfg.log_every == 0 or update == cfg.total_updates:
            # The mean over ranks and over the updates since the last line (a collective: all ranks).
            mean_loss = hvd.allreduce(loss_sum / (update - logged_at), name="train.loss").item()
            now = time.perf_counter()
            img_per_s = (update - logged_at) * global_batch / (now - log_clock)
            if log is not None:
                log.write("train", update=update, epoch=epoch, loss=mean_loss, lr=lr, img_per_s=img_per_s,
                          elapsed_s=train_seconds)
            bar.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{lr:.2e}", img_s=f"{img_per_s:.1f}", refresh=False)
            loss_sum.zero_()
            logged_at, log_clock = update, now
        pause = time.perf_counter()  # validation and checkpoints do not count as training time
        if cfg.val_every and update % cfg.val_every == 0 and update < cfg.total_updates:
            evaluate_now()
        if (cfg.ckpt_every and update % cfg.ckpt_every == 0) or update == cfg.total_updates:
            checkpoint(step_in_pass)
        log_clock += time.perf_counter() - pause
    bar.close()

    # -------------------------------------------------------------------------------------
    # The end: the weights to use (the moving average if there is one), a final validation.
    final = ema.model if ema is not None else model
    agreed("weights", lambda: save_checkpoint(out_dir / "model.pt", make_checkpoint(final, update=update))
           if master else None)
    scores = evaluate_now() if cfg.val_at_end and update > 0 else None
    runs = update - start_update
    summary = {
        "model": final.config.describe(), "world_size": size, "updates": update, "updates_this_run": runs,
        "global_batch": global_batch, "patch_size": cfg.patch_size, "train_seconds": train_seconds,
        "wall_seconds": time.perf_counter() - wall_start,
        **_throughput(step_seconds, global_batch),
        "threads_per_rank": torch.get_num_threads(), "val_space": cfg.val_space,
        "psnr": scores["psnr"] if scores else None, "bicubic_psnr": scores["bicubic_psnr"] if scores else None,
        "val_images": scores["images"] if scores else 0, "out_dir": str(out_dir),
    }
    if log is not None:
        log.close()
        _write_json(out_dir / "summary.json", summary)
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


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _range(text: Optional[str]) -> Optional[Tuple[int, int]]:
    return parse_range(text) if text else None


def _build_model(cfg: TrainConfig) -> torch.nn.Module:
    return build_model_from_config(make_config(cfg.model, cfg.scale, cfg.n_resblocks, cfg.n_feats))


def _earlier_run(out_dir: Path) -> List[str]:
    return [name for name in RUN_FILES if (out_dir / name).exists()]


def _earlier_run_refusal(out_dir: Path, cfg: TrainConfig) -> Optional[str]:
    """On rank 0: why ``out_dir`` cannot be used (it holds an earlier run, neither resumed nor overwritten)."""
    earlier = _earlier_run(out_dir)
    if earlier and cfg.resume is None and not cfg.overwrite:
        return (f"out_dir={out_dir} holds an earlier run ({', '.join(earlier)}); continue it with resume=auto "
                "or start over with overwrite=true")
    return None


def _prepare_out_dir(out_dir: Path, cfg: TrainConfig) -> None:
    """On rank 0: create ``out_dir``; with ``overwrite``, first remove the earlier run's files."""
    if cfg.overwrite:
        # Nothing of the earlier run may be taken for this one's: resume=auto picking up its
        # last.pt after this run stopped early, TensorBoard showing its curves.
        for name in _earlier_run(out_dir):
            (out_dir / name).unlink()
        shutil.rmtree(out_dir / "tb", ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)


def _resume_path(cfg: TrainConfig, out_dir: Path) -> Optional[str]:
    if cfg.resume is None:
        return None
    if cfg.resume == "auto":
        last = out_dir / "last.pt"
        return str(last) if last.is_file() else None
    return cfg.resume


def _restore(path: Optional[str], cfg: TrainConfig, model: torch.nn.Module, optimizer: Any, ema: Optional[EMA]):
    """On rank 0: load a training checkpoint into the model, optimizer and EMA; return the rest."""
    if path is None:
        return None
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
    return {k: ckpt[k] for k in ("update", "sampler", "rng", "train_seconds", "config")}


def _load_pretrained(path: str, model: torch.nn.Module) -> str:
    """On rank 0: copy weights from a checkpoint; a different scale keeps this model's tail fresh."""
    ckpt = load_checkpoint(path)
    same_scale = int(ckpt["meta"]["scale"]) == model.scale
    report = load_pretrained(model, ckpt["model"], strict_tail=same_scale)
    return f"{len(report.loaded)} tensors loaded" + (f", {len(report.skipped)} fresh (tail)" if report.skipped else "")


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
    from tqdm import tqdm

    interactive = sys.stderr.isatty()
    # Without a terminal every refresh is a new line in the log: refresh rarely.
    return tqdm(total=total, initial=initial, disable=not enabled, unit="upd", dynamic_ncols=True,
                mininterval=0.5 if interactive else 30.0, desc="train")


def _write_config(path: Path, cfg: TrainConfig) -> None:
    import yaml

    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def _write_json(path: Path, data: Dict[str, Any]) -> None:
    import json

    path.write_text(json.dumps(data, indent=2) + "\n")
