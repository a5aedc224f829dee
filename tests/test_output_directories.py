"""Directories made for outputs: a file where one must be is named as a file, wherever outputs go.

The system says "File exists" (the directory itself is a file) or "Not a directory" (an
ancestor is), naming neither; every output's directory is made through
``hpdl.atomic_file.make_directories``, which names the file instead.
"""

from __future__ import annotations

import pytest
from cli_in_process import run_hpdl

from hpdl.atomic_file import atomic_write, make_directories

MIB = 1 << 20


@pytest.fixture
def photo(tmp_path):
    """A user's file, where an output's directory is asked for."""
    path = tmp_path / "photo.png"
    path.write_bytes(b"a user's picture")
    return path


def _is_a_file(photo) -> str:
    return f"{photo} is a file, not a directory"


@pytest.mark.parametrize("below", ["", "run"], ids=["the-directory-is-a-file", "under-a-file"])
def test_make_directories_names_the_file_in_the_way(photo, below):
    directory = photo / below if below else photo
    with pytest.raises(NotADirectoryError) as caught:
        make_directories(directory)
    assert caught.value.strerror == _is_a_file(photo) and caught.value.filename == str(directory)
    assert photo.read_bytes() == b"a user's picture"


def test_make_directories_makes_what_is_missing_and_keeps_what_is_there(tmp_path):
    make_directories(tmp_path / "a" / "b")
    make_directories(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()


def test_an_atomic_write_under_a_file_names_the_target_and_the_file(photo):
    with pytest.raises(NotADirectoryError) as caught:
        atomic_write(photo / "x.json", lambda f: f.write(b"{}"))
    assert caught.value.filename == str(photo / "x.json") and caught.value.strerror == _is_a_file(photo)


@pytest.mark.parametrize("below", ["x.csv", "sub/x.csv"], ids=["the-directory-is-a-file", "under-a-file"])
def test_the_autotune_log_under_a_file(photo, below):
    from hpdl.engine.autotune import Autotuner

    with pytest.raises(ValueError) as caught:
        Autotuner(MIB, 1.0, log_path=str(photo / below))
    assert str(caught.value) == (f"cannot write the autotune log {photo / below} (HPDL_AUTOTUNE_LOG): "
                                 f"{_is_a_file(photo)}")


def test_the_timeline_under_a_file(photo):
    from hpdl.engine.timeline import Timeline

    with pytest.raises(ValueError) as caught:
        Timeline(str(photo / "t.json"))
    assert str(caught.value) == f"cannot write the timeline to {photo / 't.json'}: {_is_a_file(photo)}"


def test_the_profile_under_a_file(photo):
    from hpdl.torch.profiler.session import _unwritable

    assert _unwritable(str(photo / "p.json")) == f"cannot write the profile to {photo / 'p.json'}: {_is_a_file(photo)}"


def test_rank_output_files_under_a_file(photo, capsys):
    from hpdl.launch.horovodrun import output_wrapper
    from hpdl.launch.hosts import LaunchError
    from hpdl.launch.rank_output import main as rank_output

    with pytest.raises(LaunchError, match=f"^--output-filename {photo / 'logs'}: {_is_a_file(photo)}$"):
        output_wrapper(str(photo / "logs"), ["true"])
    assert rank_output([str(photo), "--", "true"]) == 2
    assert capsys.readouterr().err == f"hpdl: error: --output-filename {photo}: {_is_a_file(photo)}\n"


@pytest.mark.parametrize("below", ["", "run"], ids=["out_dir-is-a-file", "out_dir-under-a-file"])
def test_a_training_out_dir_that_is_a_file_is_named_as_one(photo, below):
    out_dir = photo / below if below else photo
    done = run_hpdl(["sr", "train", "--config", "demo", f"out_dir={out_dir}", "progress=false"])
    assert done.returncode == 2 and done.stderr == f"hpdl: error: out_dir={out_dir}: {_is_a_file(photo)}\n", done.stderr
    assert photo.read_bytes() == b"a user's picture"
