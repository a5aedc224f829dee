"""Per-rank script for tests/test_sr_train_multirank.py: run the trainer in modes.

    sr_train.py uninterrupted-and-half OUT DATA   # OUT/full: N updates; OUT/resumed: N/2 updates
    sr_train.py resume OUT DATA                   # OUT/resumed: continue to N (a new process)
    sr_train.py errors OUT DATA                   # CLI error cases; OUT/errors.<rank>.json
    sr_train.py overlap OUT DATA                  # OUT/plain and OUT/overlap (overlap_forward=true)
    sr_train.py spatial OUT DATA NAME [KEY=VALUE ...]  # OUT/NAME: N_SPATIAL updates with those settings
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

from _common import run_main

N = 10  # updates; the sampler epoch is 4 updates long, so N/2 = 5 stops inside epoch 1
N_SPATIAL = 4  # updates of the spatial runs, compared with plain ones


def tiny(data: Path, out: Path, *extra: str) -> list:
    return [f"data={data / 'train'}", f"val_data={data / 'val'}", f"cache_dir={data / 'cache'}",
            f"out_dir={out}", "n_resblocks=1", "n_feats=8", "patch_size=8", "batch_size=2", "repeat=8",
            "workers=1", "lr=1e-3", "warmup_updates=2", "lr_decay_steps=4", "gamma=0.5", "ema_decay=0.9",
            "log_every=1", "progress=false", "val_every=4", "seed=3", *extra]


def main() -> None:
    from hpdl.sr.config import load_config
    from hpdl.sr.train import train

    mode, out, data = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    if mode == "uninterrupted-and-half":
        train(load_config("demo", tiny(data, out / "full", f"total_updates={N}", f"ckpt_every={N // 2}")))
        # Stopped at N/2 as if interrupted: no end-of-run validation in its log.
        train(load_config("demo", tiny(data, out / "resumed", f"total_updates={N // 2}", f"ckpt_every={N // 2}",
                                       "val_at_end=false")))
    elif mode == "resume":
        summary = train(load_config("demo", tiny(data, out / "resumed", f"total_updates={N}",
                                                 f"ckpt_every={N // 2}", "resume=auto")))
        assert summary["updates"] == N and summary["updates_this_run"] == N // 2, summary
    elif mode == "errors":
        errors(out, data)
    elif mode == "overlap":
        for name, extra in (("plain", []), ("overlap", ["overlap_forward=true"])):
            # No EMA: its average would apply each update at once, with nothing left to overlap.
            train(load_config("demo", tiny(data, out / name, f"total_updates={N}", f"ckpt_every={N // 2}",
                                           "ema_decay=0", *extra)))
    elif mode == "spatial":
        name, extra = sys.argv[4], sys.argv[5:]
        train(load_config("demo", tiny(data, out / name, f"total_updates={N_SPATIAL}", "ckpt_every=2",
                                       "patch_size=11", *extra)))
    else:
        raise SystemExit(f"unknown mode {mode}")


def errors(out: Path, data: Path) -> None:
    """Run each bad command line through hpdl.cli.main; record exit code and stderr per rank."""
    from hpdl.cli import main as cli

    base = ["sr", "train", "--config", "demo"]
    cases = {
        "unknown_key": base + tiny(data, out / "e") + ["learning_rate=1"],
        "bad_value": base + tiny(data, out / "e") + ["batch_size=two"],
        "missing_config": ["sr", "train", "--config", str(out / "nope.yaml")],
        "missing_data": base + tiny(data, out / "e") + [f"data={data / 'absent'}"],
        "truncated_ckpt": base + tiny(data, out / "e") + ["--resume", str(out / "truncated.pt")],
        "other_scale_ckpt": base + tiny(data, out / "e") + ["--resume", str(out / "x3.pt")],
        "corrupt_image": base + tiny(data, out / "e") + [f"data={data / 'corrupt'}"],
        "spatial_not_dividing": base + tiny(data, out / "e") + ["spatial=3"],
        "spatial_patch_too_small": base + tiny(data, out / "e") + ["spatial=2", "patch_size=1"],
        "corrupt_image_skipped": base + tiny(data, out / "skip") + [f"data={data / 'corrupt'}", "on_bad_image=skip",
                                                                     "total_updates=1", "val_at_end=false"],
    }
    results = {}
    for name, argv in cases.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = cli(argv)
            except SystemExit as exit_:
                code = exit_.code
        results[name] = {"code": code, "stderr": err.getvalue()}
    rank = os.environ.get("PMI_RANK", os.environ.get("RANK", "0"))
    (out / f"errors.{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    run_main(main)
