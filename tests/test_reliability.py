"""Faults injected for real: signals, SIGKILL in the middle of a checkpoint write (SIGKILL between iterations of
the demo detector: tests/test_kill_resume.py),
a NaN loss, a full disk, a file-size limit, a read-only directory, leftover files, pickles that run code."""
from __future__ import annotations

import ctypes
import math
import os
import re
import select
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import IndexedToyLoader, ToyModel, run_two_ranks

from pet.config import load_cfg
from pet.engine.checkpoint import load_checkpoint, read_last_checkpoint
from pet.engine.events import read_metrics
from pet.engine.hooks import TrainHook
from pet.engine.trainer import Trainer
from pet.utils import comm
from pet.utils.errors import ConfigError, TrainingInterrupted
from pet.utils.weights import load_weights

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_train.py")


def start(ckpt, max_iter, *args, **popen):
    """``tests/toy_train.py`` in a subprocess; ``popen``: extra ``subprocess.Popen`` arguments."""
    return subprocess.Popen([sys.executable, SCRIPT, "--ckpt", str(ckpt), "--max-iter", str(max_iter), *args],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def run(ckpt, max_iter, *args, **popen):
    proc = start(ckpt, max_iter, *args, **popen)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def start_and_wait_for_report(ckpt, max_iter, plugin, *args, also=(), **kwargs):
    """Start toy_train with the hook ``fault_plugins.<plugin>(fd=<a pipe>, **kwargs)`` and wait for its report.

    ``also``: more ``HOOKS.CUSTOM`` entries. Returns the process, still running, and the line
    the hook wrote on the pipe once it got where the test wants it: no sleep, no timing
    assumption. A child that exits before reporting fails the test with its output.
    """
    read_end, write_end = os.pipe()
    hooks = [*also, {"type": f"fault_plugins.{plugin}", "fd": write_end, **kwargs}]
    try:
        proc = start(ckpt, max_iter, *args, "HOOKS.CUSTOM", repr(hooks), pass_fds=(write_end,))
    finally:
        os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 300)  # a hang guard only
        report = os.read(read_end, 4096).decode() if ready else ""
    finally:
        os.close(read_end)
    if not report:  # the child exited (end of file) or hung
        proc.kill()
        raise AssertionError(f"{plugin} never reported: {proc.communicate()}")
    return proc, report.strip()


def final_weights(ckpt):
    return torch.load(os.path.join(ckpt, "model_final.pth"), weights_only=True)["model"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_saves_a_checkpoint_and_resume_continues_from_it(tmp_path, signum):
    ckpt, stopped_at = tmp_path / "run", 5
    # The child waits for the signal after iteration 5 and says so on a pipe; the two markers show that
    # after_train ran and the writers were closed.
    proc, _ = start_and_wait_for_report(ckpt, 10, "PauseForSignal", "--interval", "1000",
                                        "TRAIN.WRITERS", "[{'type': 'fault_plugins.CloseMarker'}]",
                                        at=stopped_at, also=[{"type": "fault_plugins.AfterTrainMarker"}])
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum
    assert err.strip().splitlines() == [
        f"Error: Training stopped by {signum.name} after iteration {stopped_at}; checkpoint "
        f"{ckpt}/model_iter{stopped_at}.pth. Run the same command to resume from it."], err
    assert (ckpt / "last_checkpoint").read_text() == f"model_iter{stopped_at}.pth"
    assert not (ckpt / "model_final.pth").exists()
    assert (ckpt / "after_train.txt").read_text() == str(stopped_at)
    assert (ckpt / "writer_closed.txt").read_text() == str(stopped_at)
    assert read_metrics(str(ckpt / "metrics.json"))[-1]["iteration"] == stopped_at

    code, out, err = run(ckpt, stopped_at + 3)
    assert code == 0, err
    assert f"Resumed from {ckpt}/model_iter{stopped_at}.pth at iteration {stopped_at}" in out
    iterations = [r["iteration"] for r in read_metrics(str(ckpt / "metrics.json"))]
    assert iterations == list(range(1, stopped_at + 4))  # one consistent history, no gap, no repeat


class SignalAt(TrainHook):
    """Sends ``signum`` to this process in ``after_step`` of iteration ``at`` (1-based), as a scheduler would."""

    def __init__(self, at: int, signum: int = signal.SIGTERM) -> None:
        self.at = at
        self.signum = signum

    def after_step(self, trainer, **kwargs):
        if trainer.iter + 1 == self.at:
            os.kill(os.getpid(), self.signum)


def _toy_trainer(cfg, *hooks, default_hooks=True):
    torch.manual_seed(0)
    trainer = Trainer(cfg, model=ToyModel(), data_loader=IndexedToyLoader(), default_hooks=default_hooks)
    trainer.register_hooks(hooks)
    return trainer


def _iters_in(directory):
    return sorted(int(m[1]) for m in map(re.compile(r"model_iter(\d+)\.pth").fullmatch, os.listdir(directory)) if m)


@pytest.mark.parametrize("at, kept", [(5, [4, 5]), (4, [2, 4])])
def test_signal_checkpoint_goes_through_the_checkpoint_hook(make_cfg, tmp_path, at, kept):
    """OUT_DIR, the kept list and MAX_KEEP apply to it; a step that just saved is not saved twice."""
    out = tmp_path / "out"
    opts = ("TRAIN.SAVE_AS_JSON", False, "HOOKS.CHECKPOINT.INTERVAL", 2, "HOOKS.CHECKPOINT.MAX_KEEP", 2,
            "HOOKS.CHECKPOINT.OUT_DIR", out)
    trainer = _toy_trainer(make_cfg(*opts), SignalAt(at))
    saved = []
    original = trainer.save_checkpoint

    def spy(filename, **kwargs):
        saved.append(filename)
        return original(filename, **kwargs)

    trainer.save_checkpoint = spy
    message = f"after iteration {at}; checkpoint {out}/model_iter{at}.pth"
    with pytest.raises(TrainingInterrupted, match=re.escape(message)):
        trainer.train()
    assert saved == [f"model_iter{n}.pth" for n in range(2, at + 1, 2)] + ([f"model_iter{at}.pth"] if at % 2 else [])
    assert _iters_in(out) == kept and not _iters_in(trainer.output_dir)
    assert read_last_checkpoint(trainer.output_dir) == str(out / f"model_iter{at}.pth")
    assert torch.load(out / f"model_iter{at}.pth", weights_only=True)["hooks"]["CheckpointHook"]["kept"] == [
        f"model_iter{n}.pth" for n in kept]

    resumed = _toy_trainer(make_cfg(*opts, "SOLVER.MAX_ITER", 8))
    resumed.resume_or_load(resume=True)
    assert resumed.start_iter == at
    resumed.train()
    assert _iters_in(out) == [6, 8]  # MAX_KEEP pruned the signal checkpoint like any other


def test_signal_checkpoint_without_a_checkpoint_hook_goes_to_ckpt(make_cfg):
    trainer = _toy_trainer(make_cfg("TRAIN.SAVE_AS_JSON", False), SignalAt(3, signal.SIGINT), default_hooks=False)
    with pytest.raises(TrainingInterrupted, match="stopped by SIGINT after iteration 3") as stop:
        trainer.train()
    assert stop.value.exit_code == 128 + signal.SIGINT
    assert read_last_checkpoint(trainer.output_dir) == os.path.join(trainer.output_dir, "model_iter3.pth")


def test_nan_loss_stops_naming_iteration_and_term_and_keeps_last_checkpoint(tmp_path):
    ckpt = tmp_path / "run"
    code, _, err = run(ckpt, 20, "--nan-at", "7", "--interval", "2")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert "Non-finite loss at iteration 7: loss_l1=nan" in lines[0] and "SOLVER.SKIP_NONFINITE" in lines[0]
    assert (ckpt / "last_checkpoint").read_text() == "model_iter6.pth"
    assert not (ckpt / "model_final.pth").exists()


def test_the_finite_check_uses_the_loss_reduced_over_processes(make_cfg, monkeypatch):
    """Another rank's NaN reaches this one through the step's single reduction: every rank skips together."""
    calls = []

    def reduce_like_another_rank_had_nan(values, **kwargs):
        calls.append(dict(values))
        reduced = dict(values, data_time=123.0)
        if len(calls) == 3:
            reduced.update(loss_l1=float("nan"), total_loss=float("nan"))
        return reduced

    monkeypatch.setattr(comm, "reduce_scalars", reduce_like_another_rank_had_nan)
    trainer = _toy_trainer(make_cfg("SOLVER.MAX_ITER", 5, "SOLVER.SKIP_NONFINITE", True, "TRAIN.SAVE_AS_JSON", False),
                           default_hooks=False)
    trainer.train()
    assert len(calls) == 5 and all(math.isfinite(c["total_loss"]) for c in calls)  # once per step, local values
    assert trainer.nonfinite_skipped == 1
    assert trainer.storage.history("data_time").values()[-1][0] == 123.0  # stored as reduced, not reduced again
    assert math.isnan(trainer.storage.history("total_loss").values()[2][0])


class NanOnOneRank(ToyModel):
    """Returns a NaN ``loss_l1`` on rank 1 only, at its ``nan_at``-th call."""

    def __init__(self, nan_at: int) -> None:
        super().__init__()
        self.nan_at = nan_at
        self.calls = 0

    def forward(self, x, y):
        self.calls += 1
        losses = super().forward(x, y)
        if dist.get_rank() == 1 and self.calls == self.nan_at:
            losses["loss_l1"] = losses["loss_l1"] * float("nan")
        return losses


def _nonfinite_worker(rank, init_file, opts, queue):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        cfg = load_cfg(None, opts)
        trainer = Trainer(cfg, model=NanOnOneRank(nan_at=3), data_loader=IndexedToyLoader(seed=rank))
        try:
            trainer.train()
            queue.put((rank, "finished", trainer.iter, trainer.nonfinite_skipped))
        except Exception as exc:  # reported, not raised: the parent compares what every rank saw
            queue.put((rank, f"{type(exc).__name__}: {exc}".split(". ")[0], trainer.iter, trainer.nonfinite_skipped))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("skip, expected", [
    (True, ("finished", 6, 1)),
    (False, ("TrainingError: Non-finite loss at iteration 3: loss_l1=nan", 2, 0)),
])
def test_a_nan_on_one_rank_stops_or_skips_on_every_rank_without_hanging(tmp_path, skip, expected):
    opts = ["CKPT", str(tmp_path / "run"), "DEVICE", "cpu", "SOLVER.MAX_ITER", "6", "SOLVER.BASE_LR", "0.01",
            "SOLVER.WARMUP_ITERS", "0", "TRAIN.SAVE_AS_JSON", "False", "DISPLAY_ITER", "100",
            "SOLVER.SKIP_NONFINITE", str(skip)]
    results = run_two_ranks(_nonfinite_worker, tmp_path / "init", opts)  # a hang: queue.Empty
    assert results == [(0, *expected), (1, *expected)]


class SignalRankOne(TrainHook):
    """Sends SIGTERM to rank 1's own process after its third step: rank 0 never receives it."""

    def after_step(self, trainer, **kwargs):
        if dist.get_rank() == 1 and trainer.iter == 2:
            os.kill(os.getpid(), signal.SIGTERM)


def _signal_worker(rank, init_file, opts, queue):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        trainer = Trainer(load_cfg(None, opts), model=ToyModel(), data_loader=IndexedToyLoader(seed=rank))
        trainer.register_hook(SignalRankOne())
        try:
            trainer.train()
            queue.put((rank, "finished", trainer.iter))
        except TrainingInterrupted as exc:
            queue.put((rank, str(exc).split(";")[0], trainer.iter))
    finally:
        dist.destroy_process_group()


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """The signal travels in the step's reduction: no rank waits in a collective the others never join."""
    opts = ["CKPT", str(tmp_path / "run"), "DEVICE", "cpu", "SOLVER.MAX_ITER", "8", "SOLVER.BASE_LR", "0.01",
            "SOLVER.WARMUP_ITERS", "0", "TRAIN.SAVE_AS_JSON", "False", "DISPLAY_ITER", "100"]
    results = run_two_ranks(_signal_worker, tmp_path / "init", opts)  # a hang: queue.Empty
    # Rank 1 is signalled during step 3's hooks; the next step's reduction carries it to rank 0.
    assert results == [(r, "Training stopped by SIGTERM after iteration 4", 4) for r in range(2)]
    assert read_last_checkpoint(str(tmp_path / "run")).endswith("model_iter4.pth")


def test_skip_nonfinite_skips_and_counts(tmp_path):
    ckpt = tmp_path / "run"
    code, out, err = run(ckpt, 10, "--nan-at", "4", "SOLVER.SKIP_NONFINITE", "True")
    assert code == 0, err
    assert "Non-finite loss at iteration 4 (loss_l1=nan); step skipped (1 skipped so far)" in out
    last = read_metrics(str(ckpt / "metrics.json"))[-1]
    assert last["iteration"] == 10 and last["nonfinite_skipped"] == 1
    assert all(torch.isfinite(v).all() for v in final_weights(ckpt).values())


def test_failed_checkpoint_write_keeps_the_previous_one_and_names_path_and_cause(tmp_path):
    """A write failing with EFBIG (RLIMIT_FSIZE, SIGXFSZ ignored), the disk-full case any user can cause."""
    ckpt = tmp_path / "run"
    code, _, err = run(ckpt, 4, "--interval", "2")
    assert code == 0, err
    previous = (ckpt / "model_iter4.pth").read_bytes()
    # Resume with files capped one byte under a checkpoint's size: the one at iteration 6 cannot be written
    # (the log and metrics.json stay far smaller).
    limit = len(previous) - 1
    code, _, err = run(ckpt, 8, "--interval", "2", "--file-size-limit", str(limit))
    assert code == 2
    assert err.strip().splitlines() == [
        f"Error: Could not write {ckpt}/model_iter6.pth: File too large. The previous checkpoint is intact; raise "
        "the file-size limit (ulimit -f), or point CKPT at a file system that allows larger files, then resume "
        "with the same command."]
    assert (ckpt / "last_checkpoint").read_text() == "model_iter4.pth"
    assert (ckpt / "model_iter4.pth").read_bytes() == previous
    assert sorted(f for f in os.listdir(ckpt) if f.endswith(".pth") or ".tmp" in f) == [
        "model_final.pth", "model_iter2.pth", "model_iter4.pth"]  # no partial or temporary file

    code, out, err = run(ckpt, 8, "--interval", "2")  # the limit lifted, the same command resumes
    assert code == 0, err
    assert f"Resumed from {ckpt}/model_iter4.pth at iteration 4" in out


def _obeying_permissions():
    """``subprocess.Popen`` arguments for a child that obeys file permission bits, as any user's process does.

    root ignores them through CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH; dropped from the
    bounding set before ``exec``, the child runs as root (it can still read the interpreter
    under /root) without them. A process that lacks them already (a normal user) needs nothing.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            effective = int(next(line for line in f if line.startswith("CapEff:")).split()[1], 16)
    except (OSError, StopIteration):
        effective = 0b110 if os.geteuid() == 0 else 0
    return {"preexec_fn": _drop_permission_override} if effective & 0b110 else {}


def _drop_permission_override():
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _require_permissions_enforced(read_only_dir):
    """Skip unless a child started with :func:`_obeying_permissions` really cannot write there."""
    probe = os.path.join(read_only_dir, "probe")
    try:
        subprocess.run([sys.executable, "-c", f"open({probe!r}, 'w')"], capture_output=True, check=False,
                       **_obeying_permissions())
    except subprocess.SubprocessError as exc:  # prctl refused: root without CAP_SETPCAP
        pytest.skip(f"cannot start a child that obeys permission bits here: {exc}")
    if os.path.exists(probe):
        pytest.skip("a child can write into a read-only directory here (capabilities beyond root's usual)")


def test_a_read_only_checkpoint_directory_keeps_the_previous_checkpoint_and_says_what_to_do(tmp_path):
    """Permission denied for real (EACCES from the kernel): checkpoints go to a directory made read-only."""
    ckpt, out = tmp_path / "run", tmp_path / "checkpoints"
    opts = ("--interval", "2", "HOOKS.CHECKPOINT.OUT_DIR", str(out))
    code, _, err = run(ckpt, 2, *opts)
    assert code == 0, err
    previous = (out / "model_iter2.pth").read_bytes()
    out.chmod(0o555)
    try:
        _require_permissions_enforced(out)
        code, _, err = run(ckpt, 4, *opts, **_obeying_permissions())
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

    code, out_text, err = run(ckpt, 4, *opts, **_obeying_permissions())  # writable again
    assert code == 0, err
    assert f"Resumed from {out}/model_iter2.pth at iteration 2" in out_text


@pytest.mark.parametrize("fresh", [True, False], ids=["new-run", "resume"])
def test_a_read_only_ckpt_is_one_line_naming_it_and_what_to_do(tmp_path, fresh):
    ckpt = tmp_path / "run"
    if fresh:
        ckpt.mkdir()
    else:
        code, _, err = run(ckpt, 2, "--interval", "2")
        assert code == 0, err
    before = sorted(os.listdir(ckpt))
    ckpt.chmod(0o555)
    try:
        _require_permissions_enforced(ckpt)
        code, _, err = run(ckpt, 4, "--interval", "2", **_obeying_permissions())
    finally:
        ckpt.chmod(0o755)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: Could not write {ckpt}/"), err
    assert "Permission denied" in lines[0] and f"make {ckpt} writable" in lines[0]
    assert sorted(os.listdir(ckpt)) == before


def test_a_full_disk_keeps_the_previous_checkpoint_and_names_path_and_cause(tmp_path):
    """A real ENOSPC: checkpoints go to a tmpfs shrunk to hold the first one and not the second."""
    ckpt, disk = tmp_path / "run", tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "pet-test-tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        out_dir = ("--interval", "2", "HOOKS.CHECKPOINT.OUT_DIR", str(disk))
        code, _, err = run(ckpt, 2, *out_dir)
        assert code == 0, err
        previous = torch.load(disk / "model_iter2.pth", weights_only=True)
        stats = os.statvfs(disk)
        page = stats.f_frsize
        assert os.path.getsize(disk / "model_iter2.pth") > page  # so one spare page cannot hold the next one
        used = (stats.f_blocks - stats.f_bfree) * page
        shrink = subprocess.run(["mount", "-o", f"remount,size={used + page}", str(disk)], capture_output=True,
                                text=True)
        assert shrink.returncode == 0, shrink.stderr

        code, _, err = run(ckpt, 4, *out_dir)
        assert code == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert f"Could not write {disk}/model_iter4.pth: No space left on device." in lines[0]
        assert "The previous checkpoint is intact" in lines[0]
        assert (ckpt / "last_checkpoint").read_text() == str(disk / "model_iter2.pth")
        assert sorted(os.listdir(disk)) == ["model_final.pth", "model_iter2.pth"]  # no partial or temporary file
        reloaded = torch.load(disk / "model_iter2.pth", weights_only=True)
        assert reloaded["iter"] == 2
        assert all(torch.equal(v, reloaded["model"][k]) for k, v in previous["model"].items())

        subprocess.run(["mount", "-o", "remount,size=1m", str(disk)], check=True)  # space freed: resume
        code, out, err = run(ckpt, 4, *out_dir)
        assert code == 0, err
        assert f"Resumed from {disk}/model_iter2.pth at iteration 2" in out
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_resume_ignores_and_removes_leftover_temporary_files_but_not_user_files(make_cfg):
    opts = ("TRAIN.SAVE_AS_JSON", False, "HOOKS.CHECKPOINT.INTERVAL", 2)
    _toy_trainer(make_cfg(*opts, "SOLVER.MAX_ITER", 4)).train()
    ckpt = make_cfg().CKPT
    leftovers = {"model_iter6.pth.tmp4242": b"half a checkpoint", "last_checkpoint.tmp4242": b"model_iter6.pth"}
    user_files = ("notes.tmp", "model_iter6.pth.tmp", "scores.tmp1.json", "run.tmpl")
    for name, data in leftovers.items():
        with open(os.path.join(ckpt, name), "wb") as f:
            f.write(data)
    for name in user_files:
        with open(os.path.join(ckpt, name), "w") as f:
            f.write("mine")

    resumed = _toy_trainer(make_cfg(*opts, "SOLVER.MAX_ITER", 6))
    resumed.resume_or_load(resume=True)
    assert resumed.start_iter == 4
    assert not [name for name in leftovers if os.path.exists(os.path.join(ckpt, name))]
    assert all(os.path.isfile(os.path.join(ckpt, name)) for name in user_files)
    with open(os.path.join(ckpt, "last_checkpoint")) as f:
        assert f.read() == "model_iter4.pth"
    resumed.train()
    assert _iters_in(ckpt) == [2, 4, 6]


def test_only_the_main_process_removes_leftover_temporary_files(make_cfg, monkeypatch):
    _toy_trainer(make_cfg("TRAIN.SAVE_AS_JSON", False, "SOLVER.MAX_ITER", 2, "HOOKS.CHECKPOINT.INTERVAL", 2)).train()
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


def test_resuming_from_a_checkpoint_that_would_run_code_is_one_line_and_runs_nothing(tmp_path):
    ckpt, marker = tmp_path / "run", tmp_path / "code_ran"
    ckpt.mkdir()
    save_checkpoint_that_runs_code(ckpt / "model_iter2.pth", marker)
    (ckpt / "last_checkpoint").write_text("model_iter2.pth")
    code, _, err = run(ckpt, 4)
    assert code == 2
    assert err.strip().splitlines() == [
        f"Error: Refusing to load {ckpt}/model_iter2.pth: it holds pickled objects other than tensors (global "
        f"{os.mkdir.__module__}.mkdir), and loading those can run arbitrary code. If you trust its source, load it "
        "with --unsafe-load."]
    assert not marker.exists()
    assert not (ckpt / "model_iter4.pth").exists()


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

    code, out, err = run(ckpt, 6, "--interval", "2")  # the same command resumes from the complete one
    assert code == 0, err
    assert f"Resumed from {ckpt}/model_iter2.pth at iteration 2" in out
    assert not os.path.exists(half_written)
