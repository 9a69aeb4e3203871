"""D-FINE: Pet's own modules (HGNetv2 backbone, D-FINE's hybrid encoder, the distribution decoder, its losses).

See :mod:`pet.modeling.dfine.detector` for the model and :mod:`pet.modeling.dfine.weights` for loading
transformers' weights. A config names the detector by its path, ``MODEL.META_ARCHITECTURE:
pet.modeling.dfine.DFINE``, which makes ``pet.config`` call :func:`add_config` (its ``MODEL.DFINE`` keys).
"""
from pet.modeling.dfine.config import add_config
from pet.modeling.dfine.detector import DFINE

__all__ = ["DFINE", "add_config"]
