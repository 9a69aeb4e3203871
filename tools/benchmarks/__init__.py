"""The benchmarks behind tools/benchmark.py, one module per subcommand; common.py holds what they share.

tools/benchmark.py imports this package as ``benchmarks`` (Python puts the script's folder, tools/, on the path);
from the repository root it is ``tools.benchmarks`` (the tests: pytest.ini's ``pythonpath``). The modules import
each other relatively, so either works; optional references (detectron2, ultralytics, sahi, transformers, mmengine)
are imported only inside the subcommand that needs them.
"""
from . import (
    augmentations,
    cascade_vs_detectron2,
    coco_eval,
    common,
    data,
    detectors,
    engine,
    gpu,
    low_data,
    onnx,
    predict,
    resume_skip,
    roofline,
    rtdetr,
    strict_iou_ap,
    tiles,
    ultralytics_rtdetr,
)

__all__ = ["augmentations", "cascade_vs_detectron2", "coco_eval", "common", "data", "detectors", "engine", "gpu",
           "low_data", "onnx", "predict", "resume_skip", "roofline", "rtdetr", "strict_iou_ap", "tiles",
           "ultralytics_rtdetr"]
