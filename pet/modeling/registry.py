"""The registries a model is assembled from; each is selected by a config key.

==========================  ==============================  ====================================
registry                    config key                      an entry is called as
==========================  ==============================  ====================================
``META_ARCH_REGISTRY``      ``MODEL.META_ARCHITECTURE``     ``Entry(cfg) -> nn.Module``
``BACKBONE_REGISTRY``       ``MODEL.BACKBONE.TYPE``         ``entry(cfg) -> nn.Module``
``ROI_BOX_HEAD_REGISTRY``   ``MODEL.ROI_BOX_HEAD.NAME``     ``Entry(cfg, in_channels) -> nn.Module``
==========================  ==============================  ====================================

A backbone returns an ordered dict of feature maps and has an ``out_channels``
attribute. A box head maps pooled RoI features ``[R, in_channels, S, S]`` (S =
``MODEL.ROI_BOX_HEAD.POOLER_RESOLUTION``) to ``[R, MODEL.ROI_BOX_HEAD.MLP_DIM]``.
Any entry may also be named in YAML by a dotted import path (``my_pkg.heads.MyHead``).
"""
from pet.utils.registry import META_ARCH_REGISTRY, Registry

__all__ = ["META_ARCH_REGISTRY", "BACKBONE_REGISTRY", "ROI_BOX_HEAD_REGISTRY"]

BACKBONE_REGISTRY = Registry("backbone")
ROI_BOX_HEAD_REGISTRY = Registry("RoI box head")
