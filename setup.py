"""Pet: a PyTorch toolbox for object detection and instance segmentation."""
from setuptools import find_packages, setup

setup(
    name="pet",
    version="0.1.0",
    description="Pytorch Efficient Toolbox for detection and instance segmentation",
    packages=find_packages(include=["pet", "pet.*"]),
    python_requires=">=3.10",
    install_requires=[
        # Ranges, not pins: torch 2.14.1 / torchvision 0.29.1 is the pair tested here. 2.4 is the
        # first torch with fused AdamW/SGD kernels on CPU (pet/engine/optim.py).
        "torch>=2.4,<=2.14.1",
        "torchvision>=0.19,<=0.29.1",
        "opencv-python-headless>=4.5",
        "pycocotools>=2.0.6",
        "fvcore>=0.1.5.post20221221",
        "tensorboard>=2.10",
        "matplotlib>=3.5",
        "numpy",
        "PyYAML",
    ],
    extras_require={"test": ["pytest>=7", "ruff"]},
)
