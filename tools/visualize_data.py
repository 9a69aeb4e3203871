"""Draw what the model sees: python tools/visualize_data.py --cfg FILE [--split train|test] [--num N] [--out DIR]
[--grid [--tile-size S] [--cols C]] [KEY VALUE ...]

Writes N PNGs of images as the loader delivers them (after the training transforms: resize,
flip, colour jitter, or the INPUT.AUGMENTATIONS pipeline; or the test ones), with their ground-truth
boxes, class names and, with MODEL.MASK_ON, masks; a keypoint set's points too (one colour per point,
so a flip that swapped left and right shows; joined by the set's skeleton; unlabelled points left out).
``--grid`` also writes ``grid_<split>.png``: the N samples tiled, each letterboxed to one size under a
caption with the config's name and the image id, the picture to look at before training with a new
pipeline. Training images come in the order the training sampler draws them; test images in dataset
order over TEST.DATASETS. Batch padding is left out. Default output: CKPT/vis_data/.

An augmentation list on the command line is a Python literal:
``INPUT.AUGMENTATIONS "[{'type': 'RandomIoUCrop'}, {'type': 'Resize', 'size': [640, 640]}]"``.
"""
import argparse
import itertools
import logging
import math
import os
from collections.abc import Iterator, Sequence

import cv2
import numpy as np
from fvcore.common.config import CfgNode

from pet.cli import launch_cli
from pet.config import load_cfg
from pet.data import DatasetMapper, build_test_loader, build_train_loader
from pet.data.dataset import DetectionDataset
from pet.utils.logger import setup_logger
from pet.utils.visualization import draw_detections, keypoint_colors, tile_pictures

logger = logging.getLogger("pet.tools.visualize_data")

# A grid tile's side when --tile-size is not given: the largest sample's side, at most this, so a grid of COCO
# images (up to 1333 px) stays a picture a screen shows whole.
MAX_AUTO_TILE = 512


def tool_cfg(cfg_file: str, opts: Sequence[str]) -> CfgNode:
    """The run's config as this tool loads it: one process, one image per batch and no workers, since a few
    pictures do not pay for worker start-up (the training sampler's order does not depend on them)."""
    return load_cfg(cfg_file, [*opts, "DATA.NUM_WORKERS", "0", "SOLVER.IMS_PER_BATCH", "1", "TEST.IMS_PER_BATCH", "1"])


def samples(cfg: CfgNode, split: str) -> Iterator[tuple[dict, DetectionDataset]]:
    """``(target with its unpadded "image" as HWC RGB, the dataset it comes from)`` one image at a time; the
    dataset's ``label_space`` names the labels and its ``keypoint_meta`` (a keypoint set's) the points."""
    if split == "train":
        loaders = [build_train_loader(cfg)]
    else:  # the test transforms, with masks drawn too when the model uses them
        mapper = DatasetMapper.from_config(cfg, is_train=False, mask_on=cfg.MODEL.MASK_ON)
        loaders = [build_test_loader(cfg, name, mapper) for name in cfg.TEST.DATASETS]
    for loader in loaders:
        for images, targets in loader:
            for image, target in zip(images, targets):
                h, w = target["image_size"]
                yield {**target, "image": image[:, :h, :w].permute(1, 2, 0).numpy()}, loader.dataset


def draw_sample(sample: dict, dataset: DetectionDataset) -> np.ndarray:
    """The sample's RGB image with its boxes, class names, masks and keypoints drawn."""
    names = [dataset.label_space.name(int(label)) for label in sample["labels"]]
    masks = sample["masks"].numpy() if "masks" in sample else None
    keypoints = sample["keypoints"].numpy() if "keypoints" in sample else None
    meta = getattr(dataset, "keypoint_meta", None)
    num_points = keypoints.shape[1] if keypoints is not None else 0
    return draw_detections(sample["image"], sample["boxes"].numpy(), names, masks=masks, keypoints=keypoints,
                           skeleton=meta.skeleton if meta is not None else (),
                           point_colors=keypoint_colors(num_points) if num_points else None)


def main() -> None:
    parser = argparse.ArgumentParser(description="Write images after the data transforms with their ground truth.")
    parser.add_argument("--cfg", dest="cfg_file", required=True, metavar="FILE", help="YAML config file")
    parser.add_argument("--split", choices=("train", "test"), default="train",
                        help="TRAIN.DATASETS with the training transforms, or TEST.DATASETS with the test ones")
    parser.add_argument("--num", type=int, default=8, help="number of images to write")
    parser.add_argument("--out", default="", help="output folder (default: CKPT/vis_data)")
    parser.add_argument("--grid", action="store_true",
                        help="also write grid_<split>.png: the images tiled, each with the config name and image id")
    parser.add_argument("--tile-size", type=int, default=0, metavar="S",
                        help=f"side of a grid tile in pixels (default: the largest image's, at most {MAX_AUTO_TILE})")
    parser.add_argument("--cols", type=int, default=0, help="grid columns (default: about the square root of --num)")
    parser.add_argument("opts", nargs=argparse.REMAINDER, metavar="KEY VALUE", help="config overrides")
    args = parser.parse_args()
    if args.tile_size < 0 or args.cols < 0:
        parser.error("--tile-size and --cols must be 0 (chosen from the images) or more")
    setup_logger()  # terminal only: a picture run leaves the run's log.txt alone
    cfg = tool_cfg(args.cfg_file, args.opts)
    out_dir = args.out or os.path.join(cfg.CKPT, "vis_data")
    os.makedirs(out_dir, exist_ok=True)
    cfg_name = os.path.splitext(os.path.basename(args.cfg_file))[0]
    pictures, captions, written = [], [], 0
    for i, (sample, dataset) in enumerate(itertools.islice(samples(cfg, args.split), args.num)):
        canvas = draw_sample(sample, dataset)
        path = os.path.join(out_dir, f"{args.split}_{i:03d}_id{sample['image_id']}.png")
        cv2.imwrite(path, cv2.cvtColor(canvas, cv2.COLOR_RGB2BGR))
        written += 1
        if args.grid:
            pictures.append(canvas)
            captions.append(f"{cfg_name} id {sample['image_id']}")
    logger.info(f"Wrote {written} {args.split} images with their ground truth to {out_dir}")
    if pictures:
        side = args.tile_size or min(MAX_AUTO_TILE, max(max(p.shape[:2]) for p in pictures))
        cols = args.cols or math.ceil(math.sqrt(len(pictures)))
        grid = tile_pictures(pictures, captions, (side, side), min(cols, len(pictures)))
        path = os.path.join(out_dir, f"grid_{args.split}.png")
        cv2.imwrite(path, cv2.cvtColor(grid, cv2.COLOR_RGB2BGR))
        logger.info(f"Wrote the {len(pictures)} images tiled {side}x{side} in {min(cols, len(pictures))} columns "
                    f"to {path}")


if __name__ == "__main__":
    launch_cli(main)
