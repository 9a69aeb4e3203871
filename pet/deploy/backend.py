"""``--backend auto``: the fastest way to run a detector on this machine among those available, measured here.

On a GPU (``DEVICE``) the answer is PyTorch; the rest is about CPUs, where no table of CPU classes can say what
is fastest (onnxruntime int8 was fastest on one AVX-512 VNNI machine; OpenVINO, bfloat16 and the next CPU each
change the ranking), so the candidates are timed on this machine, once, and the decision is cached.

1. **The candidates** (:func:`exported_models`, :func:`choose_backend`): PyTorch in float32 and, where the CPU runs
   it natively and ``TEST.AMP`` allows it, in bfloat16; and each export of the weights being evaluated
   (``TEST.WEIGHTS``, else ``CKPT/model_final.pth``) that tools/export.py wrote under its default name in ``CKPT``,
   every one of them through its gate: ``model.onnx`` (onnxruntime float32), ``model.int8.onnx`` (onnxruntime
   int8), ``model.xml`` (OpenVINO float32, ``--openvino``) and ``model.int8.xml`` (OpenVINO int8, ``--openvino
   --int8``). An export is offered only if it records the sha256 of those weights (``pet.weights_sha256``); a file
   made from the float export (the int8 models, the IRs) also records that export's sha256
   (``pet.int8.float_sha256``) and, beside a float export, is offered only if it was made from that very file (it
   computes with its thresholds; with no float export beside it, nothing newer contradicts it: it is offered, and
   the log says it was not checked). An int8 model quantized with 8-bit weights is passed over on a CPU without
   VNNI, where its products can saturate (quantizing there writes 7-bit weights, which run anywhere), and a runtime
   that is not installed is passed over with the line that installs it. Each reason goes into the log.
2. **The measurement** (:func:`measure_candidates`): every candidate on one generated batch of the test loader's
   shape (``TEST.IMS_PER_BATCH`` images at the test size), in alternating rounds
   (:func:`pet.engine.speed_probe.time_alternating`), the PyTorch model with the weights being evaluated.
3. **The choice**: the fastest float32 candidate (the parity gate made them equal), unless an int8 or bfloat16
   one is at least ``speed_probe.MARGIN`` times faster than it (their gates allow them to differ slightly, which
   run-to-run noise must not buy). With no export, PyTorch decides its own precision (``TEST.AMP``,
   :mod:`pet.engine.precision`).
4. **The cache**: ``PET_CACHE_DIR``/backend.json (next to the precision decisions), keyed by the machine's
   fingerprint, the candidates' files (sha256), the model and input config and the batch: one machine always makes
   the same choice for the same files. Delete the file to measure again.

An export computes with the thresholds and sizes it was exported with, whatever the config says now. This module
imports onnxruntime and OpenVINO only to time their models, onnx only to read an export's metadata, so tools
can call it before deciding what to load.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from fvcore.common.config import CfgNode

from pet.config import default_weights, load_cfg
from pet.data.synthetic import synthetic_batch
from pet.deploy.exported_model import FLOAT_SHA256_KEY, WEIGHTS_SHA256_KEY, ExportedModel
from pet.deploy.onnxruntime_model import INSTALL_EXPORT_EXTRA, OnnxRuntimeModel
from pet.deploy.openvino_model import INSTALL_OPENVINO_EXTRA, OpenVinoModel, openvino_metadata
from pet.engine.build import build_test_model
from pet.engine.inference import inference_precision
from pet.engine.models import call_model, resolve_device
from pet.engine.speed_probe import MARGIN, MAX_SPREAD, JsonCache, Timing, time_alternating
from pet.utils.cpu import cpu_int8_support, cpu_native_support, machine_fingerprint
from pet.utils.errors import ConfigError
from pet.utils.files import file_lock, file_sha256

__all__ = ["BackendChoice", "EXPORT_RUNTIMES", "ExportRuntime", "FLOAT_SHA256_KEY", "WEIGHTS_SHA256_KEY",
           "choose_backend", "exported_models", "int8_path", "measure_candidates", "resolve_backend"]

logger = logging.getLogger(__name__)


def _onnx_metadata(path: str) -> dict[str, str]:
    """The metadata_props of the ONNX file ``path`` ({} for a file onnx cannot read)."""
    import onnx  # an optional extra ("export"): only a CKPT that holds exports needs it

    try:
        model = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 - protobuf raises its own types for a damaged file; it is then not offered
        return {}
    return {prop.key: prop.value for prop in model.metadata_props}


@dataclass(frozen=True)
class ExportRuntime:
    """A runtime for tools/export.py's files, as ``--backend`` names it: ``model(path, threads=N)`` loads one
    (an :class:`ExportedModel`), ``default_file`` is the float model it loads from ``CKPT`` when no file is named
    (its int8 model: :func:`int8_path` of it), ``files`` says which files ``--model`` names for it; ``package``
    and ``install`` say what it needs, ``metadata(path)`` reads a file's record without running it."""

    model: Callable[..., ExportedModel]
    default_file: str
    files: str
    package: str
    install: str
    metadata: Callable[[str], dict[str, str]]


# The backends that run an export rather than the PyTorch model (pet.predict.loading.BACKENDS adds "pytorch"); the
# tools' --backend choices, --model checks, loading and --backend auto all read this table.
EXPORT_RUNTIMES = {
    "onnxruntime": ExportRuntime(OnnxRuntimeModel, "model.onnx", "an ONNX file written by tools/export.py",
                                 "onnxruntime", INSTALL_EXPORT_EXTRA, _onnx_metadata),
    "openvino": ExportRuntime(OpenVinoModel, "model.xml", "an OpenVINO IR (.xml, beside its .bin) written by "
                                                          "tools/export.py --openvino, or an ONNX file",
                              "openvino", INSTALL_OPENVINO_EXTRA, openvino_metadata),
}


@dataclass(frozen=True)
class BackendChoice:
    """``backend``: "pytorch" or a key of :data:`EXPORT_RUNTIMES`; ``model``: the exported file ("" for PyTorch);
    ``precision``: "int8", "bfloat16" or "float32"; ``reason``: why, for the log; ``opts``: the ``TEST.AMP``
    overrides that make the run compute in that precision (an export never autocasts; PyTorch in the precision
    measured here, not measured again; none where PyTorch's own ``TEST.AMP`` decision stands)."""

    backend: str
    model: str
    precision: str
    reason: str
    opts: tuple[str, ...] = ()

    def __str__(self) -> str:
        model = f" {self.model}" if self.model else ""
        return f"{self.backend}{model} in {self.precision}: {self.reason}"


def int8_path(path: str) -> str:
    """Where tools/export.py --int8 writes the int8 model of the float model ``path``: ``model.onnx`` ->
    ``model.int8.onnx``, ``model.xml`` -> ``model.int8.xml`` beside it."""
    root, ext = os.path.splitext(path)
    return f"{root}.int8{ext or '.onnx'}"


def exported_models(cfg: CfgNode, passed_over: list[str] | None = None) -> dict[str, str]:
    """The exports of this config's weights in ``CKPT`` that may run here, by candidate name: ``{"onnxruntime
    float32": CKPT/model.onnx, "onnxruntime int8": CKPT/model.int8.onnx, "openvino float32": CKPT/model.xml,
    "openvino int8": CKPT/model.int8.xml}`` for those that exist and pass the checks of the module docstring; why
    each other one was left out (or that a derived file was offered unchecked) is appended to ``passed_over``."""
    weights = default_weights(cfg)
    float_path = os.path.join(cfg.CKPT, EXPORT_RUNTIMES["onnxruntime"].default_file)
    files = {}
    for backend, runtime in EXPORT_RUNTIMES.items():
        path = os.path.join(cfg.CKPT, runtime.default_file)
        for precision, candidate in (("float32", path), ("int8", int8_path(path))):
            if os.path.isfile(candidate):
                files[f"{backend} {precision}"] = candidate
    found, skipped = {}, []
    if files and not os.path.isfile(weights):
        skipped.append(f"{' and '.join(files.values())} passed over: the weights {weights} are not there to check "
                       "that they were exported from them")
        files = {}
    sha = file_sha256(weights) if files else ""
    int8 = cpu_int8_support()
    for name, path in files.items():
        runtime = EXPORT_RUNTIMES[name.split()[0]]
        if importlib.util.find_spec(runtime.package) is None or importlib.util.find_spec("onnx") is None:
            skipped.append(f"{path} passed over: {runtime.package} and onnx are needed to run and read it "
                           f"({runtime.install})")
            continue
        offered, note = _check_export(path, runtime.metadata(path), sha, weights, float_path, name.endswith("int8"),
                                      int8.native)
        if offered:
            found[name] = path
        if note:
            skipped.append(note)
    if passed_over is not None:
        passed_over.extend(skipped)
    return found


def _check_export(path: str, metadata: Mapping[str, str], weights_sha: str, weights: str, float_path: str,
                  int8: bool, vnni: bool) -> tuple[bool, str]:
    """Whether the export ``path`` (with ``metadata``) is offered, and the note for the log: why not, or that it is
    offered unchecked ("" when offered after every check): the rules of the module docstring."""
    recorded = metadata.get(WEIGHTS_SHA256_KEY)
    if recorded is None:
        return False, (f"{path} passed over: it does not record the weights it was exported from (an export older "
                       f"than that record); export {weights} again with tools/export.py")
    if recorded != weights_sha:
        return False, (f"{path} passed over: it was exported from other weights than {weights} (sha256 "
                       f"{recorded[:12]}, not {weights_sha[:12]}); export them with tools/export.py")
    if int8 and not vnni and metadata.get("pet.int8.reduce_range") != "True":
        return False, (f"{path} passed over: it was quantized with 8-bit weights for a CPU with VNNI, and this CPU has "
                       "none (its int8 products could saturate); quantize it on this machine (tools/export.py --int8 "
                       "writes 7-bit weights where there is no VNNI)")
    if path == float_path:
        return True, ""
    again = (f"make it again with tools/export.py --check-only --output {float_path} "
             f"{'--openvino ' if path.endswith('.xml') else ''}{'--int8' if int8 else ''}").rstrip()
    source = metadata.get(FLOAT_SHA256_KEY)
    if not os.path.isfile(float_path):
        return True, (f"{path} offered unchecked: {float_path}, the float export it must have been made from, is not "
                      "there to show that it computes with that export's thresholds")
    if source is None:
        return False, (f"{path} passed over: it does not record the float export it was made from (older than that "
                       f"record), so it may compute with other thresholds than {float_path}; {again}")
    if source != file_sha256(float_path):
        return False, (f"{path} passed over: it was made from an earlier export than {float_path} (exported again "
                       f"since, perhaps with other TEST options, which it does not compute with); {again}")
    return True, ""


@dataclass(frozen=True)
class _Candidate:
    """One way to run the detector: ``backend`` in ``precision``, from ``model`` (an export; "" for PyTorch)."""

    backend: str
    precision: str
    model: str = ""

    @property
    def name(self) -> str:
        return f"{self.backend} {self.precision}"


def choose_backend(cfg: CfgNode, available: Mapping[str, str], passed_over: Sequence[str] = (),
                   model: torch.nn.Module | None = None, cache: JsonCache | None = None) -> BackendChoice:
    """The fastest backend on this machine among PyTorch and the exports in ``available`` (``{candidate name:
    path}``, e.g. :func:`exported_models`), measured or read from ``cache`` (default: ``backend.json`` in
    ``PET_CACHE_DIR``) as the module docstring says. ``passed_over``: why exports were left out of ``available``,
    which the reason then starts with. ``model``: the PyTorch model to time (default: the config's with the weights
    being evaluated, built only if there is an export to time it against)."""
    device = resolve_device(cfg.DEVICE)
    skipped = list(passed_over)
    if cfg.TEST.AUG.ENABLED and available:
        skipped.append(f"{' and '.join(available.values())} passed over: TEST.AUG.ENABLED (test-time augmentation) "
                       "runs in PyTorch only")
        available = {}
    if device.type != "cpu" or not available:
        # warn=False: only weighing it; the PyTorch run warns about emulated bfloat16 itself.
        pytorch = inference_precision(cfg, model, warn=False)
        why = (f"DEVICE {cfg.DEVICE} runs on {device.type}; the exports run on the CPU" if device.type != "cpu" else
               f"{pytorch.reason}, and no export of these weights to measure it against (tools/export.py writes "
               f"{os.path.join(cfg.CKPT, 'model.onnx')})")
        return BackendChoice("pytorch", "", pytorch.name, "; ".join([*skipped, why]))
    candidates = [_Candidate("pytorch", "float32")]
    bfloat16 = cpu_native_support("bfloat16")
    if str(cfg.TEST.AMP.ENABLED) == "False":
        skipped.append("PyTorch bfloat16 not a candidate: TEST.AMP.ENABLED False")
    elif cfg.TEST.AMP.DTYPE in ("auto", "bfloat16") and bfloat16.native:
        candidates.append(_Candidate("pytorch", "bfloat16"))
    candidates += [_Candidate(*name.split(), path) for name, path in available.items()]
    ms, source = _measured(cfg, candidates, model, cache or JsonCache("backend.json", what="backend measurement"))
    chosen = _fastest(candidates, ms)
    pytorch_ms = ms["pytorch float32"]
    speedup = "" if chosen.name == "pytorch float32" else f", {pytorch_ms / ms[chosen.name]:.2f}x pytorch float32"
    times = ", ".join(f"{name} {value:.1f}" for name, value in sorted(ms.items(), key=lambda item: item[1]))
    reason = (f"ms/image {times} ({source}): the fastest float32 candidate, or an int8 or bfloat16 one at least "
              f"{MARGIN}x faster than it{speedup}")
    opts = ("TEST.AMP.ENABLED", "True", "TEST.AMP.DTYPE", "bfloat16") if chosen.precision == "bfloat16" else (
        "TEST.AMP.ENABLED", "False")
    return BackendChoice(chosen.backend, chosen.model, chosen.precision, "; ".join([*skipped, reason]), opts)


def _fastest(candidates: Sequence[_Candidate], ms: Mapping[str, float]) -> _Candidate:
    """The fastest float32 candidate, or a faster low-precision one if it beats it by :data:`MARGIN`."""
    best_float = min((c for c in candidates if c.precision == "float32"), key=lambda c: ms[c.name])
    best = min(candidates, key=lambda c: ms[c.name])
    return best if ms[best_float.name] >= MARGIN * ms[best.name] else best_float


def _measured(cfg: CfgNode, candidates: Sequence[_Candidate], model: torch.nn.Module | None,
              cache: JsonCache) -> tuple[dict[str, float], str]:
    """Milliseconds per image of each candidate (by name), from ``cache`` or measured and stored; and where they
    came from, for the log."""
    weights = default_weights(cfg)
    files = {c.name: file_sha256(c.model or weights) for c in candidates}
    batch_size = cfg.TEST.IMS_PER_BATCH
    record = {"machine": machine_fingerprint(), "files": files, "model": cfg.MODEL.dump(), "input": cfg.INPUT.dump(),
              "test_batch": batch_size}
    key = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:32]
    # One process measures at a time (the ranks of a distributed test_net start together): the others wait for its
    # timings instead of competing with it for the cores, and all make the same choice.
    try:
        os.makedirs(os.path.dirname(cache.path), exist_ok=True)
        lock = file_lock(f"{cache.path}.lock") if os.access(os.path.dirname(cache.path), os.W_OK) else None
    except OSError:  # a read-only home: measured unlocked, and JsonCache warns that it cannot keep the timings
        lock = None
    with lock or contextlib.nullcontext():
        entry = cache.get_entry(key)
        if entry is not None and set(entry.get("ms_per_image", {})) == set(files):
            return ({name: float(value) for name, value in entry["ms_per_image"].items()},
                    f"measured earlier on this machine, reused from {cache.path} (delete it to measure again)")
        timings, images = measure_candidates(cfg, candidates, model)
        ms = {name: timing.median_s * 1000 / images for name, timing in timings.items()}
        unsteady = [name for name, timing in timings.items() if not timing.spread <= MAX_SPREAD]
        cache.put_entry(key, {"ms_per_image": ms, "images": images, "unsteady": unsteady, **record})
    note = f" (unsteady: {', '.join(unsteady)}; were other processes busy? delete {cache.path} to measure again)"
    return ms, f"measured on this machine, a batch of {images}{note if unsteady else ''}"


def measure_candidates(cfg: CfgNode, candidates: Sequence[_Candidate],
                       model: torch.nn.Module | None = None) -> tuple[dict[str, Timing], int]:
    """Each candidate timed on one generated test batch (:func:`pet.data.synthetic.synthetic_batch`), in
    alternating rounds; returns the timings by name and the batch's number of images."""
    images, targets = synthetic_batch(cfg, training=False)
    pytorch = model if model is not None else build_test_model(cfg)
    pytorch.eval()
    steps: dict[str, Callable[[], object]] = {}
    for candidate in candidates:
        if candidate.backend == "pytorch":
            autocast = candidate.precision == "bfloat16"

            def step(autocast: bool = autocast) -> object:
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    return call_model(pytorch, (images, targets))
        else:
            runtime = EXPORT_RUNTIMES[candidate.backend].model(candidate.model, threads=torch.get_num_threads())

            def step(runtime: ExportedModel = runtime) -> object:
                return runtime(images, targets)
        steps[candidate.name] = step
    logger.info(f"--backend auto: timing {', '.join(steps)} on a batch of {len(targets)} test images of "
                f"{tuple(images.shape[-2:])} px")
    return time_alternating(steps), len(targets)


def resolve_backend(cfg_file: str, opts: list[str], backend: str, model: str) -> BackendChoice | None:
    """A tool's ``--backend`` and ``--model`` checked (one line naming the mistake otherwise); for ``auto``, the
    choice for the config ``cfg_file`` with ``opts``, else None (the tool runs what was asked)."""
    runtime = EXPORT_RUNTIMES.get(backend)
    if model and runtime is None:
        raise ConfigError(f"--model names the exported file of --backend {' or '.join(EXPORT_RUNTIMES)}; --backend "
                          f"{backend} takes the PyTorch weights from TEST.WEIGHTS" +
                          (" and finds the exports in CKPT itself." if backend == "auto" else "."))
    if runtime is not None and not model:
        raise ConfigError(f"--backend {backend} needs --model FILE, {runtime.files}.")
    if backend != "auto":
        return None
    cfg = load_cfg(cfg_file, opts)
    passed_over: list[str] = []
    return choose_backend(cfg, exported_models(cfg, passed_over), passed_over)
