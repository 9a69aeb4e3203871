"""Pet: Pytorch Efficient Toolbox for object detection and instance segmentation."""

__version__ = "0.1.0"
