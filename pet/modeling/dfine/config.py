"""D-FINE's (and DEIMv2's) config keys, ``MODEL.DFINE``: added by :func:`add_config` when a config names the
detector by its path (``MODEL.META_ARCHITECTURE: pet.modeling.dfine.DFINE`` or ``pet.modeling.dfine.DEIMV2``), as any
plugin detector's keys are (``pet.config``).

The defaults are D-FINE-L's (transformers' ``DFineConfig()`` with the published L checkpoint's sampling points);
``cfgs/coco/dfine_hgnetv2_{N,S,M,L,X}.yaml`` set what each size changes.
"""
from __future__ import annotations

from fvcore.common.config import CfgNode

__all__ = ["add_config"]


def add_config(cfg: CfgNode) -> None:
    """Add ``MODEL.DFINE`` with D-FINE-L's values to ``cfg`` (unfrozen)."""
    node = cfg.MODEL.DFINE = CfgNode()
    # Hybrid encoder: channels, backbone levels used (the last NUM_LEVELS of the backbone's; N uses 2), AIFI layers
    # on the coarsest level with their heads and FFN width, and the fusion blocks' width and depth multipliers (the
    # RepNCSPELAN4 blocks' inner width is round(EXPANSION * HIDDEN_DIM // 2), their CSP depth round(3 * DEPTH_MULT)).
    node.HIDDEN_DIM = 256
    node.NUM_LEVELS = 3
    node.ENCODER_LAYERS = 1
    node.ENCODER_HEADS = 8
    node.ENCODER_FFN_DIM = 1024
    node.EXPANSION = 1.0
    node.DEPTH_MULT = 1.0
    # Decoder: width (the encoder's maps are projected to it unless equal), layers, heads, FFN width, deformable
    # sampling points per head on each level, and how far a unit offset moves a point (times the box size / points).
    node.DECODER_DIM = 256
    node.DECODER_LAYERS = 6
    node.DECODER_HEADS = 8
    node.DECODER_FFN_DIM = 1024
    node.DECODER_POINTS = [3, 6, 3]
    node.OFFSET_SCALE = 0.5
    # Queries selected from the encoder's candidates; contrastive denoising as RT-DETR's (MODEL.RTDETR says more).
    node.NUM_QUERIES = 300
    node.NUM_DENOISING = 100
    node.LABEL_NOISE_RATIO = 0.5
    node.BOX_NOISE_SCALE = 1.0
    # Fine-grained distribution refinement: each box edge is a distribution over NUM_BINS + 1 bins of the weighting
    # function W(n), whose inner bins span +-UP * REG_SCALE edge units (an edge unit is the box size / REG_SCALE)
    # and whose two end bins reach twice that. Location quality: the top LQE_TOPK probabilities of each edge (and
    # their mean) through an MLP of LQE_LAYERS layers of LQE_HIDDEN_DIM, added to every class logit.
    node.NUM_BINS = 32
    node.REG_SCALE = 4.0
    node.UP = 0.5
    node.LQE_TOPK = 4
    node.LQE_HIDDEN_DIM = 64
    node.LQE_LAYERS = 2
    # The matcher (pet.modeling.rtdetr.RTDETR_MATCHER_REGISTRY, called with this node's name) and its costs.
    node.MATCHER = "HungarianMatcher"
    node.COST_CLASS = 2.0
    node.COST_BBOX = 5.0
    node.COST_GIOU = 2.0
    node.MATCHER_ALPHA = 0.25
    node.MATCHER_GAMMA = 2.0
    # Loss weights: varifocal, L1, GIoU, fine-grained localization (FGL) and decoupled distillation focal (DDF, with
    # its softmax temperature); the varifocal loss' alpha and gamma.
    node.LOSS_VFL = 1.0
    node.LOSS_BBOX = 5.0
    node.LOSS_GIOU = 2.0
    node.LOSS_FGL = 0.15
    node.LOSS_DDF = 1.5
    node.DDF_TEMPERATURE = 5.0
    node.FOCAL_ALPHA = 0.75
    node.FOCAL_GAMMA = 2.0
    # How the decoder's outputs form the prediction sets the losses are computed on (pet.modeling.dfine.criterion):
    # "transformers" (its shifted sets; Pet's losses are tested equal to its) or "original" (the paper's aligned sets
    # with GO-LSD's union matching for the box and distribution losses, as the authors train).
    node.LOSS_LAYOUT = "transformers"
    # DEIMv2 only (MODEL.META_ARCHITECTURE pet.modeling.dfine.DEIMV2; D-FINE ignores them): its fusion blocks' CSP
    # layers end with a 3x3 conv (N and S; M, L and X do without); the cross-attention's gateway (False: a residual
    # sum and RMSNorm); one box head for all decoder layers; the query position head's activation (the authors'
    # SiLU); the matchability-aware loss (MAL) weight and alpha (0: none), which replaces the varifocal loss; dense
    # one-to-one matching (the union of every layer's matches) for the box and distribution losses.
    node.TRAILING_CONV = True
    node.GATEWAY = True
    node.SHARE_BOX_HEAD = False
    node.QUERY_POS_ACTIVATION = "silu"
    node.LOSS_MAL = 1.0
    node.MAL_ALPHA = 0.0
    node.DENSE_ONE_TO_ONE = True
    # The encoder: "hybrid" (above: AIFI and CCFM on the last NUM_LEVELS backbone levels, with the model's own fusion
    # blocks). D-FINE also takes "rtdetr": RT-DETR's CSP-RepVGG fusion blocks and strided 3x3 downsampling (round(3 *
    # DEPTH_MULT) RepVGG blocks of EXPANSION * HIDDEN_DIM channels), an ablation of D-FINE's lighter blocks. DEIMv2
    # also takes "lite" (Atto, Femto, Pico; pet/modeling/dfine/lite_encoder.py): the last backbone level alone
    # (stride 16), a stride-32 level pooled from it, a global-average-pool fusion and one FPN and one PAN block;
    # NUM_LEVELS must be 2, the ENCODER_LAYERS / _HEADS / _FFN_DIM keys are unused.
    node.ENCODER = "hybrid"
    # Test time: keep the DETECTIONS_PER_IMAGE best (query, class) scores above SCORE_THRESH_TEST. No NMS.
    node.DETECTIONS_PER_IMAGE = 300
    node.SCORE_THRESH_TEST = 0.0
