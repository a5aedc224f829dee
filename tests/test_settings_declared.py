"""Each setting is declared once (hpdl/config.py), and what is derived from the declarations
holds to them: the README's table, `hpdl run`'s options and their help, the variables they
become, horovodrun's config-file keys, and the range checks."""

import argparse
import dataclasses
import os
import shutil
from pathlib import Path

import pytest

from hpdl.cli import build_parser, main
from hpdl.config import HOROVOD_ALIASES, SPECS, Settings, default, number_text
from hpdl.launch import RunOptions, detect, settings_env
from hpdl.launch.horovodrun import CONFIG_KEYS
from hpdl.launch.limits import RUN_SETTINGS, flag, option_type, run_spec
from hpdl.settings_table import readme_table, replace_table, table_lines
from launch_texts import MPICH_TEXT

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_table_of_settings_is_the_declarations():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = readme_table(readme)
    assert rows, "README.md has no table of settings"
    wanted = table_lines()
    differing = [f"README: {row}\ndeclared: {want}" for row, want in zip(rows, wanted) if row != want]
    assert rows == wanted, ("README.md's table of settings differs from the declarations in hpdl/config.py; "
                            "`python -m hpdl.settings_table --write README.md` rewrites it\n"
                            + "\n".join(differing or [f"{len(rows)} rows in README, {len(wanted)} declared"]))
    assert replace_table(readme) == readme


def test_every_setting_has_its_own_names():
    variables = [spec.env for spec in SPECS.values()]
    assert len(set(variables)) == len(variables) and all(v.startswith("HPDL_") for v in variables)
    assert len(HOROVOD_ALIASES) == sum(1 for spec in SPECS.values() if spec.horovod)
    assert all(name.startswith("HOROVOD_") for name in HOROVOD_ALIASES)
    flags = [f for spec in SPECS.values() if spec.run for f in spec.run.flags]
    assert len(set(flags)) == len(flags)
    keys = [spec.run.config_key for spec in SPECS.values() if spec.run and spec.run.config_key]
    assert len(set(keys)) == len(keys) and set(keys) <= set(CONFIG_KEYS)
    for name, spec in SPECS.items():
        assert spec.doc and not spec.doc.endswith("."), name
        if spec.bound is not None and not spec.choices:
            assert isinstance(default(name), (int, float)), name
        assert "default" not in (spec.run.help if spec.run else ""), f"{name}: its default comes from the field"


def _run_parser():
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]


def test_run_shows_each_option_in_its_group_with_its_variable_default_and_range():
    run = _run_parser()
    by_dest = {}
    for group in run._action_groups:
        for action in group._group_actions:
            by_dest.setdefault(action.dest, (group.title, action))
    assert set(RUN_SETTINGS) <= set(by_dest)
    for option, name in RUN_SETTINGS.items():
        spec, setting = run_spec(option), SPECS[name]
        title, action = by_dest[option]
        assert title == spec.group and tuple(action.option_strings) == spec.flags, option
        assert setting.env in action.help, option
        if option_type(option) in (int, float):
            assert f"default {number_text(default(name) / spec.scale)};" in action.help, option
            assert action.type is option_type(option)
        assert action.default is None, f"{option}: not given must leave the variable to the environment"


def _sample(option):
    """A value of ``option`` other than its default, and what its setting then holds."""
    name, spec = RUN_SETTINGS[option], run_spec(option)
    kind = option_type(option)
    if kind is bool:
        return True, True
    if kind is str:
        choices = SPECS[name].choices
        return (choices[1], choices[1]) if choices else ("out/f.txt", "/job/out/f.txt")
    bound = SPECS[name].bound
    step = min(2, (bound.highest - bound.lowest) / spec.scale / 4)  # inside the range (noise: 0 to 1)
    value = bound.lowest / spec.scale + step
    value = int(value) if kind is int else value + step / 4
    return value, value * spec.scale


@pytest.mark.parametrize("option", list(RUN_SETTINGS))
def test_each_option_reaches_its_setting_on_every_rank(option):
    given, expected = _sample(option)
    env = settings_env(RunOptions(command=("python",), settings={option: given}), {}, "/job")
    assert set(env) == {SPECS[RUN_SETTINGS[option]].env}
    assert getattr(Settings.from_env(env), RUN_SETTINGS[option]) == expected


@pytest.mark.parametrize("option", [o for o in RUN_SETTINGS if option_type(o) in (int, float)])
def test_each_numeric_option_is_refused_below_its_declared_range(option, monkeypatch, capsys):
    for key in list(os.environ):
        if key.startswith(("HPDL_", "SLURM_")):
            monkeypatch.delenv(key)
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: pytest.fail("started"))
    bound = SPECS[RUN_SETTINGS[option]].bound
    below = bound.lowest / run_spec(option).scale - 1
    assert main(["run", flag(option), str(int(below)), "--dry-run", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hpdl: error: {flag(option)} must be ") and "HPDL_" not in err, err


@pytest.mark.parametrize("section_key", [k for k in CONFIG_KEYS if CONFIG_KEYS[k][0] in RUN_SETTINGS])
def test_each_config_file_key_sets_its_option(section_key, monkeypatch, capsys, tmp_path):
    option = CONFIG_KEYS[section_key][0]
    given, expected = _sample(option)
    if option == "backend":
        pytest.skip("the file's controller sets the backend")
    for key in list(os.environ):
        if key.startswith(("HPDL_", "SLURM_")):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "horovod.yaml"
    text = str(given).lower() if isinstance(given, bool) else repr(given) if isinstance(given, str) else given
    config.write_text(f"{section_key[0]}:\n  {section_key[1]}: {text}\n")
    monkeypatch.setattr(shutil, "which", lambda name, path=None: f"/usr/bin/{name}" if name != "srun" else None)
    monkeypatch.setattr(detect, "_version_text", lambda exe: MPICH_TEXT)
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: pytest.fail("started"))
    assert main(["run", "-np", "2", "--config-file", str(config), "--dry-run", "--", "python", "x.py"]) == 0
    out = capsys.readouterr().out
    variable = SPECS[RUN_SETTINGS[option]].env
    word = next(w for w in out.split() if w.startswith(f"{variable}="))
    value = Settings.from_env({variable: word.split("=", 1)[1]})
    if isinstance(expected, str) and expected.startswith("/job/"):
        expected = str(tmp_path / expected[len("/job/"):])
    assert getattr(value, RUN_SETTINGS[option]) == expected


def test_run_options_hold_no_field_per_setting():
    # A new setting with an option needs no new RunOptions field: its value goes in .settings.
    fields = {field.name for field in dataclasses.fields(RunOptions)}
    assert not fields & set(RUN_SETTINGS), fields & set(RUN_SETTINGS)
    with pytest.raises(ValueError, match="no `hpdl run` option sets fusion_threshold"):
        RunOptions(command=("python",), settings={"fusion_threshold": 1})
