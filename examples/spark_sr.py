"""Train EDSR-baseline x2 on Apache Spark with hpdl.spark.run, then score it against bicubic.

    python examples/spark_sr.py                                    # 2 ranks on local[2]
    python examples/spark_sr.py --master "local-cluster[2,1,1024]" # 2 executor JVMs
    python examples/spark_sr.py --master spark://head:7077 --out /shared/run --cache-dir /shared/cache

The training photos (scikit-image's, written once as PNG files) are listed by Spark itself, as
a DataFrame of paths (the binaryFile source, without reading the files). Each rank trains on its
own shard of those paths, with the recipe of `hpdl sr train --config demo`; rank 0 writes the
checkpoint where the driver reads it (on a cluster, ``--out`` and ``--cache-dir`` must be on a
file system every executor and the driver share). The driver then scores the checkpoint on the
held-out photos against bicubic upscaling and writes ``OUT/summary.json``. The exit status is 1
when the model does not beat bicubic.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import unquote, urlparse


def train_rank(paths: List[str], checkpoint: str, cfg: Any, cache_dir: str) -> Dict[str, Any]:
    """One rank: train on this rank's shard of ``paths``; rank 0 saves the weights to ``checkpoint``."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    import hpdl.torch as hvd
    from hpdl.sr import ImageCache, ImagePairs, TrainPatches, build_model, make_checkpoint, save_checkpoint
    from hpdl.sr.datasets import PairSource
    from hpdl.sr.train_state import lr_at

    hvd.init()
    start = time.perf_counter()
    shard = paths[hvd.rank()::hvd.size()]
    pairs = ImagePairs([PairSource(Path(p).stem, Path(p)) for p in shard], cfg.scale,
                       cache=ImageCache(Path(cache_dir) / "decoded"))
    patches = TrainPatches(pairs, cfg.patch_size, repeat=cfg.repeat, seed=cfg.seed + hvd.rank())
    order = torch.Generator().manual_seed(cfg.seed + hvd.rank())
    loader = DataLoader(patches, batch_size=cfg.batch_size, shuffle=True, drop_last=True, generator=order)

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.scale)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    losses: List[float] = []
    epoch = 0
    model.train()
    while len(losses) < cfg.total_updates:
        patches.set_epoch(epoch)
        for lr_img, hr_img in loader:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(len(losses), cfg.lr, cfg.warmup_updates, cfg.lr_decay_steps, cfg.gamma)
            loss = F.l1_loss(model(lr_img), hr_img)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(hvd.allreduce(loss.detach(), name="loss").item())  # the mean over the ranks
            if hvd.rank() == 0 and len(losses) % cfg.log_every == 0:
                print(f"update {len(losses)}/{cfg.total_updates}: L1 {losses[-1]:.2f}", flush=True)
            if len(losses) == cfg.total_updates:
                break
        epoch += 1
    if hvd.rank() == 0:
        save_checkpoint(checkpoint, make_checkpoint(model, updates=len(losses)))
    return {"rank": hvd.rank(), "size": hvd.size(), "images": [Path(p).name for p in shard],
            "updates": len(losses), "first_loss": losses[0], "last_loss": losses[-1],
            "train_seconds": time.perf_counter() - start}


def _session(master: str):
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this Python, which has hpdl
    builder = SparkSession.builder.master(master).appName("hpdl spark_sr")
    if master.startswith("local"):
        # One machine: keep Spark on loopback (else it binds the machine's outside address).
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = (builder.config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
                   .config("spark.ui.enabled", "false"))
    spark = builder.config("spark.ui.showConsoleProgress", "false").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _training_paths(spark, folder: Path) -> List[str]:
    """The PNG files below ``folder``, as Spark lists them (a DataFrame of paths; the files are not read)."""
    listing = spark.read.format("binaryFile").option("pathGlobFilter", "*.png").load(str(folder)).select("path")
    return sorted(unquote(urlparse(row.path).path) for row in listing.collect())


def train_on_spark(spark, checkpoint: Path, cfg: Any, cache: Path,
                   num_proc: Optional[int] = None) -> Tuple[List[str], List[Dict[str, Any]]]:
    """Train on the session's executors; return the training paths and every rank's report."""
    import hpdl.spark
    from hpdl.sr import prepare_embedded

    paths = _training_paths(spark, prepare_embedded(cache)["train"])
    ranks = hpdl.spark.run(train_rank, args=(paths, str(checkpoint), cfg, str(cache)), num_proc=num_proc)
    return paths, ranks


def score(checkpoint: Path, cfg: Any, cache: Path, names: Sequence[str] = ()):
    """Score the checkpoint against bicubic on the held-out photos (those named, or all), on the driver."""
    from hpdl.sr import ImageCache, ImagePairs, evaluate, load_model, prepare_embedded
    from hpdl.sr.datasets import PairSource
    from hpdl.sr.images import EMBEDDED_VAL

    folder = prepare_embedded(cache)["val"]
    held_out = ImagePairs([PairSource(name, folder / f"{name}.png") for name in names or EMBEDDED_VAL], cfg.scale,
                          cache=ImageCache(cache / "decoded"))
    model, _ = load_model(checkpoint)
    return evaluate(model, held_out, cfg.scale, cfg.val_space)


def add_run_arguments(parser: argparse.ArgumentParser, default_out: str) -> None:
    """The options every engine's example shares (this one's and ray_sr.py's)."""
    parser.add_argument("--updates", type=int, default=None, help="training updates (default: the demo's)")
    parser.add_argument("--out", default=default_out, help="where model.pt and summary.json go")
    parser.add_argument("--cache-dir", default=None, help="photos and decode cache (default ~/.cache/hpdl/sr)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run's model.pt")


def prepare_run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Tuple[Any, Path, Path]:
    """The demo recipe (with --updates), the checkpoint's path in --out (refused if an earlier
    run's is there without --overwrite) and the cache folder; bad input ends in parser.error."""
    from hpdl.sr.config import ConfigError, load_config
    from hpdl.sr.images import default_cache_dir

    try:
        cfg = load_config("demo", {} if args.updates is None else {"total_updates": args.updates})
    except ConfigError as err:
        parser.error(str(err))
    out = Path(args.out).resolve()
    checkpoint = out / "model.pt"
    if checkpoint.exists() and not args.overwrite:
        parser.error(f"{checkpoint} exists (an earlier run's): pass --overwrite to replace it")
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache_dir).resolve() if args.cache_dir else default_cache_dir()
    return cfg, checkpoint, cache


def report(checkpoint: Path, cfg: Any, cache: Path, summary: Dict[str, Any], where: str, seconds: float) -> int:
    """Score the checkpoint on the driver, print the table and a line, write summary.json beside
    the checkpoint (``summary`` plus the scores); 0 if the model beats bicubic, else 1."""
    from hpdl.sr import format_table

    # The driver reads what rank 0 wrote, and scores it on photos no rank trained on.
    result = score(checkpoint, cfg, cache)
    print(format_table(result))
    means = result.means()
    gain = means["psnr"] - means["bicubic_psnr"]
    ranks = summary["ranks"]
    summary = {**summary, "checkpoint": str(checkpoint), "eval": result.to_dict(), "gain_db": gain}
    (checkpoint.parent / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{len(ranks)} ranks on {where}, {ranks[0]['updates']} updates ({seconds:.0f} s with its start): "
          f"held-out PSNR {means['psnr']:.2f} dB against bicubic {means['bicubic_psnr']:.2f} dB ({gain:+.2f} dB)")
    return 0 if gain > 0 else 1


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="spark_sr.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", default="local[2]", help="Spark master URL (default local[2])")
    parser.add_argument("--ranks", type=int, default=None, help="ranks (default: the default parallelism)")
    add_run_arguments(parser, "runs/spark_sr")
    args = parser.parse_args(argv)

    import hpdl.spark

    cfg, checkpoint, cache = prepare_run(parser, args)
    start = time.perf_counter()
    spark = _session(args.master)
    try:
        paths, ranks = train_on_spark(spark, checkpoint, cfg, cache, args.ranks)
    except (hpdl.spark.SparkRunError, ValueError) as err:
        print(f"spark_sr.py: error: {err}", file=sys.stderr)
        return 1
    finally:
        spark.stop()
    spark_seconds = time.perf_counter() - start
    return report(checkpoint, cfg, cache, {"master": args.master, "paths": paths, "ranks": ranks,
                                           "spark_seconds": spark_seconds}, args.master, spark_seconds)


if __name__ == "__main__":
    sys.exit(main())
