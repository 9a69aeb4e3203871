"""Pet: Pytorch Efficient Toolbox for object detection and instance segmentation."""
import warnings

# fvcore.nn scripts its focal loss with torch.jit at import time, which recent torch
# deprecates with a FutureWarning on every run; it says nothing about Pet's code.
warnings.filterwarnings("ignore", message=r"`torch.jit.script` is deprecated", category=FutureWarning)

# The release (CHANGELOG.md); setup.py reads it from here.
__version__ = "0.2.0"
