"""D-FINE and DEIMv2: Pet's own modules (HGNetv2 backbone, D-FINE's and DEIMv2's hybrid encoders, the distribution
decoder, their losses).

See :mod:`pet.modeling.dfine.detector` (D-FINE) and :mod:`pet.modeling.dfine.deimv2` (DEIMv2) for the models and
:mod:`pet.modeling.dfine.weights` for loading transformers' weights. A config names the detector by its path,
``MODEL.META_ARCHITECTURE: pet.modeling.dfine.DFINE`` (or ``DEIMV2``), which makes ``pet.config`` call
:func:`add_config` (their ``MODEL.DFINE`` keys).
"""
from pet.modeling.dfine.config import add_config
from pet.modeling.dfine.deimv2 import DEIMV2
from pet.modeling.dfine.detector import DFINE

__all__ = ["DFINE", "DEIMV2", "add_config"]
