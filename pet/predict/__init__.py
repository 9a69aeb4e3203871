"""Predicting with a trained detector on pictures without annotations (tools/predict.py).

``from pet.predict import Predictor``: ``Predictor(cfg)(image)`` for one picture, ``.stream(source)`` for a
folder, a glob, a list, a video or a very large image by tiles; :class:`PredictionWriter` saves the
results in the formats of docs/predict.md.
"""
from pet.predict.predictor import PREDICT_DEFAULTS, Detections, Predictor, PredictStats, predict_cfg
from pet.predict.sources import Source
from pet.predict.tiling import TileSpec
from pet.predict.writers import FORMATS, PredictionWriter

__all__ = ["PREDICT_DEFAULTS", "Detections", "FORMATS", "Predictor", "PredictStats", "PredictionWriter", "Source",
           "TileSpec", "predict_cfg"]
