"""Deprecated (removed in 0.4.0): a detector's export graph is part of the detector contract, in
:mod:`pet.modeling.export_graph` (``build_graph`` is ``build_export_graph``; each family registers its own)."""
import warnings

from pet.modeling.export_graph import *  # noqa: F401,F403
from pet.modeling.export_graph import build_export_graph as build_graph  # noqa: F401

warnings.warn("pet.deploy.graph is now pet.modeling.export_graph (build_graph: build_export_graph); the old path "
              "goes in Pet 0.4.0", DeprecationWarning, stacklevel=2)
