"""D-FINE's decoder: RT-DETR's query selection and denoising, then layers that refine each box's edge
distributions around one fixed anchor (fine-grained distribution refinement, :mod:`pet.modeling.dfine.distribution`).

Layer 0 first predicts a box from its query selection's reference (the "pre" box head); that box, detached, is the
anchor every layer's distributions are read against. Layer i's box head adds its logits to layer i - 1's (the sum
is not detached, so later layers train earlier ones' distributions; the features fed to it are
``h_i + h_{i-1}.detach()``). The deformable attention of the next layer samples around the latest box.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pet.modeling.dfine.distribution import LocationQuality, distances_to_boxes, expected_distances, weighting_function
from pet.modeling.rtdetr.deformable import MSDeformableAttention
from pet.modeling.rtdetr.layers import MLP, ConvNorm, FeedForward, SelfAttention, inverse_sigmoid
from pet.modeling.rtdetr.queries import ContrastiveDenoising, QuerySelection, decoder_inputs

__all__ = ["DFineDecoder", "DFineDecoderLayer", "Gate", "RMSNorm", "SwiGLU"]


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learnt scale and no bias (DEIMv2's), computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class SwiGLU(nn.Module):
    """DEIMv2's feed-forward block: ``down(SiLU(gate(x)) * up(x))`` with ``hidden_dim`` inner channels."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim)
        self.up_proj = nn.Linear(dim, hidden_dim)
        self.down_proj = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# Decoder layer normalisations by name: D-FINE's LayerNorm, DEIMv2's RMSNorm.
NORMS = {"layer": nn.LayerNorm, "rms": RMSNorm}


class Gate(nn.Module):
    """D-FINE's gateway in place of the cross-attention's residual sum: sigmoid gates, computed from both, weight
    the residual and the attention output before the normalisation."""

    def __init__(self, dim: int, norm: str = "layer") -> None:
        super().__init__()
        self.gate = nn.Linear(2 * dim, 2 * dim)
        self.norm = NORMS[norm](dim)

    def forward(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        g1, g2 = torch.sigmoid(self.gate(torch.cat([residual, x], dim=-1))).chunk(2, dim=-1)
        return self.norm(g1 * residual + g2 * x)


class DFineDecoderLayer(nn.Module):
    """Post-norm: self-attention, deformable cross-attention (no value or output projection, points per level)
    through the :class:`Gate` (or, ``gateway=False``, a residual sum and ``norm2``), FFN.

    D-FINE's: LayerNorms and a ReLU FFN; DEIMv2's: RMSNorms (``norm="rms"``) and a SwiGLU FFN of ``ffn_dim // 2``
    inner channels (``ffn="swiglu"``)."""

    def __init__(self, dim: int, num_heads: int, ffn_dim: int, points: Sequence[int], offset_scale: float, *,
                 norm: str = "layer", ffn: str = "relu", gateway: bool = True) -> None:
        super().__init__()
        self.self_attn = SelfAttention(dim, num_heads)
        self.norm1 = NORMS[norm](dim)
        self.cross_attn = MSDeformableAttention(dim, num_heads, len(points), points, offset_scale=offset_scale,
                                                projections=False)
        self.gate = Gate(dim, norm) if gateway else None
        self.norm2 = None if gateway else NORMS[norm](dim)
        self.ffn = SwiGLU(dim, ffn_dim // 2) if ffn == "swiglu" else FeedForward(dim, ffn_dim, ffn)
        self.norm3 = NORMS[norm](dim)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, reference: torch.Tensor, memory: torch.Tensor,
                shapes: list[tuple[int, int]], attn_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.norm1(x + self.self_attn(x, pos, attn_mask))
        attended = self.cross_attn(x + pos, reference, memory, shapes)
        x = self.gate(x, attended) if self.gate is not None else self.norm2(x + attended)
        # D-FINE clamps to float16's range before the last norm, for half-precision training (a no-op otherwise).
        return self.norm3((x + self.ffn(x)).clamp(-65504, 65504))


class DFineDecoder(nn.Module):
    """Encoder maps -> per decoder layer class logits ``[B, N, classes]`` (location quality added), boxes
    ``[B, N, 4]`` (cx, cy, w, h in [0, 1] of the padded input) and edge logits ``corners`` ``[B, N, 4 (bins + 1)]``,
    the boxes' fixed ``anchors``, layer 0's ``pre_logits`` / ``pre_boxes``, the selected candidates (``enc_logits``,
    ``enc_boxes``) and, when training with denoising, its queries' outputs first (``denoising`` says how many).
    At test time only the last layer's ``logits`` and ``boxes`` are returned."""

    def __init__(self, in_channels: int, dim: int, num_classes: int, *, num_queries: int, num_layers: int,
                 num_heads: int, ffn_dim: int, points: Sequence[int], offset_scale: float, num_bins: int,
                 reg_scale: float, up: float, lqe_topk: int, lqe_hidden_dim: int, lqe_layers: int,
                 denoising: ContrastiveDenoising, norm: str = "layer", ffn: str = "relu", gateway: bool = True,
                 query_pos_layers: int = 2, query_pos_activation: str = "relu", share_box_head: bool = False) -> None:
        super().__init__()
        self.num_bins = num_bins
        # The encoder's maps go in as they are when their width is the decoder's (every size but X).
        self.input_proj = nn.ModuleList(ConvNorm(in_channels, dim, 1) if in_channels != dim else nn.Identity()
                                        for _ in points)
        self.query_selection = QuerySelection(dim, num_classes, num_queries)
        self.denoising = denoising
        # D-FINE's: 2 ReLU layers through 2 * dim; DEIMv2's: 3 layers of dim.
        self.query_pos_head = MLP(4, 2 * dim if query_pos_layers == 2 else dim, dim, query_pos_layers,
                                  query_pos_activation)
        self.pre_box_head = MLP(dim, dim, 4, 3)
        self.layers = nn.ModuleList(DFineDecoderLayer(dim, num_heads, ffn_dim, points, offset_scale, norm=norm,
                                                      ffn=ffn, gateway=gateway) for _ in range(num_layers))
        self.class_heads = nn.ModuleList(nn.Linear(dim, num_classes) for _ in range(num_layers))
        if share_box_head:  # one head for every layer (DEIMv2's smallest models)
            self.box_heads = nn.ModuleList([MLP(dim, dim, 4 * (num_bins + 1), 3)] * num_layers)
        else:
            self.box_heads = nn.ModuleList(MLP(dim, dim, 4 * (num_bins + 1), 3) for _ in range(num_layers))
        self.lqe = nn.ModuleList(LocationQuality(num_bins, lqe_topk, lqe_hidden_dim, lqe_layers)
                                 for _ in range(num_layers))
        # Buffers rather than constants: checkpoints carry them (D-FINE-X's reg_scale is 8), and W follows them.
        self.register_buffer("reg_scale", torch.tensor([float(reg_scale)]))
        self.register_buffer("up", torch.tensor([float(up)]))
        self.reset_parameters(num_classes)

    def reset_parameters(self, num_classes: int) -> None:
        """Class biases at the prior 1 / (classes + 1); box heads starting from uniform distributions (distance 0:
        the anchor itself), location quality and gates neutral, as the reference."""
        bias = -math.log(num_classes)  # logit of 1 / (num_classes + 1)
        for head in [*self.class_heads, self.query_selection.score_head]:
            nn.init.xavier_uniform_(head.weight)
            nn.init.constant_(head.bias, bias)
        for head in [*self.box_heads, *(q.mlp for q in self.lqe)]:
            nn.init.zeros_(head.layers[-1].weight)
            nn.init.zeros_(head.layers[-1].bias)
        for layer in self.layers:
            if layer.gate is not None:
                nn.init.zeros_(layer.gate.gate.weight)
                nn.init.zeros_(layer.gate.gate.bias)
        nn.init.xavier_uniform_(self.denoising.label_embed.weight)

    def forward(self, features: list[torch.Tensor], targets: list[dict[str, torch.Tensor]] | None = None
                ) -> dict:
        memory, shapes, queries, reference, attn_mask, selected, denoising = decoder_inputs(
            [proj(f) for proj, f in zip(self.input_proj, features)], self.query_selection, self.denoising, targets)
        weights = weighting_function(self.num_bins, self.up, self.reg_scale)
        boxes = reference.sigmoid()
        out: dict = {"logits": [], "boxes": [], "corners": []}
        last = len(self.layers) - 1
        previous: torch.Tensor | float = 0.0
        corners: torch.Tensor | float = 0.0
        for i, layer in enumerate(self.layers):
            pos = self.query_pos_head(boxes).clamp(-10, 10)
            hidden = layer(queries, pos, boxes.unsqueeze(2), memory, shapes, attn_mask)
            if i == 0:
                pre_boxes = (self.pre_box_head(hidden) + inverse_sigmoid(boxes)).sigmoid()
                anchors = pre_boxes.detach()
            corners = self.box_heads[i](hidden + previous) + corners
            refined = distances_to_boxes(anchors, expected_distances(corners, weights), self.reg_scale)
            if self.training or i == last:  # at test time only the last layer's predictions are used
                logits = self.class_heads[i](hidden)
                if i == 0 and self.training:
                    out.update(pre_logits=logits, pre_boxes=pre_boxes)
                out["logits"].append(self.lqe[i](logits, corners))
                out["boxes"].append(refined)
                out["corners"].append(corners)
            boxes, previous, queries = refined.detach(), hidden.detach(), hidden
        out.update(anchors=anchors, enc_logits=selected["logits"], enc_boxes=selected["boxes"], denoising=denoising)
        return out
