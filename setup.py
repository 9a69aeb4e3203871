"""Pet: a PyTorch toolbox for object detection and instance segmentation."""
import os
import re

from setuptools import find_packages, setup

# The version lives in pet/__init__.py (read as text: importing pet would need its dependencies).
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pet", "__init__.py"), encoding="utf-8") as f:
    _VERSION = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)

# Optional features stay out of the base install; "test" pulls them all in so the suite
# exercises them for real (offline W&B, a local MLflow store, onnxruntime and OpenVINO on CPU).
_OPTIONAL = {
    "wandb": ["wandb>=0.31,<1"],
    "mlflow": ["mlflow-skinny>=3.17,<4", "sqlalchemy>=1.4,<3", "alembic>=1.8,!=1.10.0,<2"],
    "fast-eval": ["faster-coco-eval>=1.8"],
    # onnxruntime 1.32: int8 quantization (tools/export.py --int8) caches its calibration (calibration_cache_path),
    # so each choice of what runs int8 is quantized without running the float model again.
    "export": ["onnx>=1.16", "onnxscript>=0.2", "onnxruntime>=1.32"],
    # OpenVINO, a second CPU runtime for the same ONNX export (--backend openvino, tools/export.py --openvino): an
    # extra of its own, as only a deployment on it needs it. Pet reads the export's metadata (score threshold, label
    # space) from where OpenVINO's ONNX frontend keeps it, the model's rt_info, which 2026.4 was checked to carry
    # through save_model into the IR. NNCF: OpenVINO's own post-training int8 quantization (tools/export.py --openvino
    # --int8); 3.4 quantizes OpenVINO 2026.4's models and takes an ignored scope by operation names, which keeps
    # the parts Pet leaves in float32 out of it.
    "openvino": ["openvino>=2026.4", "nncf>=3.4"],
    # safetensors: the Hugging Face hub's weights format (model.safetensors, tensors only, nothing to unpickle), in
    # which transformers' RT-DETR and D-FINE checkpoints ship; TEST.WEIGHTS may name such a file or its directory.
    "hub": ["safetensors>=0.4"],
}
_EXTRAS = {
    **_OPTIONAL,
    # pytest-xdist: tests run one thread each, so one worker per core (pytest.ini) halves the suite on 2 cores.
    # transformers: the reference RT-DETR (RTDetrForObjectDetection, RTDetrImageProcessor) that
    # tests/modeling/test_rtdetr_parity.py compares Pet's modules with; 5.x lays out RT-DETR's sine position embedding
    # as the parity tests expect on non-square maps.
    "test": ["pytest>=7", "pytest-xdist>=3.5", "ruff", "transformers>=5,<6"]
    + [req for reqs in _OPTIONAL.values() for req in reqs],
}

setup(
    name="pet",
    version=_VERSION,
    description="Pytorch Efficient Toolbox for detection and instance segmentation",
    packages=find_packages(include=["pet", "pet.*"]),
    python_requires=">=3.10",
    install_requires=[
        # Ranges, not pins: torch 2.14.1 / torchvision 0.29.1 is the pair tested here. 2.4 is the
        # first torch with fused AdamW/SGD kernels on CPU (pet/engine/optim.py).
        "torch>=2.4,<=2.14.1",
        "torchvision>=0.19,<=0.29.1",
        "opencv-python-headless>=4.5",
        # Image sizes from file headers (YOLO and CSV labels have none), without decoding pixels; torchvision
        # installs it already, this names the dependency Pet uses directly.
        "Pillow>=9.1",
        "pycocotools>=2.0.6",
        "fvcore>=0.1.5.post20221221",
        "tensorboard>=2.10",
        "matplotlib>=3.5",
        "numpy",
        "PyYAML",
        # tools/predict.py's progress bar (rate, ETA; off when stderr is not a terminal).
        "tqdm>=4.61",
        # RT-DETR's Hungarian matcher (scipy.optimize.linear_sum_assignment) at every training step.
        "scipy>=1.7",
    ],
    extras_require=_EXTRAS,
)
