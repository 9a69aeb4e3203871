"""transformers' D-FINE ``state_dict`` names -> Pet's: the one table, and the loader that applies it.

``DFineForObjectDetection.state_dict()`` and the hub's ``ustc-community/dfine-*`` checkpoints (``model.safetensors``,
which names a few tensors as transformers' files do, :data:`FILE_TO_MODULE_NAMES`) load into
:class:`pet.modeling.dfine.DFINE` through :func:`convert_transformers_state_dict`, which ``pet.checkpoint.load_weights``
calls through ``DFINE.convert_state_dict`` whenever the file holds transformers' names. The backbone's keys
(``model.backbone.model.*``) go through HGNetv2's own table
(:func:`pet.modeling.hgnetv2.hgnetv2_state_dict_from_transformers`); every other key through the rules below, regular
expressions on the full key applied in order, first match wins:

=============================================================  ==============================================
transformers                                                   Pet
=============================================================  ==============================================
``model.encoder_input_proj.{i}.0`` / ``.1``                    ``encoder.input_proj.{i}.conv`` / ``.norm``
``model.encoder.aifi.0.layers.{j}``                            ``encoder.aifi.{j}``
``self_attn_layer_norm`` / ``final_layer_norm`` (encoder)      ``norm1`` / ``norm2``
``mlp.layers.0`` / ``mlp.layers.1`` (encoder)                  ``ffn.fc1`` / ``ffn.fc2``
``...csp_rep{1,2}.bottlenecks.{j}``                            ``...csp_rep{1,2}.blocks.{j}``
``model.encoder.*`` (lateral, downsample convs, blocks)        ``encoder.*``
``model.decoder_input_proj.{i}.0`` / ``.1`` (D-FINE-X)         ``decoder.input_proj.{i}.conv`` / ``.norm``
``model.enc_output.0`` / ``.1``                                ``decoder.query_selection.proj`` / ``.norm``
``model.enc_score_head`` / ``model.enc_bbox_head``             ``decoder.query_selection.score_head`` / ``.box_head``
``model.denoising_class_embed``                                ``decoder.denoising.label_embed``
``model.decoder.layers.{l}.encoder_attn``                      ``decoder.layers.{l}.cross_attn``
``model.decoder.layers.{l}.gateway``                           ``decoder.layers.{l}.gate``
``self_attn_layer_norm`` / ``final_layer_norm`` (decoder)      ``norm1`` / ``norm3``
``mlp.layers.0`` / ``mlp.layers.1`` (decoder)                  ``ffn.fc1`` / ``ffn.fc2``
``model.decoder.class_embed.{l}`` / ``bbox_embed.{l}``         ``decoder.class_heads.{l}`` / ``box_heads.{l}``
``model.decoder.lqe_layers.{l}.reg_conf``                      ``decoder.lqe.{l}.mlp``
``model.decoder.pre_bbox_head``                                ``decoder.pre_box_head``
``model.decoder.query_pos_head``, ``reg_scale``, ``up``        ``decoder.query_pos_head``, ``reg_scale``, ``up``
``class_embed.{l}`` / ``bbox_embed.{l}`` (top level)           the decoder's heads (transformers ties the two names
                                                               to one tensor; a file may hold either or both)
=============================================================  ==============================================

Class ``c`` of transformers' heads (0-based) is Pet's label ``c + 1``.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from pet.modeling.hgnetv2 import hgnetv2_state_dict_from_transformers
from pet.modeling.rtdetr.weights import QUERY_RULES, file_to_module_names, module_names, renamed

__all__ = ["TRANSFORMERS_TO_PET", "convert_transformers_state_dict", "is_transformers_state_dict"]

_BACKBONE = "model.backbone.model."
_AIFI = r"model\.encoder\.aifi\.0\.layers\.(\d+)\."
_LAYER = r"model\.decoder\.layers\.(\d+)\."
# (pattern, replacement): the documented table above, in order.
TRANSFORMERS_TO_PET: list[tuple[str, str]] = [
    (r"model\.encoder_input_proj\.(\d+)\.0\.", r"encoder.input_proj.\1.conv."),
    (r"model\.encoder_input_proj\.(\d+)\.1\.", r"encoder.input_proj.\1.norm."),
    (_AIFI + r"self_attn_layer_norm\.", r"encoder.aifi.\1.norm1."),
    (_AIFI + r"final_layer_norm\.", r"encoder.aifi.\1.norm2."),
    (_AIFI + r"mlp\.layers\.0\.", r"encoder.aifi.\1.ffn.fc1."),
    (_AIFI + r"mlp\.layers\.1\.", r"encoder.aifi.\1.ffn.fc2."),
    (_AIFI, r"encoder.aifi.\1."),
    (r"model\.encoder\.(fpn|pan)_blocks\.(\d+)\.csp_rep([12])\.bottlenecks\.",
     r"encoder.\1_blocks.\2.csp_rep\3.blocks."),
    (r"model\.encoder\.", r"encoder."),
    *QUERY_RULES,
    (_LAYER + r"encoder_attn\.", r"decoder.layers.\1.cross_attn."),
    (_LAYER + r"gateway\.", r"decoder.layers.\1.gate."),
    (_LAYER + r"self_attn_layer_norm\.", r"decoder.layers.\1.norm1."),
    (_LAYER + r"final_layer_norm\.", r"decoder.layers.\1.norm3."),
    (_LAYER + r"mlp\.layers\.0\.", r"decoder.layers.\1.ffn.fc1."),
    (_LAYER + r"mlp\.layers\.1\.", r"decoder.layers.\1.ffn.fc2."),
    (_LAYER, r"decoder.layers.\1."),
    (r"model\.decoder\.class_embed\.", r"decoder.class_heads."),
    (r"model\.decoder\.bbox_embed\.", r"decoder.box_heads."),
    (r"model\.decoder\.lqe_layers\.(\d+)\.reg_conf\.", r"decoder.lqe.\1.mlp."),
    (r"model\.decoder\.pre_bbox_head\.", r"decoder.pre_box_head."),
    (r"model\.decoder\.", r"decoder."),
    (r"class_embed\.", r"decoder.class_heads."),
    (r"bbox_embed\.", r"decoder.box_heads."),
]
_RULES = [(re.compile(pattern), replacement) for pattern, replacement in TRANSFORMERS_TO_PET]
# The names in transformers' files -> its modules' names, which the table above takes after them
# (conversion_mapping.py's "d_fine").
FILE_TO_MODULE_NAMES = file_to_module_names("mlp.layers.0", "mlp.layers.1")


def is_transformers_state_dict(state: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``state`` has transformers' D-FINE names (its HGNetv2 backbone's stem is there)."""
    return any(k.startswith(_BACKBONE + "embedder.") for k in state)


def convert_transformers_state_dict(state: Mapping[str, torch.Tensor], *, backbone_prefix: str = _BACKBONE,
                                    rules: list[tuple[re.Pattern, str]] = _RULES) -> dict[str, torch.Tensor]:
    """``state`` (a model's ``state_dict()`` or a file's, :data:`FILE_TO_MODULE_NAMES`) under Pet's names. The
    backbone's keys (under ``backbone_prefix``) must all map (else a ConfigError names them); other keys go through
    ``rules`` (DEIMv2 passes its own), and those no rule matches are kept as they are, for the loader to report as
    unexpected. A top-level head that is also in the file under the decoder's name is dropped: the decoder's copy is
    the one transformers' forward uses."""
    state = module_names(state, FILE_TO_MODULE_NAMES)
    backbone = {k[len(backbone_prefix):]: v for k, v in state.items() if k.startswith(backbone_prefix)}
    out = {f"backbone.{k}": v for k, v in hgnetv2_state_dict_from_transformers(backbone).items()}
    for key, value in state.items():
        tied_copy = key.startswith(("class_embed.", "bbox_embed.")) and f"model.decoder.{key}" in state
        if not key.startswith(backbone_prefix) and not tied_copy:
            out[renamed(key, rules)] = value
    return out
