"""``hpdl sr upscale --spatial``: the rows of tiles split over the ranks give the one-process
output file byte for byte (uneven bands, a height that is not a multiple of the tile, alpha,
gray, ICC, EXIF orientation, self-ensemble, messages in chunks), bad input is refused in one
line on rank 0 with every rank's status non-zero, and the progress bar is rank 0's alone."""

import json

import numpy as np
import pytest
import torch
from PIL import Image, ImageCms

from hpdl.cli import main
from hpdl.sr.checkpoint import make_checkpoint, save_checkpoint
from hpdl.sr.models import build_model_from_config
from hpdl.sr.registry import ModelConfig
from hpdl.sr.spatial_upscale import idle_ranks
from hpdl.sr.inference import tile_rows
from hpdl.sr.upscale_cli import SPATIAL_STALL_S, spatial_stall_settings
from hpdl.torch.spatial import bands
from ranks import run_ranks

pytestmark = pytest.mark.multirank

TILE = 16
H, W = 75, 70  # 5 rows of tiles, the last 11 pixels high: bands of 3 + 2 rows on 2 ranks, 2 + 2 + 1 on 3


def photo(h, w, seed=0):
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // 6 + 2, w // 6 + 2, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC))


def upscale_argv(src, dst, ckpt, *extra):
    return ["sr", "upscale", str(src), str(dst), "--ckpt", str(ckpt), "--tile", str(TILE), *extra]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("upscale_spatial")
    torch.manual_seed(0)
    save_checkpoint(root / "tiny.pt", make_checkpoint(build_model_from_config(ModelConfig("tiny", 2, 2, 8, 1.0))))
    Image.fromarray(photo(H, W)).save(root / "photo.png")
    rgba = np.dstack([photo(H, W, 1), np.full((H, W), 255, np.uint8)])
    rgba[:, :20, 3] = 0
    rgba[:, 20:30, 3] = 128
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    Image.fromarray(rgba).save(root / "logo.png", icc_profile=srgb)
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: turned upright on reading
    Image.fromarray(photo(W, H, 2)).convert("L").save(root / "gray.jpg", exif=exif)
    return root


# What each case upscales, and with which options; the spatial output must equal the one-process one.
SAME_BYTES = {
    "photo": ("photo.png", "png", []),
    "ensemble": ("photo.png", "png", ["--self-ensemble"]),
    "alpha_icc": ("logo.png", "png", []),
    "gray_exif": ("gray.jpg", "png", []),
    "jpeg": ("photo.png", "jpg", []),
    "chunks": ("photo.png", "png", []),  # every alltoall cut into messages of a few rows
    "progress": ("photo.png", "png", []),
    "no_progress": ("photo.png", "png", ["--no-progress"]),
}


@pytest.fixture(scope="module")
def one_process(inputs):
    """The one-process outputs of SAME_BYTES."""
    outputs = {}
    for case, (src, ext, extra) in SAME_BYTES.items():
        dst = inputs / f"{case}.one.{ext}"
        if not dst.exists():
            assert main(upscale_argv(inputs / src, dst, inputs / "tiny.pt", *extra)) == 0
        outputs[case] = dst.read_bytes()
    return outputs


def refusal_cases(root, out):
    """Case -> (argv, the output it names, words of its error line)."""
    ckpt = root / "tiny.pt"
    return {
        "exists": (upscale_argv(root / "photo.png", out / "earlier.png", ckpt, "--spatial"), "earlier.png",
                   "earlier.png: already exists; pass --overwrite to replace it"),
        "over_input": (upscale_argv(root / "photo.png", root / "photo.png", ckpt, "--spatial", "--overwrite"),
                       "photo.png", "photo.png: is the input image"),
        "whole_image_tile": (upscale_argv(root / "photo.png", out / "t0.png", ckpt, "--spatial") + ["--tile", "0"],
                             "t0.png", "--tile 0 makes the whole image one tile: give a tile size"),
        "transparency_to_jpeg": (upscale_argv(root / "logo.png", out / "logo.jpg", ckpt, "--spatial"), "logo.jpg",
                                 "Pillow's JPEG writer cannot keep the transparency"),
        "max_pixels": (upscale_argv(root / "photo.png", out / "big.png", ckpt, "--spatial", "--max-pixels", "100"),
                       "big.png", f"image of {W}x{H} ({W * H:,} pixels) exceeds the limit of 100 pixels"),
        "missing_ckpt": (upscale_argv(root / "photo.png", out / "m.png", root / "absent.pt", "--spatial"), "m.png",
                         "absent.pt: no such checkpoint file"),
        "no_cuda": (upscale_argv(root / "photo.png", out / "c.png", ckpt, "--spatial", "--device", "cuda:0"), "c.png",
                    "--device: cuda:0 requested but"),
    }


@pytest.fixture(scope="module", params=[("mpiexec", 2), ("mpiexec", 3), ("torchrun", 2)],
                ids=["mpiexec-2", "mpiexec-3", "torchrun-2"])
def job(request, inputs, tmp_path_factory):
    """Every case, spatial, in one job; returns (ranks, output folder, every rank's results)."""
    launcher, n = request.param
    out = tmp_path_factory.mktemp(f"spatial_{launcher}_{n}")
    cases = {}
    for case, (src, ext, extra) in SAME_BYTES.items():
        cases[case] = {"argv": upscale_argv(inputs / src, out / f"{case}.{ext}", inputs / "tiny.pt", "--spatial",
                                            *extra)}
    cases["chunks"]["max_message_bytes"] = 1  # one row of one rank per message
    cases["progress"]["clock_step"] = cases["no_progress"]["clock_step"] = 10.0  # every bar would be drawn
    (out / "earlier.png").write_bytes(b"an earlier result")
    for case, (argv, _, _) in refusal_cases(inputs, out).items():
        cases[case] = {"argv": argv}
    (out / "cases.json").write_text(json.dumps(cases))
    run_ranks("sr_upscale_spatial.py", n, launcher, args=[str(out / "cases.json"), str(out)], timeout=240)
    results = [json.loads((out / f"result.{r}.json").read_text()) for r in range(n)]
    return n, out, results


@pytest.mark.parametrize("case", list(SAME_BYTES))
def test_the_output_has_the_bytes_of_the_one_process_upscale(job, one_process, case):
    n, out, results = job
    for rank, result in enumerate(results):
        assert result[case]["code"] == 0, (rank, result[case])
    _, ext, _ = SAME_BYTES[case]
    assert (out / f"{case}.{ext}").read_bytes() == one_process[case]
    # Rank 0 reports, once.
    assert results[0][case]["stdout"].startswith(f"wrote {out / f'{case}.{ext}'}: ")
    assert all(r[case]["stdout"] == "" for r in results[1:])


def test_the_bands_are_uneven_and_the_last_row_of_tiles_is_partial():
    # What the cases above cover: bands of unequal lengths at 2 and 3 ranks, a partial last row.
    rows = tile_rows(H, W, TILE, 5)
    assert len(rows) == 5 and rows[-1][0].box[:2] == (64, 75)
    assert bands(len(rows), 2) == [(0, 3), (3, 5)] and bands(len(rows), 3) == [(0, 2), (2, 4), (4, 5)]
    assert idle_ranks(H, TILE, 3) == 0 and idle_ranks(H, TILE, 7) == 2


def test_the_progress_bar_is_drawn_on_rank_0_alone(job):
    n, _, results = job
    tiles = 5 * 5
    assert "upscale" in results[0]["progress"]["stderr"] and f"{tiles}/{tiles}" in results[0]["progress"]["stderr"]
    assert all("upscale" not in r["progress"]["stderr"] for r in results[1:]), [r["progress"] for r in results]
    assert all(r["no_progress"]["stderr"] == "" for r in results)


@pytest.mark.parametrize("case", ["exists", "over_input", "whole_image_tile", "transparency_to_jpeg", "max_pixels",
                                  "missing_ckpt", "no_cuda"])
def test_bad_input_is_one_line_on_rank_0_and_every_rank_fails(job, inputs, case):
    n, out, results = job
    _, output, words = refusal_cases(inputs, out)[case]
    lines = results[0][case]["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpdl: error: ") and words in lines[0], results[0][case]
    for rank, result in enumerate(results):
        assert result[case]["code"] == 2, (rank, result[case])
        if rank:
            assert result[case]["stderr"] == "" and result[case]["stdout"] == "", (rank, result[case])
    if case == "exists":
        assert (out / "earlier.png").read_bytes() == b"an earlier result"
    elif case == "over_input":
        assert np.array_equal(np.asarray(Image.open(inputs / "photo.png")), photo(H, W))
    else:
        assert not (out / output).exists()


def test_the_stall_check_waits_for_rows_of_tiles_unless_the_job_sets_it(job):
    # The ranks' exchanges wait for each other's rows of tiles, minutes each: no stall warning then.
    _, _, results = job
    assert all(r["stall_check"] == {"warning_s": SPATIAL_STALL_S, "timeout_s": SPATIAL_STALL_S} for r in results)
    assert spatial_stall_settings({}) == {"HPDL_STALL_WARNING": str(SPATIAL_STALL_S),
                                          "HPDL_STALL_TIMEOUT": str(SPATIAL_STALL_S)}
    for variable in ("HPDL_STALL_WARNING", "HPDL_STALL_TIMEOUT", "HOROVOD_STALL_CHECK_DISABLE"):
        assert spatial_stall_settings({variable: "1"}) == {}  # the job's own choice


def test_the_help_and_the_docs_say_what_spatial_does(capsys):
    from pathlib import Path

    with pytest.raises(SystemExit):
        main(["sr", "upscale", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--spatial" in text and "the output file has the same bytes as the one-process upscale with the same " \
                                   "--tile" in text, text
    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "sr.md").read_text().split())
    assert "writes the file that the one-process `hpdl sr upscale big.png out.png --ckpt model.pt` writes with the " \
           "same `--tile` (and `--self-ensemble`), byte for byte" in docs
