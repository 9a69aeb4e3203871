"""RT-DETR's decoder: the encoder's maps flattened, query selection, then layers of self-attention, deformable
cross-attention and FFN, each refining the boxes of the previous one (iterative box refinement)."""
from __future__ import annotations

import math

import torch
from torch import nn

from pet.modeling.rtdetr.deformable import MSDeformableAttention
from pet.modeling.rtdetr.layers import MLP, ConvNorm, FeedForward, SelfAttention, inverse_sigmoid
from pet.modeling.rtdetr.queries import ContrastiveDenoising, QuerySelection, decoder_inputs

__all__ = ["DecoderLayer", "RTDETRDecoder"]


class DecoderLayer(nn.Module):
    """Post-norm: self-attention among the queries, deformable attention to the memory, ReLU FFN."""

    def __init__(self, dim: int, num_heads: int, ffn_dim: int, num_levels: int, num_points: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(dim, num_heads)
        self.norm1 = nn.LayerNorm(dim)
        self.cross_attn = MSDeformableAttention(dim, num_heads, num_levels, num_points)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = FeedForward(dim, ffn_dim, "relu")
        self.norm3 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, reference: torch.Tensor, memory: torch.Tensor,
                shapes: list[tuple[int, int]], attn_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.norm1(x + self.self_attn(x, pos, attn_mask))
        x = self.norm2(x + self.cross_attn(x + pos, reference, memory, shapes))
        return self.norm3(x + self.ffn(x))


class RTDETRDecoder(nn.Module):
    """Encoder maps -> per decoder layer class logits ``[B, N, classes]`` and boxes ``[B, N, 4]`` (cx, cy, w, h
    in [0, 1] of the padded input), plus the selected candidates (``enc_logits``, ``enc_boxes``) and, when
    training with denoising, its queries' outputs first (``denoising`` says how many)."""

    def __init__(self, in_channels: int, dim: int, num_classes: int, *, num_queries: int, num_layers: int,
                 num_heads: int, ffn_dim: int, num_levels: int, num_points: int,
                 denoising: ContrastiveDenoising) -> None:
        super().__init__()
        self.input_proj = nn.ModuleList(ConvNorm(in_channels, dim, 1) for _ in range(num_levels))
        self.query_selection = QuerySelection(dim, num_classes, num_queries)
        self.denoising = denoising
        self.query_pos_head = MLP(4, 2 * dim, dim, 2)
        self.layers = nn.ModuleList(DecoderLayer(dim, num_heads, ffn_dim, num_levels, num_points)
                                    for _ in range(num_layers))
        self.class_heads = nn.ModuleList(nn.Linear(dim, num_classes) for _ in range(num_layers))
        self.box_heads = nn.ModuleList(MLP(dim, dim, 4, 3) for _ in range(num_layers))
        self.reset_parameters(num_classes)

    def reset_parameters(self, num_classes: int) -> None:
        """Class biases at the prior 1 / (classes + 1) and box heads starting at their reference, as the reference."""
        bias = -math.log(num_classes)  # logit of 1 / (num_classes + 1)
        for head in [*self.class_heads, self.query_selection.score_head]:
            nn.init.xavier_uniform_(head.weight)
            nn.init.constant_(head.bias, bias)
        for head in self.box_heads:
            nn.init.zeros_(head.layers[-1].weight)
            nn.init.zeros_(head.layers[-1].bias)
        nn.init.xavier_uniform_(self.denoising.label_embed.weight)

    def forward(self, features: list[torch.Tensor], targets: list[dict[str, torch.Tensor]] | None = None
                ) -> dict:
        memory, shapes, queries, reference, attn_mask, selected, denoising = decoder_inputs(
            [proj(f) for proj, f in zip(self.input_proj, features)], self.query_selection, self.denoising, targets)
        boxes = reference.sigmoid()
        all_logits, all_boxes = [], []
        last = len(self.layers) - 1
        for i, (layer, class_head, box_head) in enumerate(zip(self.layers, self.class_heads, self.box_heads)):
            queries = layer(queries, self.query_pos_head(boxes), boxes.unsqueeze(2), memory, shapes, attn_mask)
            refined = (box_head(queries) + inverse_sigmoid(boxes)).sigmoid()
            if self.training or i == last:  # at test time only the last layer's predictions are used
                all_logits.append(class_head(queries))
                all_boxes.append(refined)
            boxes = refined.detach()
        return {"logits": all_logits, "boxes": all_boxes, "enc_logits": selected["logits"],
                "enc_boxes": selected["boxes"], "denoising": denoising}
