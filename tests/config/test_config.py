"""Config loading: defaults <- YAML (with _BASE_) <- command line, and clear errors."""
from __future__ import annotations

import os

import pytest

from pet.config import default_output_dir, load_cfg
from pet.utils.errors import ConfigError
from support.helpers import CFGS


def write(path, text):
    path.write_text(text)
    return str(path)


def test_merge_order_defaults_yaml_base_and_command_line(tmp_path):
    write(tmp_path / "base.yaml", "SOLVER:\n  BASE_LR: 0.1\n  MAX_ITER: 100\n")
    child = write(tmp_path / "child.yaml", "_BASE_: base.yaml\nSOLVER:\n  MAX_ITER: 200\n")
    cfg = load_cfg(child, ["SOLVER.MAX_ITER", "300"])
    assert cfg.SOLVER.BASE_LR == 0.1  # from _BASE_
    assert cfg.SOLVER.MAX_ITER == 300  # command line wins over the YAML
    assert cfg.SOLVER.MOMENTUM == 0.9  # default kept


def test_numbers_written_loosely_in_yaml_become_floats(tmp_path):
    cfg = load_cfg(write(tmp_path / "a.yaml", "SOLVER:\n  BASE_LR: 1e-3\n  WEIGHT_DECAY: 0\n"))
    assert cfg.SOLVER.BASE_LR == pytest.approx(0.001) and isinstance(cfg.SOLVER.WEIGHT_DECAY, float)


def test_unknown_key_names_it_and_suggests(tmp_path):
    cfg_file = write(tmp_path / "a.yaml", "SOLVER:\n  BASE_RL: 0.1\n")
    with pytest.raises(ConfigError, match=r"Unknown config key 'SOLVER.BASE_RL'.*Did you mean 'SOLVER.BASE_LR'"):
        load_cfg(cfg_file)
    with pytest.raises(ConfigError, match=r"'MODEL.NUM_CLASES' in command line.*'MODEL.NUM_CLASSES'"):
        load_cfg(None, ["MODEL.NUM_CLASES", "3"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"SOLVER.MAX_ITER.*expects int.*got str 'many'"):
        load_cfg(None, ["SOLVER.MAX_ITER", "many"])


def test_missing_file_and_yaml_syntax_error(tmp_path):
    with pytest.raises(ConfigError, match="Config file not found: .*nope.yaml"):
        load_cfg(str(tmp_path / "nope.yaml"))
    bad = write(tmp_path / "bad.yaml", "SOLVER:\n  BASE_LR: [0.1\n")
    with pytest.raises(ConfigError, match=r"YAML syntax error in .*bad.yaml:\d+"):
        load_cfg(bad)


@pytest.mark.parametrize("value, tag", [
    ('!!python/object/apply:os.system ["touch {marker}"]', "!!python/object/apply:os.system"),
    ("!!python/object/apply:builtins.open ['{marker}', 'w']", "!!python/object/apply:builtins.open"),
    ("!!python/object/new:pathlib.Path ['{marker}']", "!!python/object/new:pathlib.Path"),
    ("!!python/name:os.system", "!!python/name:os.system"),
], ids=["os.system", "open", "object-new", "name"])
def test_a_python_tag_is_refused_as_unsafe_naming_file_and_line_and_runs_nothing(tmp_path, value, tag):
    marker = tmp_path / "marker"
    evil = write(tmp_path / "evil.yaml", f"SOLVER:\n  MAX_ITER: 10\n  BASE_LR: {value.format(marker=marker)}\n")
    child = write(tmp_path / "child.yaml", "_BASE_: evil.yaml\nSOLVER:\n  MAX_ITER: 20\n")
    for cfg_file in (evil, child):  # directly, and inherited through _BASE_: the culprit file is named
        with pytest.raises(ConfigError) as error:
            load_cfg(cfg_file)
        assert str(error.value).startswith(f"Unsafe YAML tag {tag} in {evil}:3:12: "), error.value
        assert "yaml.safe_load" in str(error.value) and "syntax" not in str(error.value)
    assert not marker.exists()  # nothing was executed


@pytest.mark.parametrize(
    "opts, message",
    [
        (["SOLVER.BASE_LR", "-0.1"], "SOLVER.BASE_LR must be > 0"),
        (["SOLVER.IMS_PER_BATCH", "0"], "SOLVER.IMS_PER_BATCH must be > 0"),
        (["SOLVER.OPTIMIZER", "Adam"], "SOLVER.OPTIMIZER must be SGD or AdamW"),
        (["DEVICE", "tpu"], "DEVICE must be auto, cpu or cuda"),
        (["SOLVER.MAX_ITER", "0"], "Set SOLVER.MAX_ITER"),
    ],
)
def test_invalid_values_are_rejected(opts, message):
    with pytest.raises(ConfigError, match=message):
        load_cfg(None, opts)


def test_odd_number_of_overrides():
    with pytest.raises(ConfigError, match="KEY VALUE pairs"):
        load_cfg(None, ["SOLVER.BASE_LR"])


def test_default_output_dir_mirrors_cfgs_tree():
    assert default_output_dir("cfgs/shapes/faster_rcnn_R-10-FPN.yaml") == os.path.join(
        "ckpts", "shapes", "faster_rcnn_R-10-FPN")
    assert default_output_dir("/somewhere/else/my.yaml") == os.path.join("ckpts", "my")


def test_shipped_configs_load_without_old_key_names(caplog):
    root = CFGS
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".yaml")]
    assert files, "no config files shipped under cfgs/"
    with caplog.at_level("WARNING", logger="pet.config"):
        for path in files:
            load_cfg(path)
    assert not [r.getMessage() for r in caplog.records if "is now called" in r.getMessage()]


def test_iterations_and_epochs_together_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="Both SOLVER.MAX_ITER .* and SOLVER.MAX_EPOCHS"):
        load_cfg(None, ["SOLVER.MAX_ITER", "100", "SOLVER.MAX_EPOCHS", "2"])
    assert load_cfg(None, ["SOLVER.MAX_EPOCHS", "2"]).SOLVER.MAX_EPOCHS == 2  # the MAX_ITER default is ignored


@pytest.mark.parametrize("old, new", [("HOOKS.CHECKPOINT.INTERVAL", "HOOKS.CHECKPOINT.PERIOD"),
                                      ("HOOKS.EMA.INTERVAL", "HOOKS.EMA.PERIOD")])
def test_a_renamed_key_still_loads_with_a_warning_naming_the_new_one(tmp_path, caplog, old, new):
    section, leaf = old.rsplit(".", 1)
    yaml_file = tmp_path / "old.yaml"
    yaml_file.write_text(f"{section.split('.')[0]}:\n  {section.split('.')[1]}:\n    {leaf}: 7\n")
    with caplog.at_level("WARNING", logger="pet.config"):
        from_yaml = load_cfg(str(yaml_file))
        from_opts = load_cfg(None, [old, "9"])
    assert from_yaml[section.split(".")[0]][section.split(".")[1]].PERIOD == 7
    assert from_opts[section.split(".")[0]][section.split(".")[1]].PERIOD == 9
    assert [r.getMessage() for r in caplog.records] == [
        f"Config key '{old}' in {yaml_file} is now called '{new}'; please rename it.",
        f"Config key '{old}' in command line is now called '{new}'; please rename it."]


def test_training_hook_settings_moved_under_hooks_still_load_with_one_warning_each(tmp_path, caplog):
    """TEST.EVAL_PERIOD and the TEST.PRECISE_BN section drive training hooks: they are HOOKS.EVAL.PERIOD and
    HOOKS.PRECISE_BN now; the old names load until 0.3.0, one warning per old key (a section's leaves count once)."""
    old = write(tmp_path / "old.yaml", "TEST:\n  EVAL_PERIOD: 7\n  IMS_PER_BATCH: 2\n"
                                        "  PRECISE_BN:\n    ENABLED: True\n    NUM_ITER: 3\n")
    with caplog.at_level("WARNING", logger="pet.config"):
        cfg = load_cfg(old, ["TEST.PRECISE_BN.PERIOD", "5", "TEST.EVAL_PERIOD", "9"])
    assert cfg.HOOKS.EVAL.PERIOD == 9 and cfg.TEST.IMS_PER_BATCH == 2  # the command line still wins
    assert dict(cfg.HOOKS.PRECISE_BN) == {"ENABLED": True, "PERIOD": 5, "NUM_ITER": 3}
    assert "EVAL_PERIOD" not in cfg.TEST and "PRECISE_BN" not in cfg.TEST
    assert [r.getMessage() for r in caplog.records] == [
        f"Config key '{o}' in {source} is now called '{n}'; please rename it."
        for source in (old, "command line")
        for o, n in (("TEST.EVAL_PERIOD", "HOOKS.EVAL.PERIOD"), ("TEST.PRECISE_BN", "HOOKS.PRECISE_BN"))]


def test_an_old_key_is_renamed_per_file_so_the_child_file_still_wins(tmp_path):
    """A user's file with the old name overrides a shipped base with the new one, and the other way round."""
    write(tmp_path / "new_base.yaml", "HOOKS:\n  EVAL:\n    PERIOD: 300\n")
    old_child = write(tmp_path / "old_child.yaml", "_BASE_: new_base.yaml\nTEST:\n  EVAL_PERIOD: 50\n")
    write(tmp_path / "old_base.yaml", "TEST:\n  EVAL_PERIOD: 50\n")
    new_child = write(tmp_path / "new_child.yaml", "_BASE_: [old_base.yaml]\nHOOKS:\n  EVAL:\n    PERIOD: 20\n")
    assert load_cfg(old_child).HOOKS.EVAL.PERIOD == 50
    assert load_cfg(new_child).HOOKS.EVAL.PERIOD == 20


def test_an_old_and_a_new_key_in_one_file_is_an_error_naming_both(tmp_path):
    both = write(tmp_path / "both.yaml", "TEST:\n  EVAL_PERIOD: 5\nHOOKS:\n  EVAL:\n    PERIOD: 6\n")
    with pytest.raises(ConfigError, match=r"sets both 'TEST\.EVAL_PERIOD' and its new name 'HOOKS\.EVAL\.PERIOD'"):
        load_cfg(both)
    with pytest.raises(ConfigError, match="command line sets both 'TEST.PRECISE_BN'"):
        load_cfg(None, ["TEST.PRECISE_BN.ENABLED", "True", "HOOKS.PRECISE_BN.ENABLED", "False"])
