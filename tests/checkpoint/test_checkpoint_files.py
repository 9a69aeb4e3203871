"""Checkpoint files under faults injected for real: a failed or killed write, a full disk, a file-size limit,
a read-only directory, leftover temporary files, pickles that run code (SIGKILL between iterations of the
demo detector: tests/engine/test_kill_resume.py)."""
from __future__ import annotations

import builtins
import ctypes
import io
import os
import subprocess

import pytest
import torch

from pet.checkpoint import load_checkpoint, load_weights, read_last_checkpoint
from pet.cli import build_trainer
from pet.utils import comm
from pet.utils.errors import ConfigError
from support.helpers import run_toy_train_forked, run_toy_train_here, start_and_wait_for_report
from support.processes import fork_server_context
from support.toys import InfiniteToyLoader, ToyModel, regular_iters, toy_trainer


@pytest.mark.slow
def test_failed_checkpoint_write_keeps_the_previous_one_and_names_path_and_cause(tmp_path):
    """A write failing with EFBIG (RLIMIT_FSIZE, SIGXFSZ ignored), the disk-full case any user can cause."""
    ckpt = tmp_path / "run"
    code, _, err = run_toy_train_here(ckpt, 4, "--interval", "2")
    assert code == 0, err
    previous = (ckpt / "model_iter4.pth").read_bytes()
    # Resume (in a process of its own: the limit holds for a whole process) with files capped one byte under a
    # checkpoint's size: the one at iteration 6 cannot be written (the log and metrics.json stay far smaller).
    limit = len(previous) - 1
    code, _, err = run_toy_train_forked(ckpt, 8, "--interval", "2", "--file-size-limit", str(limit))
    assert code == 2
    assert err.strip().splitlines() == [
        f"Error: Could not write {ckpt}/model_iter6.pth: File too large. The previous checkpoint is intact; raise "
        "the file-size limit (ulimit -f), or point CKPT at a file system that allows larger files, then resume "
        "with the same command."]
    assert (ckpt / "last_checkpoint").read_text() == "model_iter4.pth"
    assert (ckpt / "model_iter4.pth").read_bytes() == previous
    assert sorted(f for f in os.listdir(ckpt) if f.endswith(".pth") or ".tmp" in f) == [
        "model_final.pth", "model_iter2.pth", "model_iter4.pth"]  # no partial or temporary file

    code, out, err = run_toy_train_here(ckpt, 8, "--interval", "2")  # the limit lifted, the same command resumes
    assert code == 0, err
    assert f"Resumed from {ckpt}/model_iter4.pth at iteration 4" in out


def _obeying_permissions():
    """The ``preexec`` (``support.helpers.run_toy_train_forked``) that makes a process obey file permission bits, as any
    user's process does; None where this one obeys them already (a normal user).

    root ignores them through CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH; :func:`_drop_permission_override`
    gives both up in the process that calls it, which stays root otherwise.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            effective = int(next(line for line in f if line.startswith("CapEff:")).split()[1], 16)
    except (OSError, StopIteration):
        effective = 0b110 if os.geteuid() == 0 else 0
    return _drop_permission_override if effective & 0b110 else None


def _drop_permission_override():
    """CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH out of this process's effective and permitted sets (capset(2): a
    process may always give capabilities up, and one no longer permitted cannot come back)."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3; 0: this process
    sets = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable of capabilities 0-31, then of 32-63
    if libc.capget(header, sets) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    sets[0] &= ~0b110  # CAP_DAC_OVERRIDE (1), CAP_DAC_READ_SEARCH (2)
    sets[1] &= ~0b110
    if libc.capset(header, sets) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _write_probe(path, preexec) -> None:
    """A forked process's attempt at writing ``path`` after ``preexec``: exit status 0 (written), 3 (refused: the
    bits are obeyed) or 4 (``preexec`` failed)."""
    try:
        if preexec is not None:
            preexec()
    except OSError:
        raise SystemExit(4) from None
    try:
        open(path, "w").close()
    except PermissionError:
        raise SystemExit(3) from None


def _require_permissions_enforced(read_only_dir):
    """Skip unless a process given :func:`_obeying_permissions` really cannot write there."""
    probe = fork_server_context().Process(target=_write_probe, args=(os.path.join(read_only_dir, "probe"),
                                                                     _obeying_permissions()))
    probe.start()
    probe.join(timeout=300)
    if probe.exitcode == 4:
        pytest.skip("cannot make a process obey permission bits here (capset refused)")
    if probe.exitcode != 3:
        pytest.skip(f"a process can write into a read-only directory here (probe: exit status {probe.exitcode})")


@pytest.mark.slow
def test_a_read_only_checkpoint_directory_keeps_the_previous_checkpoint_and_says_what_to_do(tmp_path):
    """Permission denied for real (EACCES from the kernel): checkpoints go to a directory made read-only."""
    ckpt, out = tmp_path / "run", tmp_path / "checkpoints"
    opts = ("--interval", "2", "HOOKS.CHECKPOINT.OUT_DIR", str(out))
    code, _, err = run_toy_train_here(ckpt, 2, *opts)
    assert code == 0, err
    previous = (out / "model_iter2.pth").read_bytes()
    out.chmod(0o555)
    try:
        _require_permissions_enforced(out)
        code, _, err = run_toy_train_forked(ckpt, 4, *opts, preexec=_obeying_permissions())
    finally:
        out.chmod(0o755)
    assert code == 2
    assert err.strip().splitlines() == [
        f"Error: Could not write {out}/model_iter4.pth: Permission denied. The previous checkpoint is intact; make "
        f"{out} writable for this user, or point CKPT (or HOOKS.CHECKPOINT.OUT_DIR) at a writable directory, then "
        "resume with the same command."]
    assert (ckpt / "last_checkpoint").read_text() == str(out / "model_iter2.pth")
    assert (out / "model_iter2.pth").read_bytes() == previous
    assert sorted(os.listdir(out)) == ["model_final.pth", "model_iter2.pth"]  # nothing partial or temporary

    code, out_text, err = run_toy_train_here(ckpt, 4, *opts)  # writable again
    assert code == 0, err
    assert f"Resumed from {out}/model_iter2.pth at iteration 2" in out_text


@pytest.mark.slow
@pytest.mark.parametrize("fresh", [True, False], ids=["new-run", "resume"])
def test_a_read_only_ckpt_is_one_line_naming_it_and_what_to_do(tmp_path, fresh):
    ckpt = tmp_path / "run"
    if fresh:
        ckpt.mkdir()
    else:
        code, _, err = run_toy_train_here(ckpt, 2, "--interval", "2")
        assert code == 0, err
    before = sorted(os.listdir(ckpt))
    ckpt.chmod(0o555)
    try:
        _require_permissions_enforced(ckpt)
        code, _, err = run_toy_train_forked(ckpt, 4, "--interval", "2", preexec=_obeying_permissions())
    finally:
        ckpt.chmod(0o755)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: Could not write {ckpt}/"), err
    assert "Permission denied" in lines[0] and f"make {ckpt} writable" in lines[0]
    assert sorted(os.listdir(ckpt)) == before


def _no_space_line(disk) -> str:
    """The line a run ends with when ``disk`` is full at its iteration-4 checkpoint (docs/guarantees.md's remedy)."""
    return (f"Error: Could not write {disk}/model_iter4.pth: No space left on device. The previous checkpoint is "
            f"intact; free space on the disk holding {disk}, then resume with the same command.")


def test_a_disk_filling_up_mid_write_keeps_the_previous_checkpoint_and_says_what_to_do(tmp_path):
    """ENOSPC for any user: ``support.fault_plugins.FullDisk`` fills the checkpoint directory's disk from the resumed
    run's start, at the file-object level (the next test fills a real tmpfs, which needs root). Nothing here needs a
    process of its own: the runs are toy_train's, in this process."""
    ckpt, disk = tmp_path / "run", tmp_path / "disk"
    out_dir = ("--interval", "2", "HOOKS.CHECKPOINT.OUT_DIR", str(disk))
    code, _, err = run_toy_train_here(ckpt, 2, *out_dir)
    assert code == 0, err
    previous = (disk / "model_iter2.pth").read_bytes()

    full = repr([{"type": "support.fault_plugins.FullDisk", "directory": str(disk)}])
    code, _, err = run_toy_train_here(ckpt, 4, *out_dir, "HOOKS.CUSTOM", full)
    assert builtins.open is io.open  # the plugin's after_train ran in the failed run: this process's files are safe
    assert code == 2
    assert err.strip().splitlines() == [_no_space_line(disk)]
    assert (ckpt / "last_checkpoint").read_text() == str(disk / "model_iter2.pth")
    assert (disk / "model_iter2.pth").read_bytes() == previous
    assert sorted(os.listdir(disk)) == ["model_final.pth", "model_iter2.pth"]  # no partial or temporary file

    code, out, err = run_toy_train_here(ckpt, 4, *out_dir)  # space freed: the same command resumes
    assert code == 0, err
    assert f"Resumed from {disk}/model_iter2.pth at iteration 2" in out


def test_a_full_disk_keeps_the_previous_checkpoint_and_names_path_and_cause(tmp_path):
    """A real ENOSPC: checkpoints go to a tmpfs shrunk to hold the first one and not the second (needs root)."""
    ckpt, disk = tmp_path / "run", tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "pet-test-tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        out_dir = ("--interval", "2", "HOOKS.CHECKPOINT.OUT_DIR", str(disk))
        code, _, err = run_toy_train_here(ckpt, 2, *out_dir)
        assert code == 0, err
        previous = torch.load(disk / "model_iter2.pth", weights_only=True)
        stats = os.statvfs(disk)
        page = stats.f_frsize
        assert os.path.getsize(disk / "model_iter2.pth") > page  # so one spare page cannot hold the next one
        used = (stats.f_blocks - stats.f_bfree) * page
        shrink = subprocess.run(["mount", "-o", f"remount,size={used + page}", str(disk)], capture_output=True,
                                text=True)
        assert shrink.returncode == 0, shrink.stderr

        code, _, err = run_toy_train_here(ckpt, 4, *out_dir)
        assert code == 2
        assert err.strip().splitlines() == [_no_space_line(disk)]
        assert (ckpt / "last_checkpoint").read_text() == str(disk / "model_iter2.pth")
        assert sorted(os.listdir(disk)) == ["model_final.pth", "model_iter2.pth"]  # no partial or temporary file
        reloaded = torch.load(disk / "model_iter2.pth", weights_only=True)
        assert reloaded["iter"] == 2
        assert all(torch.equal(v, reloaded["model"][k]) for k, v in previous["model"].items())

        subprocess.run(["mount", "-o", "remount,size=1m", str(disk)], check=True)  # space freed: resume
        code, out, err = run_toy_train_here(ckpt, 4, *out_dir)
        assert code == 0, err
        assert f"Resumed from {disk}/model_iter2.pth at iteration 2" in out
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_resume_ignores_and_removes_leftover_temporary_files_but_not_user_files(make_cfg):
    opts = ("TRAIN.SAVE_AS_JSON", False, "HOOKS.CHECKPOINT.PERIOD", 2)
    toy_trainer(make_cfg(*opts, "SOLVER.MAX_ITER", 4)).train()
    ckpt = make_cfg().CKPT
    leftovers = {"model_iter6.pth.tmp4242": b"half a checkpoint", "last_checkpoint.tmp4242": b"model_iter6.pth"}
    user_files = ("notes.tmp", "model_iter6.pth.tmp", "scores.tmp1.json", "run.tmpl")
    for name, data in leftovers.items():
        with open(os.path.join(ckpt, name), "wb") as f:
            f.write(data)
    for name in user_files:
        with open(os.path.join(ckpt, name), "w") as f:
            f.write("mine")

    resumed = toy_trainer(make_cfg(*opts, "SOLVER.MAX_ITER", 6))
    resumed.resume_or_load(resume=True)
    assert resumed.start_iter == 4
    assert not [name for name in leftovers if os.path.exists(os.path.join(ckpt, name))]
    assert all(os.path.isfile(os.path.join(ckpt, name)) for name in user_files)
    with open(os.path.join(ckpt, "last_checkpoint")) as f:
        assert f.read() == "model_iter4.pth"
    resumed.train()
    assert regular_iters(ckpt) == [2, 4, 6]


def test_rerunning_a_finished_training_leaves_no_temporary_file(make_cfg):
    """The rerun links model_final.pth again to the same checkpoint: renaming a hard link onto the file it already
    names does nothing, and the staged link must not stay behind (the next run would take it for a killed write)."""
    cfg = make_cfg("TRAIN.SAVE_AS_JSON", False, "SOLVER.MAX_ITER", 4, "HOOKS.CHECKPOINT.PERIOD", 2)
    toy_trainer(cfg).train()
    rerun = toy_trainer(cfg)
    rerun.resume_or_load(resume=True)
    rerun.train()
    assert rerun.start_iter == 4
    assert sorted(n for n in os.listdir(cfg.CKPT) if n.endswith(".pth") or ".tmp" in n) == [
        "model_final.pth", "model_iter2.pth", "model_iter4.pth"]
    assert os.path.samefile(os.path.join(cfg.CKPT, "model_final.pth"), os.path.join(cfg.CKPT, "model_iter4.pth"))


def test_only_the_main_process_removes_leftover_temporary_files(make_cfg, monkeypatch):
    toy_trainer(make_cfg("TRAIN.SAVE_AS_JSON", False, "SOLVER.MAX_ITER", 2, "HOOKS.CHECKPOINT.PERIOD", 2)).train()
    ckpt = make_cfg().CKPT
    leftover = os.path.join(ckpt, "model_iter4.pth.tmp4242")
    with open(leftover, "wb") as f:
        f.write(b"half a checkpoint")
    monkeypatch.setattr(comm, "is_main_process", lambda: False)
    assert read_last_checkpoint(ckpt) == os.path.join(ckpt, "model_iter2.pth")
    assert os.path.isfile(leftover)  # the main process cleans it; the others would race it


class RunsCodeOnLoad:
    """Pickles as a call to ``os.mkdir(marker)``: unpickling it without ``weights_only`` creates ``marker``."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def save_checkpoint_that_runs_code(path, marker):
    """A Pet-shaped checkpoint (ToyModel weights, iteration 2) that also carries :class:`RunsCodeOnLoad`."""
    torch.save({"model": ToyModel().state_dict(), "iter": 2, "payload": RunsCodeOnLoad(marker)}, path)


def _load_weights_into_toy_model(path, **kwargs):
    return load_weights(ToyModel(), path, **kwargs)


@pytest.mark.parametrize("load", [load_checkpoint, _load_weights_into_toy_model], ids=["resume", "weights"])
def test_checkpoints_load_weights_only_unless_asked(tmp_path, load):
    """Both ways a .pth file is read refuse a pickle that would run code, naming the file and the opt-in."""
    path, marker = tmp_path / "evil.pth", tmp_path / "code_ran"
    save_checkpoint_that_runs_code(path, marker)
    with pytest.raises(ConfigError) as error:
        load(str(path))
    assert str(error.value) == (
        f"Refusing to load {path}: it holds pickled objects other than tensors (global {os.mkdir.__module__}.mkdir), "
        "and loading those can run arbitrary code. If you trust its source, load it with --unsafe-load.")
    assert not marker.exists()  # refused before anything ran
    load(str(path), unsafe=True)  # the opt-in loads it, and the payload is real: it runs
    assert marker.is_dir()


@pytest.mark.parametrize("start", [
    b"<!DOCTYPE html>\n<html><head><title>Sign in</title></head></html>\n",  # a download that got a login page
    b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 1024\n",  # a clone without git-lfs
    bytes(range(17, 117)),  # bytes that are no pickle (opcode 17 first)
], ids=["html", "git-lfs", "random"])
def test_a_file_that_is_no_pytorch_file_is_called_that_not_refused_as_unsafe(tmp_path, start):
    path = tmp_path / "model_final.pth"
    path.write_bytes(start)
    with pytest.raises(ConfigError) as error:
        load_checkpoint(str(path))
    message = str(error.value)
    assert message.startswith(f"Cannot load {path}: UnpicklingError: Unsupported operand {start[0]}")
    assert f"(not a PyTorch file, or a truncated one: it starts with {start[:24]!r}" in message
    assert "--unsafe-load" not in message and "Weights only" not in message


def test_resuming_from_a_checkpoint_that_would_run_code_is_one_line_and_runs_nothing(tmp_path):
    ckpt, marker = tmp_path / "run", tmp_path / "code_ran"
    ckpt.mkdir()
    save_checkpoint_that_runs_code(ckpt / "model_iter2.pth", marker)
    (ckpt / "last_checkpoint").write_text("model_iter2.pth")
    code, _, err = run_toy_train_here(ckpt, 4)
    assert code == 2
    assert err.strip().splitlines() == [
        f"Error: Refusing to load {ckpt}/model_iter2.pth: it holds pickled objects other than tensors (global "
        f"{os.mkdir.__module__}.mkdir), and loading those can run arbitrary code. If you trust its source, load it "
        "with --unsafe-load."]
    assert not marker.exists()
    assert not (ckpt / "model_iter4.pth").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name, occurrence", [("model_iter4.pth", 1), ("last_checkpoint", 2)],
                         ids=["checkpoint", "last_checkpoint"])
def test_sigkill_in_the_middle_of_a_checkpoint_write_leaves_the_previous_one_named_and_intact(tmp_path, name,
                                                                                             occurrence):
    """Killed half-way through writing the iteration-4 checkpoint or the last_checkpoint that names it."""
    ckpt = tmp_path / "run"
    proc, half_written = start_and_wait_for_report(ckpt, 6, "StallWrite", "--interval", "2", name=name,
                                                   occurrence=occurrence)
    proc.kill()
    proc.communicate()

    # last_checkpoint names a complete checkpoint, and nothing under a final name is partial.
    assert (ckpt / "last_checkpoint").read_text() == "model_iter2.pth"
    assert load_checkpoint(str(ckpt / "model_iter2.pth"))["iter"] == 2
    checkpoints = sorted(f for f in os.listdir(ckpt) if f.endswith(".pth"))
    assert checkpoints == ["model_iter2.pth"] + (["model_iter4.pth"] if name == "last_checkpoint" else [])
    assert [load_checkpoint(str(ckpt / f))["iter"] for f in checkpoints] == [2, 4][: len(checkpoints)]
    # The kill did land mid-write, into a temporary file.
    assert half_written == f"{ckpt}/{name}.tmp{proc.pid}"
    with open(half_written, "rb") as f:
        partial = f.read()
    if name == "last_checkpoint":
        assert partial == b"model_i"  # half of "model_iter4.pth"
    else:
        assert 0 < len(partial) < os.path.getsize(ckpt / "model_iter2.pth")

    code, out, err = run_toy_train_here(ckpt, 6, "--interval", "2")  # the same command resumes from the complete one
    assert code == 0, err
    assert f"Resumed from {ckpt}/model_iter2.pth at iteration 2" in out
    assert not os.path.exists(half_written)


def _two_groups(model):
    """SGD over the model's weights and biases as two parameter groups (one group is the default)."""
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    return torch.optim.SGD([{"params": weights}, {"params": biases}], lr=0.01)


@pytest.mark.parametrize("changed, raised", [
    ({"model": ToyModel(with_bn=True)}, "RuntimeError: Error(s) in loading state_dict for ToyModel: Missing key(s)"),
    ({"optimizer": "two groups"}, "ValueError: loaded state dict has a different number of parameter groups"),
], ids=["model", "optimizer"])
def test_a_checkpoint_this_config_cannot_resume_is_one_config_error_and_keeps_the_runs_config(make_cfg, changed,
                                                                                               raised):
    """An edited model or optimizer resumed in the old CKPT (TRAIN.AUTO_RESUME is on by default): one line naming
    the checkpoint, and CKPT/config.yaml still the config the checkpoints were trained with."""
    cfg = make_cfg("SOLVER.MAX_ITER", 2, "TRAIN.SAVE_AS_JSON", False)
    build_trainer(cfg, model=ToyModel(), data_loader=InfiniteToyLoader()).train()
    config_yaml = os.path.join(cfg.CKPT, "config.yaml")
    trained_with = open(config_yaml).read()

    edited = make_cfg("SOLVER.MAX_ITER", 4, "TRAIN.SAVE_AS_JSON", False, "TRAIN.AUTO_RESUME", True)
    model = changed.get("model", ToyModel())
    optimizer = _two_groups(model) if "optimizer" in changed else None
    with pytest.raises(ConfigError) as error:
        build_trainer(edited, model=model, optimizer=optimizer, data_loader=InfiniteToyLoader())
    message = str(error.value)
    assert message.startswith(f"Cannot resume from {cfg.CKPT}/model_iter2.pth: it does not fit this config's "
                              f"model or optimizer ({raised}")
    assert message.endswith(f"Train this config in a new CKPT, or set the changed keys back ({cfg.CKPT}/config.yaml "
                            "is the config it was trained with).")
    assert "\n" not in message
    assert open(config_yaml).read() == trained_with


def test_hub_format_weights_load_from_the_safetensors_file_or_its_directory(tmp_path):
    """The Hugging Face hub's layout: ``model.safetensors`` read with safetensors (nothing unpickled), the directory
    holding it read through it; a directory without weights, and a file that is no safetensors, are one line."""
    from safetensors.torch import save_file  # an extra (hub) that the test extra installs

    weights = {k: torch.randn_like(v) for k, v in ToyModel().state_dict().items()}
    save_file(weights, str(tmp_path / "model.safetensors"))
    for path in (tmp_path / "model.safetensors", tmp_path):
        model = ToyModel()
        assert load_weights(model, str(path)) == {"missing": [], "unexpected": [], "mismatched": []}
        assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=f"^{empty} is a directory without weights: expected one of "
                                          "model.safetensors, pytorch_model.bin"):
        load_checkpoint(str(empty))
    broken = tmp_path / "broken" / "model.safetensors"
    broken.parent.mkdir()
    broken.write_bytes(b"<!DOCTYPE html>\n<html></html>\n")
    with pytest.raises(ConfigError, match=f"^Cannot load {broken}: .*not a safetensors file"):
        load_checkpoint(str(broken.parent))


def test_a_file_holding_one_name_of_a_shared_module_fills_every_name_of_it(tmp_path):
    """A module used under several names (one head for every layer) is one tensor: a file that keeps one of its names,
    as save_pretrained does, loads with nothing reported missing, also for inference."""
    shared = torch.nn.Linear(2, 2)
    model = torch.nn.ModuleDict({"heads": torch.nn.ModuleList([shared, shared]), "other": torch.nn.Linear(2, 1)})
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items() if not k.startswith("heads.1.")}
    torch.save(state, tmp_path / "weights.pth")
    fresh_shared = torch.nn.Linear(2, 2)
    fresh = torch.nn.ModuleDict({"heads": torch.nn.ModuleList([fresh_shared, fresh_shared]),
                                 "other": torch.nn.Linear(2, 1)})
    assert load_weights(fresh, str(tmp_path / "weights.pth"), for_inference=True) == {
        "missing": [], "unexpected": [], "mismatched": []}
    assert torch.equal(fresh.heads[1].weight, state["heads.0.weight"])
    unshared = torch.nn.ModuleDict({"heads": torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]),
                                    "other": torch.nn.Linear(2, 1)})
    assert load_weights(unshared, str(tmp_path / "weights.pth"))["missing"] == ["heads.1.weight", "heads.1.bias"]
