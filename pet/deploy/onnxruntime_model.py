"""An exported Pet detector run by onnxruntime, behind the PyTorch model's interface.

:class:`OnnxRuntimeModel` is an ``nn.Module`` whose ``forward(images, targets)`` takes the test loader's
batches and returns what the PyTorch model returns in eval mode, per image ``{"boxes", "scores", "labels"}``
(and ``"masks"``, or ``"keypoints"`` and ``"keypoints_scores"``) in original-image pixels. So
``pet.engine.inference.inference_on_dataset``, the COCO evaluator, TestHook and any test callback use it
unchanged (``tools/test_net.py --backend onnxruntime``). What it shares with the other runtimes (the input checks,
the outputs split by image and mapped to the original images) is :class:`pet.deploy.exported_model.ExportedModel`.
"""
from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np

from pet.deploy.exported_model import ExportedModel, session_inputs
from pet.utils.errors import PetError

__all__ = ["OnnxRuntimeModel", "import_onnxruntime", "session_inputs"]

# How to install what pet.deploy needs beyond PyTorch (onnx, onnxruntime, onnxscript).
INSTALL_EXPORT_EXTRA = 'pip install -e ".[export]"'


def import_onnxruntime() -> ModuleType:
    """onnxruntime, from the optional ``export`` extra; without it, one line saying how to install it, so a tool
    can check before minutes of work (tools/export.py does, before exporting)."""
    try:
        import onnxruntime  # an optional extra ("export"): only a run on an ONNX model needs it
    except ImportError as exc:
        raise PetError(f"onnxruntime is not installed, and ONNX models run in it: {INSTALL_EXPORT_EXTRA}") from exc
    return onnxruntime


class OnnxRuntimeModel(ExportedModel):
    """An ONNX file written by :func:`pet.deploy.onnx.export_onnx`, run by an onnxruntime session (CPU by default).

    The graph computes everything up to the final detections in the network input's pixels; ``forward``
    then splits them by image and maps them to the original images with
    :func:`pet.modeling.postprocess.detections_to_original`, which scales and clips the boxes and pastes the
    masks' probabilities into their boxes, exactly as the PyTorch model ends its forward. It has no
    parameters: the engine then runs it on the CPU. It only infers: it starts in eval mode, and training mode
    is an error.

    ``threads``: onnxruntime's intra-op threads (0: its default, one per core). ``providers``: onnxruntime's
    execution providers in order of preference, names or ``(name, options)`` pairs (tools/benchmark.py gpu runs the
    parity gate with ``CUDAExecutionProvider``); onnxruntime falls back to the next one it can start, so a caller
    that needs a provider checks ``session.get_providers()``.
    """

    runtime = "onnxruntime"

    def __init__(self, path: str, threads: int = 0,
                 providers: Sequence[str | tuple[str, dict[str, str]]] = ("CPUExecutionProvider",)) -> None:
        onnxruntime = import_onnxruntime()
        super().__init__()
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        try:
            self.session = onnxruntime.InferenceSession(path, options, providers=list(providers))
        except Exception as exc:  # onnxruntime raises its own exception types for a missing or invalid file
            raise PetError(f"Cannot load the ONNX model {path}: {exc}") from exc
        self.path = path
        self.output_names = [output.name for output in self.session.get_outputs()]
        self.read_metadata(self.session.get_modelmeta().custom_metadata_map)

    def run_graph(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(None, inputs)
