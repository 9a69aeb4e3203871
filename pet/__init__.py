"""Pet: Pytorch Efficient Toolbox for object detection and instance segmentation."""
import warnings

# fvcore.nn scripts its focal loss with torch.jit at import time, which recent torch
# deprecates with a FutureWarning on every run; it says nothing about Pet's code.
warnings.filterwarnings("ignore", message=r"`torch.jit.script` is deprecated", category=FutureWarning)

# The release (CHANGELOG.md); setup.py reads it from here.
__version__ = "0.2.0"

# The one place the layers are wired (docs/design.md): the engine never imports the models or the
# evaluators, so the package hands it their builders, before any module can build a Trainer or run a test.
# Below the filter above, which must precede fvcore's import.
from pet import evaluation, modeling  # noqa: E402
from pet.engine.models import register_default_builders  # noqa: E402

register_default_builders(model=modeling.build_model, evaluator=evaluation.build_evaluator)
