"""transformers' RT-DETR ``state_dict`` names -> Pet's: the one table, and the loader that applies it.

``RTDetrForObjectDetection.state_dict()`` and the hub's ``PekingU/rtdetr_*`` checkpoints (``model.safetensors``, which
names a few tensors as transformers' files do, :data:`FILE_TO_MODULE_NAMES`) load into
:class:`pet.modeling.rtdetr.RTDETR` through :func:`convert_transformers_state_dict`, which
``pet.checkpoint.load_weights`` calls through ``RTDETR.convert_state_dict`` whenever the file holds transformers'
names. Each rule is a regular expression on the full key, applied in order, first match wins:

=============================================================  ==============================================
transformers                                                   Pet
=============================================================  ==============================================
``model.backbone.model.embedder.embedder.{i}.convolution``     ``backbone.stem.{i}.conv`` (``normalization``: ``norm``)
``...encoder.stages.{s}.layers.{b}.layer.{k}.convolution``     ``backbone.stages.{s}.{b}.convs.{k}.conv``
``...layers.{b}.shortcut[.1].convolution``                     ``backbone.stages.{s}.{b}.shortcut.proj.conv``
``model.encoder_input_proj.{i}.0`` / ``.1``                    ``encoder.input_proj.{i}.conv`` / ``.norm``
``model.encoder.aifi.0.layers.{j}``                            ``encoder.aifi.{j}``
``self_attn_layer_norm`` / ``final_layer_norm`` (encoder)      ``norm1`` / ``norm2``
``mlp.fc1`` / ``mlp.fc2``                                      ``ffn.fc1`` / ``ffn.fc2``
``model.encoder.{fpn,pan}_blocks.{i}.bottlenecks.{j}``         ``encoder.{fpn,pan}_blocks.{i}.blocks.{j}``
``model.encoder.*`` (lateral, downsample convs, blocks)        ``encoder.*``
``model.decoder_input_proj.{i}.0`` / ``.1``                    ``decoder.input_proj.{i}.conv`` / ``.norm``
``model.enc_output.0`` / ``.1``                                ``decoder.query_selection.proj`` / ``.norm``
``model.enc_score_head`` / ``model.enc_bbox_head``             ``decoder.query_selection.score_head`` / ``.box_head``
``model.denoising_class_embed``                                ``decoder.denoising.label_embed``
``model.decoder.layers.{l}.encoder_attn``                      ``decoder.layers.{l}.cross_attn``
``self_attn_layer_norm`` / ``encoder_attn_layer_norm`` /       ``norm1`` / ``norm2`` / ``norm3``
``final_layer_norm`` (decoder)
``model.decoder.class_embed.{l}`` / ``bbox_embed.{l}``         ``decoder.class_heads.{l}`` / ``box_heads.{l}``
``model.decoder.query_pos_head``                               ``decoder.query_pos_head``
=============================================================  ==============================================

Class ``c`` of transformers' heads (0-based) is Pet's label ``c + 1``.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

__all__ = ["TRANSFORMERS_TO_PET", "FILE_TO_MODULE_NAMES", "convert_transformers_state_dict",
           "is_transformers_state_dict", "module_names", "renamed", "file_to_module_names", "QUERY_RULES"]

_BACKBONE = r"model\.backbone\.model\."
_STAGE = _BACKBONE + r"encoder\.stages\.(\d+)\.layers\.(\d+)\."
# The decoder's input projections, query selection and denoising embedding: RT-DETR's names and D-FINE's alike.
QUERY_RULES: list[tuple[str, str]] = [
    (r"model\.decoder_input_proj\.(\d+)\.0\.", r"decoder.input_proj.\1.conv."),
    (r"model\.decoder_input_proj\.(\d+)\.1\.", r"decoder.input_proj.\1.norm."),
    (r"model\.enc_output\.0\.", r"decoder.query_selection.proj."),
    (r"model\.enc_output\.1\.", r"decoder.query_selection.norm."),
    (r"model\.enc_score_head\.", r"decoder.query_selection.score_head."),
    (r"model\.enc_bbox_head\.", r"decoder.query_selection.box_head."),
    (r"model\.denoising_class_embed\.", r"decoder.denoising.label_embed."),
]
# (pattern, replacement): the documented table above, in order.
TRANSFORMERS_TO_PET: list[tuple[str, str]] = [
    (_BACKBONE + r"embedder\.embedder\.(\d+)\.convolution\.", r"backbone.stem.\1.conv."),
    (_BACKBONE + r"embedder\.embedder\.(\d+)\.normalization\.", r"backbone.stem.\1.norm."),
    (_STAGE + r"layer\.(\d+)\.convolution\.", r"backbone.stages.\1.\2.convs.\3.conv."),
    (_STAGE + r"layer\.(\d+)\.normalization\.", r"backbone.stages.\1.\2.convs.\3.norm."),
    (_STAGE + r"shortcut\.(?:1\.)?convolution\.", r"backbone.stages.\1.\2.shortcut.proj.conv."),
    (_STAGE + r"shortcut\.(?:1\.)?normalization\.", r"backbone.stages.\1.\2.shortcut.proj.norm."),
    (r"model\.encoder_input_proj\.(\d+)\.0\.", r"encoder.input_proj.\1.conv."),
    (r"model\.encoder_input_proj\.(\d+)\.1\.", r"encoder.input_proj.\1.norm."),
    (r"model\.encoder\.aifi\.0\.layers\.(\d+)\.self_attn_layer_norm\.", r"encoder.aifi.\1.norm1."),
    (r"model\.encoder\.aifi\.0\.layers\.(\d+)\.final_layer_norm\.", r"encoder.aifi.\1.norm2."),
    (r"model\.encoder\.aifi\.0\.layers\.(\d+)\.mlp\.", r"encoder.aifi.\1.ffn."),
    (r"model\.encoder\.aifi\.0\.layers\.(\d+)\.", r"encoder.aifi.\1."),
    (r"model\.encoder\.(fpn|pan)_blocks\.(\d+)\.bottlenecks\.", r"encoder.\1_blocks.\2.blocks."),
    (r"model\.encoder\.", r"encoder."),
    *QUERY_RULES,
    (r"model\.decoder\.layers\.(\d+)\.encoder_attn_layer_norm\.", r"decoder.layers.\1.norm2."),
    (r"model\.decoder\.layers\.(\d+)\.encoder_attn\.", r"decoder.layers.\1.cross_attn."),
    (r"model\.decoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"decoder.layers.\1.norm1."),
    (r"model\.decoder\.layers\.(\d+)\.final_layer_norm\.", r"decoder.layers.\1.norm3."),
    (r"model\.decoder\.layers\.(\d+)\.mlp\.", r"decoder.layers.\1.ffn."),
    (r"model\.decoder\.layers\.", r"decoder.layers."),
    (r"model\.decoder\.class_embed\.", r"decoder.class_heads."),
    (r"model\.decoder\.bbox_embed\.", r"decoder.box_heads."),
    (r"model\.decoder\.query_pos_head\.", r"decoder.query_pos_head."),
]
_RULES = [(re.compile(pattern), replacement) for pattern, replacement in TRANSFORMERS_TO_PET]


def file_to_module_names(fc1: str, fc2: str) -> list[tuple[str, str]]:
    """The names in transformers' DETR files (the hub's model.safetensors, save_pretrained) -> its modules' names:
    the renames it makes as it loads (its conversion_mapping.py), the FFN's two layers being named ``fc1`` / ``fc2``
    in the modules of this model."""
    return [(r"\.out_proj\.", ".o_proj."), (r"\.layers\.(\d+)\.fc1\.", rf".layers.\1.{fc1}."),
            (r"\.layers\.(\d+)\.fc2\.", rf".layers.\1.{fc2}."),
            (r"^model\.encoder\.encoder\.(\d+)\.layers\.", r"model.encoder.aifi.\1.layers.")]


# RT-DETR's, which the table above takes after them (conversion_mapping.py's "rt_detr").
FILE_TO_MODULE_NAMES = file_to_module_names("mlp.fc1", "mlp.fc2")


def module_names(state: Mapping[str, torch.Tensor], renames: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """``state`` with each key's every match of each ``(pattern, replacement)`` of ``renames`` replaced, in order."""
    rules = [(re.compile(pattern), replacement) for pattern, replacement in renames]
    out = {}
    for key, value in state.items():
        for pattern, replacement in rules:
            key = pattern.sub(replacement, key)
        out[key] = value
    return out


def renamed(key: str, rules: list[tuple[re.Pattern, str]]) -> str:
    """``key`` with its start rewritten by the first rule whose pattern matches there; unchanged when none does."""
    for pattern, replacement in rules:
        match = pattern.match(key)
        if match:
            return match.expand(replacement) + key[match.end():]
    return key


def is_transformers_state_dict(state: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``state`` has transformers' RT-DETR names (its backbone's stem is there)."""
    return any(k.startswith("model.backbone.model.embedder.") for k in state)


def convert_transformers_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a model's ``state_dict()`` or a file's, :data:`FILE_TO_MODULE_NAMES`) with every key renamed by
    :data:`TRANSFORMERS_TO_PET`; keys no rule matches are kept as they are (the loader then reports them as
    unexpected, naming them)."""
    return {renamed(key, _RULES): value for key, value in module_names(state, FILE_TO_MODULE_NAMES).items()}
