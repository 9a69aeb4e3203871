"""Every config key Pet knows, with its default and what it means.

A YAML file may only set keys defined here (an unknown key is an error that names
it), so this file is the complete reference of what can be configured. Sections follow
the data flow: data -> model -> solver -> train -> hooks -> test. It is longer than 400
lines on purpose: one reference is easier to search than keys scattered over modules
(a plugin head adds its own keys through ``add_config``, see pet/config/__init__.py).
"""
from fvcore.common.config import CfgNode as CN

_C = CN()

# Output directory of a run. Empty: ckpts/<config path under cfgs/ without .yaml>.
_C.CKPT = ""
# Log to the terminal and write metrics every DISPLAY_ITER iterations (and at the last one).
_C.DISPLAY_ITER = 20
# Random seed for python, numpy and torch; a negative value draws one from the clock.
_C.SEED = 3
# Where to run: "auto" (CUDA when available), "cpu" or "cuda".
_C.DEVICE = "auto"
# CPU threads per process. 0: OMP_NUM_THREADS when set (torchrun sets 1 when a machine runs several processes
# and you did not set it), else torch's default shared among the processes of this machine.
_C.NUM_THREADS = 0

# ---------------------------------------------------------------------------------------
# Distributed runs (torchrun, SLURM's srun): docs/distributed.md
# ---------------------------------------------------------------------------------------
_C.DIST = CN()
# Seconds any process waits in a collective (gradients, metrics, a barrier) for the others, passed to
# init_process_group: a hung or lost process ends the job after it with one line instead of a wait forever.
# Keep it above the longest step a rank may take alone (rank 0 evaluating, writing a large checkpoint).
_C.DIST.TIMEOUT_S = 1800

# ---------------------------------------------------------------------------------------
# Data: datasets, decoding and loading
# ---------------------------------------------------------------------------------------
_C.DATA = CN()
# DataLoader worker processes per training/test process.
_C.DATA.NUM_WORKERS = 2
# Extra datasets registered at start-up, then named in TRAIN.DATASETS / TEST.DATASETS; each
# {name, format, path, images, split, classes} (docs/data.md): format coco (default;
# path: the JSON, images: its image folder; `json:`, path's old name, until 0.3.0), yolo (path: data.yaml,
# split: train/val/test), voc (path: the VOC root, split: an ImageSets/Main name) or csv (path:
# the CSV, images: the folder its paths are relative to; columns: {role: header name}). classes:
# the class list and order (ids 1..K); without it COCO's categories, YOLO's names, or the sorted
# names of a VOC/CSV set. All training and test sets of a run must share one class list.
_C.DATA.CUSTOM = []
# Drop training images that have no usable annotation (test images are always kept). False trains
# on background images too: they only add negatives (fewer false positives on empty scenes).
_C.DATA.FILTER_EMPTY = True
# Training sampler: "TrainingSampler" (each image once per pass, shuffled) or
# "RepeatFactorTrainingSampler" (LVIS' class-balanced sampling: an image is drawn
# max(1, sqrt(REPEAT_THRESHOLD / f_c)) times per pass, for the rarest class c it contains, f_c the
# fraction of training images that contain c). Epoch mode uses the epoch version of either.
_C.DATA.SAMPLER = "TrainingSampler"
# RepeatFactorTrainingSampler: classes in fewer than this fraction of the training images are repeated.
_C.DATA.REPEAT_THRESHOLD = 0.001
# What to do with an image that cannot be read or decoded: "error" (stop) or "skip" (count it).
_C.DATA.ON_BAD_IMAGE = "error"
# Reject boxes that are degenerate or outside the image instead of clipping them with a warning.
_C.DATA.STRICT = False
# Batch images of similar aspect ratio together (less padding).
_C.DATA.ASPECT_RATIO_GROUPING = True
# Batch images of the same padded size together instead (height and width after the training
# resize, rounded up to INPUT.SIZE_DIVISIBILITY): a mixed batch is padded to its largest image, so
# the demo's native 192-256 px images convolve ~13% fewer pixels. Needs that size to be known in
# advance (one INPUT.MIN_SIZE_TRAIN entry, 0 included); with several, batches group by aspect ratio.
# With INPUT.AUGMENTATIONS, the stored sizes when the pipeline keeps them (flips, colour, mixup,
# copy-paste), else aspect ratio.
_C.DATA.SIZE_GROUPING = False

# Input transforms (opencv). Sizes are in pixels.
_C.INPUT = CN()
# Shorter side at training time; one is drawn at random per image when several are given (0: no resize).
_C.INPUT.MIN_SIZE_TRAIN = (800,)
# Longest side allowed at training time.
_C.INPUT.MAX_SIZE_TRAIN = 1333
# Shorter side at test time (0 keeps the original size).
_C.INPUT.MIN_SIZE_TEST = 800
# Longest side allowed at test time.
_C.INPUT.MAX_SIZE_TEST = 1333
# Probability of a horizontal flip at training time.
_C.INPUT.FLIP_PROB = 0.5
# Training-time colour jitter: brightness, contrast and saturation are each scaled by a factor
# drawn uniformly from [1 - x, 1 + x] per image (as torchvision's ColorJitter); 0 disables each.
_C.INPUT.BRIGHTNESS = 0.0
_C.INPUT.CONTRAST = 0.0
_C.INPUT.SATURATION = 0.0
# Pad batched images so height and width are multiples of this.
_C.INPUT.SIZE_DIVISIBILITY = 32
# Training-time crop of a fixed size, before the resize: large images (aerial, 4000x3000) then
# train at tile scale, like predict's --tile. A side smaller than the crop is kept whole.
_C.INPUT.CROP = CN()
_C.INPUT.CROP.ENABLED = False
# (height, width) of the crop in pixels of the original image.
_C.INPUT.CROP.SIZE = (800, 800)
# Probability of placing the crop around a randomly chosen object (the whole object inside when it
# fits) instead of uniformly over the image: objects are sparse in large images.
_C.INPUT.CROP.AROUND_OBJECT_PROB = 0.5
# A box keeps its label only when at least this fraction of its area lies inside the crop; the
# rest of the cut boxes (and their masks) are dropped.
_C.INPUT.CROP.MIN_VISIBLE = 0.5
# Training transforms as an ordered list of {type: NAME, <arguments>} (docs/augmentations.md): torchvision.transforms.v2
# classes (RandomPhotometricDistort, RandomZoomOut, Resize, ScaleJitter, ...), Pet's (RandomHorizontalFlip with the
# keypoint flip map, RandomIoUCrop, SanitizeBoundingBoxes, Mosaic, MixUp, CopyPaste) or a dotted path to one's own.
# `until_iter: N` / `until_epoch: E` in an entry switch it off from there on, `from_iter` / `from_epoch` switch it on
# there. Empty: the keys above (MIN_SIZE_TRAIN, FLIP_PROB, BRIGHTNESS..., CROP) make the pipeline, as they always did;
# set, those keys are not used in training.
_C.INPUT.AUGMENTATIONS = []
# (height, width): stretch every test image to it (RT-DETR, YOLO) with torchvision's antialiased bilinear resize.
# Empty: MIN_SIZE_TEST / MAX_SIZE_TEST keep the aspect ratio.
_C.INPUT.FIXED_SIZE_TEST = ()

# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------
_C.MODEL = CN()
# Registered name of the detector (see pet.modeling.META_ARCH_REGISTRY): FasterRCNN, MaskRCNN,
# CascadeRCNN, CascadeMaskRCNN, RetinaNet, FCOS or your own.
_C.MODEL.META_ARCHITECTURE = "FasterRCNN"
# Number of object classes, background excluded: the class head has NUM_CLASSES + 1 rows (row 0 is
# background; RetinaNet/FCOS have NUM_CLASSES + 1 sigmoid outputs, output 0 never used).
_C.MODEL.NUM_CLASSES = 80
# What row L (label L, 1..NUM_CLASSES) of the class head means (pet/data/categories.py):
# "contiguous": the dataset's categories sorted by id are labels 1..K, and NUM_CLASSES must be K;
# "category_id": label L is category id L, so every category id must be <= NUM_CLASSES and ids the
#   dataset lacks are rows never trained. torchvision's COCO models use this layout (NUM_CLASSES 90:
#   background + COCO's ids 1..90, ten unused), so the cfgs/coco configs set it and their weights load
#   row for row. Fine-tuning on your own classes: contiguous with NUM_CLASSES K.
_C.MODEL.LABEL_SPACE = "contiguous"
# Instance masks: training samples then carry target["masks"] (uint8 [N, h, w], decoded from the
# COCO polygons / RLE and transformed with the image); every non-crowd annotation needs a segmentation.
_C.MODEL.MASK_ON = False
# Per-channel mean and std of RGB pixels in [0, 255] used to normalise inputs.
_C.MODEL.PIXEL_MEAN = [123.675, 116.28, 103.53]
_C.MODEL.PIXEL_STD = [58.395, 57.12, 57.375]
# Run convolutions in channels-last memory format (much faster backward on CPU).
_C.MODEL.CHANNELS_LAST = True
# Submodules to compile with torch.compile, by attribute path: e.g. ["backbone"] ("" is the whole model).
# Compiled in place, so checkpoints and weights are unchanged; the first iterations pay the compilation.
_C.MODEL.COMPILE = []
# (H, W) of the image on which the model summary logged at the start of train and test counts
# FLOPs. Empty: INPUT.FIXED_SIZE_TEST when set, else INPUT.MIN_SIZE_TEST by 4/3 of it (capped at MAX_SIZE_TEST),
# a typical COCO shape.
_C.MODEL.FLOPS_INPUT_SIZE = ()

_C.MODEL.BACKBONE = CN()
# Registered backbone builder (pet.modeling.BACKBONE_REGISTRY): ResNet + FPN (also resnet_vd for RT-DETR, hgnetv2
# for D-FINE / DEIMv2's HGNetv2).
_C.MODEL.BACKBONE.TYPE = "resnet_fpn"
# torchvision ResNet: resnet10 (one block per stage, for training from scratch), resnet18, resnet34, resnet50 or
# resnet101; hgnetv2: B0-B6.
_C.MODEL.BACKBONE.NAME = "resnet50"
# Normalisation in the backbone: "FrozenBN", "BN" or "SyncBN".
_C.MODEL.BACKBONE.NORM = "FrozenBN"
# FrozenBN's eps, added to the running variance. torchvision's released COCO weights of Faster R-CNN, Mask R-CNN
# and RetinaNet (v1) were trained with 0, which its builders set when they load them: use 0.0 to evaluate those.
_C.MODEL.BACKBONE.FROZEN_BN_EPS = 1e-5
# Freeze the stem and the first FREEZE_AT-1 residual stages (0: train everything;
# 2: stem and res2 frozen, as torchvision's trainable_backbone_layers=3). Frozen stages use FrozenBN.
_C.MODEL.BACKBONE.FREEZE_AT = 2

_C.MODEL.FPN = CN()
# Channels of every FPN level.
_C.MODEL.FPN.OUT_CHANNELS = 256
# ResNet stages fed to the FPN (1 = layer1/C2 ... 4 = layer4/C5); RetinaNet/FCOS use [2, 3, 4].
_C.MODEL.FPN.RETURNED_LAYERS = [1, 2, 3, 4]
# Extra coarser levels: "maxpool" (P6 = stride-2 max-pool of the last level; Faster/Mask R-CNN)
# or "p6p7" (P6, P7 by stride-2 3x3 convs; RetinaNet/FCOS).
_C.MODEL.FPN.TOP_BLOCK = "maxpool"

_C.MODEL.RPN = CN()
# Registered RPN head (pet.modeling.RPN_HEAD_REGISTRY) or a dotted import path; the default is
# torchvision's RPNHead (one 3x3 conv, then objectness and box-delta 1x1 convs) with float32 outputs.
_C.MODEL.RPN.HEAD_NAME = "RPNHead"
# Anchor sizes in input pixels, one list per FPN level (P2..P6 for Faster R-CNN), same length each.
_C.MODEL.RPN.ANCHOR_SIZES = [[32], [64], [128], [256], [512]]
# Anchor aspect ratios (height / width), shared by every level.
_C.MODEL.RPN.ASPECT_RATIOS = [0.5, 1.0, 2.0]
# Proposals kept per FPN level before NMS, and per image after NMS, in training / testing.
_C.MODEL.RPN.PRE_NMS_TOPK_TRAIN = 2000
_C.MODEL.RPN.PRE_NMS_TOPK_TEST = 1000
_C.MODEL.RPN.POST_NMS_TOPK_TRAIN = 2000
_C.MODEL.RPN.POST_NMS_TOPK_TEST = 1000
# IoU of the NMS between proposals.
_C.MODEL.RPN.NMS_THRESH = 0.7
# IoU above which an anchor is foreground, below which it is background.
_C.MODEL.RPN.FG_IOU_THRESH = 0.7
_C.MODEL.RPN.BG_IOU_THRESH = 0.3
# Anchors sampled per image for the RPN loss, and the foreground fraction among them.
_C.MODEL.RPN.BATCH_SIZE_PER_IMAGE = 256
_C.MODEL.RPN.POSITIVE_FRACTION = 0.5

_C.MODEL.ROI_HEADS = CN()
# RoIs sampled per image for the box head loss, and the foreground fraction among them.
_C.MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE = 512
_C.MODEL.ROI_HEADS.POSITIVE_FRACTION = 0.25
# IoU with a ground-truth box above which a proposal is foreground / below which background.
_C.MODEL.ROI_HEADS.FG_IOU_THRESH = 0.5
_C.MODEL.ROI_HEADS.BG_IOU_THRESH = 0.5
# Test-time post-processing: minimum score, NMS IoU, detections kept per image.
_C.MODEL.ROI_HEADS.SCORE_THRESH_TEST = 0.05
_C.MODEL.ROI_HEADS.NMS_THRESH_TEST = 0.5
_C.MODEL.ROI_HEADS.DETECTIONS_PER_IMAGE = 100

_C.MODEL.ROI_BOX_HEAD = CN()
# Registered box head (pet.modeling.ROI_BOX_HEAD_REGISTRY) or a dotted import path.
_C.MODEL.ROI_BOX_HEAD.NAME = "TwoMLPHead"
# Width of the box head's output (for TwoMLPHead: of both fully-connected layers).
_C.MODEL.ROI_BOX_HEAD.MLP_DIM = 1024
# RoIAlign output size (S x S) and samples per bin (0: adaptive, as many as the bin covers).
_C.MODEL.ROI_BOX_HEAD.POOLER_RESOLUTION = 7
_C.MODEL.ROI_BOX_HEAD.POOLER_SAMPLING_RATIO = 2

# Cascade R-CNN's box stages (CascadeRCNN, CascadeMaskRCNN; pet/modeling/cascade_roi_heads.py): one entry per
# stage in each list, as detectron2 names them. Stage k is trained on the previous stage's boxes, foreground at
# IOUS[k] (stage 1 samples the RPN's proposals at IOUS[0] instead of ROI_HEADS.FG_IOU_THRESH), and decodes its
# class-agnostic box deltas with BBOX_REG_WEIGHTS[k] (wx, wy, ww, wh). Each stage has its own ROI_BOX_HEAD.
_C.MODEL.ROI_BOX_CASCADE_HEAD = CN()
_C.MODEL.ROI_BOX_CASCADE_HEAD.IOUS = (0.5, 0.6, 0.7)
_C.MODEL.ROI_BOX_CASCADE_HEAD.BBOX_REG_WEIGHTS = (
    (10.0, 10.0, 5.0, 5.0), (20.0, 20.0, 10.0, 10.0), (30.0, 30.0, 15.0, 15.0))

# Mask branch of MaskRCNN (torchvision's maskrcnn_resnet50_fpn with these defaults).
_C.MODEL.ROI_MASK_HEAD = CN()
# Registered mask head (pet.modeling.ROI_MASK_HEAD_REGISTRY) or a dotted import path; the default is
# torchvision's MaskRCNNHeads, built from NUM_CONV and CONV_DIM below.
_C.MODEL.ROI_MASK_HEAD.NAME = "MaskRCNNHeads"
# 3x3 convolutions on the pooled RoI features before the 2x deconvolution.
_C.MODEL.ROI_MASK_HEAD.NUM_CONV = 4
# Channels of each of those convolutions and of the deconvolution.
_C.MODEL.ROI_MASK_HEAD.CONV_DIM = 256
# RoIAlign output size (masks are predicted at twice this) and samples per bin (0: adaptive).
_C.MODEL.ROI_MASK_HEAD.POOLER_RESOLUTION = 14
_C.MODEL.ROI_MASK_HEAD.POOLER_SAMPLING_RATIO = 2

# Keypoint branch of KeypointRCNN (torchvision's keypointrcnn_resnet50_fpn with these defaults). The
# meta-architecture says whether a model predicts keypoints; there is no KEYPOINT_ON switch.
_C.MODEL.ROI_KEYPOINT_HEAD = CN()
# Registered keypoint head (pet.modeling.ROI_KEYPOINT_HEAD_REGISTRY) or a dotted import path; the default
# is torchvision's KeypointRCNNHeads, one 3x3 convolution + ReLU per entry of CONV_DIMS.
_C.MODEL.ROI_KEYPOINT_HEAD.NAME = "KeypointRCNNHeads"
# Keypoints per instance (COCO person: 17); one heatmap each. The dataset's keypoints must have as many.
_C.MODEL.ROI_KEYPOINT_HEAD.NUM_KEYPOINTS = 17
# Output channels of each 3x3 convolution of the head, in order (torchvision: eight of 512).
_C.MODEL.ROI_KEYPOINT_HEAD.CONV_DIMS = [512] * 8
# RoIAlign output size (heatmaps are predicted at 4x this: 2x deconvolution, then 2x bilinear) and
# samples per bin (0: adaptive).
_C.MODEL.ROI_KEYPOINT_HEAD.POOLER_RESOLUTION = 14
_C.MODEL.ROI_KEYPOINT_HEAD.POOLER_SAMPLING_RATIO = 2

# RetinaNet (torchvision's retinanet_resnet50_fpn with these defaults); its FPN is P3-P7
# (MODEL.FPN.RETURNED_LAYERS [2, 3, 4], TOP_BLOCK p6p7).
_C.MODEL.RETINANET = CN()
# Anchor sizes in input pixels, one list per FPN level (P3..P7), same length each: torchvision's
# three scales per octave, x, x * 2^(1/3) and x * 2^(2/3) rounded down.
_C.MODEL.RETINANET.ANCHOR_SIZES = [[32, 40, 50], [64, 80, 101], [128, 161, 203], [256, 322, 406], [512, 645, 812]]
# Anchor aspect ratios (height / width), shared by every level.
_C.MODEL.RETINANET.ASPECT_RATIOS = [0.5, 1.0, 2.0]
# Registered dense head (pet.modeling.DENSE_HEAD_REGISTRY) or a dotted import path; the default is
# torchvision's RetinaNetHead, normalised as HEAD_NORM says. Its outputs and compute_loss must be RetinaNet's.
_C.MODEL.RETINANET.HEAD_NAME = "RetinaNetHead"
# Normalisation in the head's 4+4 convolutions: "" (none: torchvision's retinanet_resnet50_fpn) or "GN"
# (GroupNorm, 32 groups, as retinanet_resnet50_fpn_v2 and FCOS). Without it, the head's 0.01-std
# initialisation shrinks the signal ~10x per layer, which only a pre-trained backbone's features outweigh.
_C.MODEL.RETINANET.HEAD_NORM = ""
# IoU with a ground-truth box above which an anchor is foreground / below which background (in between: ignored).
_C.MODEL.RETINANET.FG_IOU_THRESH = 0.5
_C.MODEL.RETINANET.BG_IOU_THRESH = 0.4
# Test-time post-processing: minimum score, top-scoring candidates kept per level before NMS,
# NMS IoU, detections kept per image.
_C.MODEL.RETINANET.SCORE_THRESH_TEST = 0.05
_C.MODEL.RETINANET.TOPK_CANDIDATES = 1000
_C.MODEL.RETINANET.NMS_THRESH_TEST = 0.5
_C.MODEL.RETINANET.DETECTIONS_PER_IMAGE = 300

# FCOS (torchvision's fcos_resnet50_fpn with these defaults); its FPN is P3-P7 as RetinaNet's and each
# level's points are as large as its stride.
_C.MODEL.FCOS = CN()
# Registered dense head (pet.modeling.DENSE_HEAD_REGISTRY) or a dotted import path; the default is
# torchvision's FCOSHead with NUM_CONVS layers per tower. Its outputs and compute_loss must be FCOS's.
_C.MODEL.FCOS.HEAD_NAME = "FCOSHead"
# 3x3 conv + GroupNorm + ReLU layers in each of the classification and box towers.
_C.MODEL.FCOS.NUM_CONVS = 4
# A point inside a box is a foreground candidate only within this many strides of the box centre.
_C.MODEL.FCOS.CENTER_SAMPLING_RADIUS = 1.5
# Test-time post-processing: minimum score (sqrt of class probability x centerness), top-scoring
# candidates kept per level before NMS, NMS IoU, detections kept per image.
_C.MODEL.FCOS.SCORE_THRESH_TEST = 0.2
_C.MODEL.FCOS.TOPK_CANDIDATES = 1000
_C.MODEL.FCOS.NMS_THRESH_TEST = 0.6
_C.MODEL.FCOS.DETECTIONS_PER_IMAGE = 100

# RT-DETR (MODEL.META_ARCHITECTURE RTDETR, MODEL.BACKBONE.TYPE resnet_vd; docs/models.md#rt-detr). The defaults
# are transformers' RTDetrConfig (the R50 model); cfgs/coco/rtdetr_R-18.yaml lists what R18 changes.
_C.MODEL.RTDETR = CN()
# Channels of the ResNet-vd stem; the stages have 1, 2, 4, 8 times as many (x4 for bottleneck blocks).
_C.MODEL.RTDETR.BACKBONE_WIDTH = 64
# Channels of the hybrid encoder (its input projections, AIFI and the CCFM fusion).
_C.MODEL.RTDETR.HIDDEN_DIM = 256
# AIFI: transformer encoder layers on the stride-32 level (0: none), their heads and FFN width.
_C.MODEL.RTDETR.ENCODER_LAYERS = 1
_C.MODEL.RTDETR.ENCODER_HEADS = 8
_C.MODEL.RTDETR.ENCODER_FFN_DIM = 1024
# CCFM fusion blocks: RepVGG blocks per CSP layer, and the CSP layers' width as a fraction of HIDDEN_DIM
# (the reference's hidden_expansion: 1.0 for R50, 0.5 for R18).
_C.MODEL.RTDETR.CSP_BLOCKS = 3
_C.MODEL.RTDETR.EXPANSION = 1.0
# Decoder: width, layers, heads, FFN width, deformable sampling points per head and level.
_C.MODEL.RTDETR.DECODER_DIM = 256
_C.MODEL.RTDETR.DECODER_LAYERS = 6
_C.MODEL.RTDETR.DECODER_HEADS = 8
_C.MODEL.RTDETR.DECODER_FFN_DIM = 1024
_C.MODEL.RTDETR.DECODER_POINTS = 4
# Queries selected from the encoder's candidates (the most detections an image can have).
_C.MODEL.RTDETR.NUM_QUERIES = 300
# Contrastive denoising at training time: denoising queries per image (0: off; split into groups of twice
# the batch's largest object count), the fraction of their labels flipped (half of it actually changes)
# and the box noise relative to half the box size.
_C.MODEL.RTDETR.NUM_DENOISING = 100
_C.MODEL.RTDETR.LABEL_NOISE_RATIO = 0.5
_C.MODEL.RTDETR.BOX_NOISE_SCALE = 1.0
# The matcher (pet.modeling.rtdetr.RTDETR_MATCHER_REGISTRY) and its cost weights: focal class cost
# (with MATCHER_ALPHA, MATCHER_GAMMA), L1 of the (cx, cy, w, h) boxes, and GIoU.
_C.MODEL.RTDETR.MATCHER = "HungarianMatcher"
_C.MODEL.RTDETR.COST_CLASS = 2.0
_C.MODEL.RTDETR.COST_BBOX = 5.0
_C.MODEL.RTDETR.COST_GIOU = 2.0
_C.MODEL.RTDETR.MATCHER_ALPHA = 0.25
_C.MODEL.RTDETR.MATCHER_GAMMA = 2.0
# Loss weights (varifocal, L1, GIoU) and the varifocal loss' alpha and gamma.
_C.MODEL.RTDETR.LOSS_VFL = 1.0
_C.MODEL.RTDETR.LOSS_BBOX = 5.0
_C.MODEL.RTDETR.LOSS_GIOU = 2.0
_C.MODEL.RTDETR.FOCAL_ALPHA = 0.75
_C.MODEL.RTDETR.FOCAL_GAMMA = 2.0
# Test time: keep the DETECTIONS_PER_IMAGE best (query, class) scores above SCORE_THRESH_TEST. No NMS.
_C.MODEL.RTDETR.DETECTIONS_PER_IMAGE = 300
_C.MODEL.RTDETR.SCORE_THRESH_TEST = 0.0

# ---------------------------------------------------------------------------------------
# Solver
# ---------------------------------------------------------------------------------------
_C.SOLVER = CN()
# "SGD" or "AdamW".
_C.SOLVER.OPTIMIZER = "SGD"
# Peak learning rate (reached after warm-up) for SOLVER.IMS_PER_BATCH images per step; scale it
# linearly with the total batch size.
_C.SOLVER.BASE_LR = 0.02
# SGD momentum (unused by AdamW, which keeps its default betas).
_C.SOLVER.MOMENTUM = 0.9
# Weight decay (L2 for SGD, decoupled for AdamW) of every parameter but normalisation layers'.
_C.SOLVER.WEIGHT_DECAY = 1e-4
# Weight decay of normalisation layers' weights and biases.
_C.SOLVER.WEIGHT_DECAY_NORM = 0.0
# Learning rate of the backbone's parameters (those under `backbone.`) as a fraction of BASE_LR:
# RT-DETR's recipe trains its ImageNet backbone at 0.1.
_C.SOLVER.BACKBONE_LR_FACTOR = 1.0
# Iterations to train (iteration mode). Ignored when MAX_EPOCHS > 0.
_C.SOLVER.MAX_ITER = 90000
# Epochs to train; > 0 selects epoch mode (MAX_ITER is then derived from the dataset size).
_C.SOLVER.MAX_EPOCHS = 0
# Images per batch summed over all processes (one forward/backward).
_C.SOLVER.IMS_PER_BATCH = 16
# Gradient accumulation: one iteration (one optimizer step, one LR-schedule step, what hooks,
# writers and MAX_ITER count) runs ACCUM_STEPS batches, so it sees ACCUM_STEPS x IMS_PER_BATCH images.
_C.SOLVER.ACCUM_STEPS = 1
# Learning-rate policy after warm-up: "step" (x GAMMA at each of STEPS), "cosine" (from BASE_LR down to
# BASE_LR * COSINE_END_FACTOR at MAX_ITER) or "flat_cosine" (DEIM's: BASE_LR until iteration FLAT_ITERS, then the
# same cosine over the iterations left).
_C.SOLVER.LR_POLICY = "step"
_C.SOLVER.STEPS = (60000, 80000)
_C.SOLVER.GAMMA = 0.1
_C.SOLVER.FLAT_ITERS = 0
# DEIM decays to half the learning rate (their lr_gamma 0.5); 0 decays to nothing.
_C.SOLVER.COSINE_END_FACTOR = 0.0
# Linear warm-up from BASE_LR * WARMUP_FACTOR over WARMUP_ITERS iterations.
_C.SOLVER.WARMUP_ITERS = 1000
_C.SOLVER.WARMUP_FACTOR = 0.001
# Clip the global gradient norm to this value (0 disables clipping).
_C.SOLVER.CLIP_GRAD_NORM = 0.0
# Skip an iteration whose loss is not finite (counted in the log) instead of stopping.
_C.SOLVER.SKIP_NONFINITE = False

# Mixed precision of training (pet/engine/precision.py): autocast the forward pass.
_C.SOLVER.AMP = CN()
# "auto": the fastest for this model on this hardware. A CPU without bfloat16 instructions (AVX512_BF16
# or AMX, as torch reads them): float32 (bfloat16 would be emulated, many times slower). A CPU with
# them: one training step of the model timed in both precisions, bfloat16 only when >= 1.15x faster
# (pet/engine/speed_probe.py), cached per machine and model in ~/.cache/pet (PET_CACHE_DIR). CUDA:
# float16 with a gradient scaler. True forces autocast (a CPU without native support warns once),
# False forces float32. The log says which precision was picked and why.
_C.SOLVER.AMP.ENABLED = "auto"
# "auto" (bfloat16 on CPU, float16 on CUDA), "bfloat16" or "float16".
_C.SOLVER.AMP.DTYPE = "auto"

# ---------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------
_C.TRAIN = CN()
# Registered dataset names to train on (concatenated).
_C.TRAIN.DATASETS = ("shapes_train",)
# Initial weights (a Pet checkpoint or a torchvision state_dict); not a resume.
_C.TRAIN.WEIGHTS = ""
# Continue from CKPT/last_checkpoint when it exists.
_C.TRAIN.AUTO_RESUME = True
# Write CKPT/metrics.json (JSON lines).
_C.TRAIN.SAVE_AS_JSON = True
# Write TensorBoard event files under CKPT.
_C.TRAIN.USE_TENSORBOARD = False
# Extra event writers, each {type: <registry name or dotted path>, <kwarg>: ...}.
_C.TRAIN.WRITERS = []

# ---------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------
_C.HOOKS = CN()
# Extra hooks, each {type: <registry name or dotted path>, priority: ..., <kwarg>: ...}.
_C.HOOKS.CUSTOM = []

# Validation while training (EvalHook) on TEST.DATASETS, with the test settings. (Old name: TEST.EVAL_PERIOD.)
_C.HOOKS.EVAL = CN()
# Validate every PERIOD iterations (epochs in epoch mode) and after training; 0: no validation
# while training (test_net.py evaluates the final model).
_C.HOOKS.EVAL.PERIOD = 0

# Recompute BatchNorm population statistics from training batches. (Old name: TEST.PRECISE_BN.)
_C.HOOKS.PRECISE_BN = CN()
_C.HOOKS.PRECISE_BN.ENABLED = False
# Every PERIOD iterations (and at the end of training); 0: only at the end.
_C.HOOKS.PRECISE_BN.PERIOD = 0
# Batches used for the statistics.
_C.HOOKS.PRECISE_BN.NUM_ITER = 200

_C.HOOKS.CHECKPOINT = CN()
# Save model_iter{N}.pth every PERIOD iterations (model_epoch{N}.pth every PERIOD epochs with
# BY_EPOCH, which needs SOLVER.MAX_EPOCHS > 0); <= 0 saves only the last. (Old name: INTERVAL.)
_C.HOOKS.CHECKPOINT.PERIOD = 5000
_C.HOOKS.CHECKPOINT.BY_EPOCH = False
# Keep optimizer / scheduler state in checkpoints (without them a resume restarts momentum / schedule).
_C.HOOKS.CHECKPOINT.SAVE_OPTIMIZER = True
_C.HOOKS.CHECKPOINT.SAVE_SCHEDULER = True
# Directory for checkpoints; empty means CKPT (CKPT/last_checkpoint then holds the absolute path).
_C.HOOKS.CHECKPOINT.OUT_DIR = ""
# Keep only the newest MAX_KEEP regular checkpoints (<= 0 keeps all; best ones never count).
_C.HOOKS.CHECKPOINT.MAX_KEEP = -1
# Save after the last iteration (and link it as model_final.pth).
_C.HOOKS.CHECKPOINT.SAVE_LAST = True
# Validation metric(s) whose best value is kept as model_best_{metric}.pth, replaced on strict
# improvement; "auto" = the first metric of the first validation. Needs HOOKS.EVAL.PERIOD > 0.
_C.HOOKS.CHECKPOINT.SAVE_BEST = []
# "greater" or "less" for every SAVE_BEST metric; empty infers it from each name (AP/acc: greater, loss: less).
_C.HOOKS.CHECKPOINT.RULE = ""
# First step (iteration, or epoch with BY_EPOCH) to save at; then every PERIOD.
_C.HOOKS.CHECKPOINT.SAVE_BEGIN = 0
# After training, also write model_final-{sha256[:8]}.pth holding only these top-level keys (e.g. ["model"]).
_C.HOOKS.CHECKPOINT.PUBLISHED_KEYS = []

# Exponential moving average of the weights, used for validation, test_net.py and checkpoints' "model".
_C.HOOKS.EMA = CN()
_C.HOOKS.EMA.ENABLED = False
# new_ema = (1 - MOMENTUM) * ema + MOMENTUM * weights
_C.HOOKS.EMA.MOMENTUM = 0.0002
# Update the average every PERIOD iterations. (Old name: INTERVAL.)
_C.HOOKS.EMA.PERIOD = 1
# First iteration (1-based) / epoch (1-based, epoch mode) averaged; before it the EMA copies the weights.
_C.HOOKS.EMA.BEGIN_ITER = 0
_C.HOOKS.EMA.BEGIN_EPOCH = 0
# Start with a momentum near 1 decaying to MOMENTUM:
# m = MOMENTUM + (1 - MOMENTUM) * exp(-(1 + updates) / ANNEAL_ITERS); 0 disables.
_C.HOOKS.EMA.ANNEAL_ITERS = 0

# Stop training when a validation metric stops improving (needs HOOKS.EVAL.PERIOD > 0).
_C.HOOKS.EARLY_STOPPING = CN()
_C.HOOKS.EARLY_STOPPING.ENABLED = False
# Metric to watch (as put by EvalHook, e.g. "bbox/AP").
_C.HOOKS.EARLY_STOPPING.MONITOR = "bbox/AP"
# "greater" or "less"; empty infers it from MONITOR (AP/acc: greater, loss: less).
_C.HOOKS.EARLY_STOPPING.RULE = ""
# An improvement must beat the best value by more than this.
_C.HOOKS.EARLY_STOPPING.MIN_DELTA = 0.0
# Stop at the PATIENCE-th validation in a row without improvement.
_C.HOOKS.EARLY_STOPPING.PATIENCE = 5
# Stop as soon as the metric reaches this value (None: never).
_C.HOOKS.EARLY_STOPPING.STOPPING_THRESHOLD = None
# Stop when the metric is NaN or infinite.
_C.HOOKS.EARLY_STOPPING.CHECK_FINITE = True
# A missing metric is an error instead of a warning.
_C.HOOKS.EARLY_STOPPING.STRICT = False

# Release cached CUDA memory after each validation and, as chosen, each iteration / epoch.
_C.HOOKS.EMPTY_CACHE = CN()
_C.HOOKS.EMPTY_CACHE.ENABLED = False
_C.HOOKS.EMPTY_CACHE.AFTER_ITER = False
_C.HOOKS.EMPTY_CACHE.AFTER_EPOCH = True

_C.HOOKS.SYNC_BUFFERS = CN()
# All-reduce buffers (BN statistics) across processes before validation and at epoch end.
_C.HOOKS.SYNC_BUFFERS.ENABLED = True

# torch.profiler over a few iterations.
_C.HOOKS.PROFILER = CN()
_C.HOOKS.PROFILER.ENABLED = False
# Profile from START_ITER completed iterations to END_ITER completed (iterations START_ITER+1 .. END_ITER).
_C.HOOKS.PROFILER.START_ITER = 10
_C.HOOKS.PROFILER.END_ITER = 15
# "table" writes the top operators to CKPT/profiler.txt; "tensorboard" writes a trace under CKPT/profiler.
_C.HOOKS.PROFILER.OUTPUT = "table"

# ---------------------------------------------------------------------------------------
# Testing
# ---------------------------------------------------------------------------------------
_C.TEST = CN()
# Registered dataset names to evaluate on (each separately) in test_net.py and validation.
_C.TEST.DATASETS = ("shapes_val",)
# Weights to test; empty means model_final.pth in HOOKS.CHECKPOINT.OUT_DIR, else in CKPT.
_C.TEST.WEIGHTS = ""
# test_net.py and export.py refuse weights that leave part of the model at its random initial values
# (a part the file lacks, or whose shape differs, e.g. a class head for another NUM_CLASSES): the error
# names the part. True: go on with a warning instead (e.g. to time an untrained model).
_C.TEST.ALLOW_RANDOM_WEIGHTS = False
# Images per batch summed over all processes.
_C.TEST.IMS_PER_BATCH = 1
# Precision of inference, chosen as SOLVER.AMP's (auto / True / False; DTYPE auto / bfloat16 /
# float16). False gives float32, where Pet's detections are those of torchvision's model in the same
# memory format (the parity tests).
_C.TEST.AMP = CN()
# As SOLVER.AMP, for inference: where the CPU has bfloat16 instructions, a forward pass is timed.
_C.TEST.AMP.ENABLED = "auto"
_C.TEST.AMP.DTYPE = "auto"
# Also compute the validation loss (the training losses on TEST.DATASETS, without updating the model
# or its BN statistics) and log it next to the AP as loss/total_loss, loss/<term>.
_C.TEST.VAL_LOSS = False
# The evaluator (registry name in EVALUATOR_REGISTRY, or a dotted path to a class taking
# (dataset, output_dir), or with from_config(cfg, dataset, output_dir)).
_C.TEST.EVALUATOR = "COCOEvaluator"
# COCOEvaluator's COCOeval: "pycocotools" (the reference), "faster" (faster-coco-eval: the same
# numbers, ~3-4x faster; pip install faster-coco-eval) or "auto" (faster when installed).
_C.TEST.COCO_BACKEND = "auto"
# COCOEvaluator's diagnostics, written next to bbox.json (CKPT/test, CKPT/val): per-class PR curves,
# a confusion matrix with background, and a TIDE-style error breakdown (pet/evaluation/diagnostics.py).
_C.TEST.DIAGNOSTICS = CN()
_C.TEST.DIAGNOSTICS.ENABLED = True
# IoU at which a detection matches ground truth (confusion matrix, error types, dAP).
_C.TEST.DIAGNOSTICS.IOU = 0.5
# Lowest score counted in the confusion matrix and in the error counts at the operating point.
_C.TEST.DIAGNOSTICS.SCORE = 0.5
# Extra test callbacks (TestCallback / TestHook subclasses), each {type: ..., <kwarg>: ...}.
_C.TEST.HOOKS = []
# Iterations excluded from the speed figures at the start of testing.
_C.TEST.NUM_WARMUP = 5
# Log the [Testing] progress line every LOG_PERIOD iterations.
_C.TEST.LOG_PERIOD = 10
# Test-time augmentation (pet/modeling/test_time_augmentation.py), in tools/test_net.py, tools/predict.py and
# Predictor, PyTorch backend only: the model runs once per scale and flip and the detections are merged. The test
# transform then resizes to the largest scale (each pass resizes down from it), instead of MIN_SIZE_TEST.
_C.TEST.AUG = CN()
_C.TEST.AUG.ENABLED = False
# Shorter sides, the longer capped at MAX_SIZE (detectron2's keys and defaults). With INPUT.FIXED_SIZE_TEST set,
# each is a square instead (S x S). Every scale costs a forward pass (two with FLIP).
_C.TEST.AUG.MIN_SIZES = (400, 500, 600, 700, 800, 900, 1000, 1100, 1200)
_C.TEST.AUG.MAX_SIZE = 4000
# Also run each scale mirrored left to right (keypoints are renumbered by the test set's flip map).
_C.TEST.AUG.FLIP = True
# How the passes' detections become one set: "nms" (class-wise NMS) or "wbf" (weighted box fusion: boxes of a class
# overlapping by IOU_THRESH or more are averaged, weighted by score; Solovyev et al. 2021).
_C.TEST.AUG.MERGE = "nms"
_C.TEST.AUG.IOU_THRESH = 0.5


# Keys that take "auto", True or False (YAML and the command line may switch between them).
AUTO_OR_BOOL_KEYS = ("SOLVER.AMP.ENABLED", "TEST.AMP.ENABLED")

# Old key (or section) -> its new name. One idea has one name ("PERIOD": every N iterations), and the
# settings of a training hook live under HOOKS. The old names still load, with a warning that names
# the new key, until Pet 0.3.0 (CHANGELOG.md).
RENAMED_KEYS = {
    "HOOKS.CHECKPOINT.INTERVAL": "HOOKS.CHECKPOINT.PERIOD",
    "HOOKS.EMA.INTERVAL": "HOOKS.EMA.PERIOD",
    "TEST.EVAL_PERIOD": "HOOKS.EVAL.PERIOD",
    "TEST.PRECISE_BN": "HOOKS.PRECISE_BN",
}


def get_default_cfg() -> CN:
    """A fresh copy of the defaults (callers may mutate it)."""
    return _C.clone()
