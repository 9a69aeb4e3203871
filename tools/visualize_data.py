"""Draw what the model sees: python tools/visualize_data.py --cfg FILE [--split train|test] [--num N] [--out DIR]
[KEY VALUE ...]

Writes N PNGs of images as the loader delivers them (after the training transforms: resize,
flip, colour jitter; or the test ones), with their ground-truth boxes, class names and, with
MODEL.MASK_ON, masks. Training images come in the order the training sampler draws them;
test images in dataset order over TEST.DATASETS. Batch padding is left out. Default output:
CKPT/vis_data/.
"""
import argparse
import itertools
import logging
import os
from collections.abc import Iterator

import cv2
from fvcore.common.config import CfgNode

from pet.cli import launch_cli
from pet.config import load_cfg
from pet.data import DatasetMapper, LabelSpace, build_test_loader, build_train_loader
from pet.utils.logger import setup_logger
from pet.utils.visualization import draw_detections

logger = logging.getLogger("pet.tools.visualize_data")


def samples(cfg: CfgNode, split: str) -> Iterator[tuple[dict, LabelSpace]]:
    """``(target with its unpadded "image" as HWC RGB, the label space naming its labels)`` one image at a time."""
    if split == "train":
        loaders = [build_train_loader(cfg)]
    else:  # the test transforms, with masks drawn too when the model uses them
        mapper = DatasetMapper.from_config(cfg, is_train=False, mask_on=cfg.MODEL.MASK_ON)
        loaders = [build_test_loader(cfg, name, mapper) for name in cfg.TEST.DATASETS]
    for loader in loaders:
        for images, targets in loader:
            for image, target in zip(images, targets):
                h, w = target["image_size"]
                yield {**target, "image": image[:, :h, :w].permute(1, 2, 0).numpy()}, loader.dataset.label_space


def main() -> None:
    parser = argparse.ArgumentParser(description="Write images after the data transforms with their ground truth.")
    parser.add_argument("--cfg", dest="cfg_file", required=True, metavar="FILE", help="YAML config file")
    parser.add_argument("--split", choices=("train", "test"), default="train",
                        help="TRAIN.DATASETS with the training transforms, or TEST.DATASETS with the test ones")
    parser.add_argument("--num", type=int, default=8, help="number of images to write")
    parser.add_argument("--out", default="", help="output folder (default: CKPT/vis_data)")
    parser.add_argument("opts", nargs=argparse.REMAINDER, metavar="KEY VALUE", help="config overrides")
    args = parser.parse_args()
    setup_logger()  # terminal only: a picture run leaves the run's log.txt alone
    # One process, one image per batch and no workers: a few pictures do not pay for worker start-up.
    cfg = load_cfg(args.cfg_file, [*args.opts, "DATA.NUM_WORKERS", "0", "SOLVER.IMS_PER_BATCH", "1",
                                   "TEST.IMS_PER_BATCH", "1"])
    out_dir = args.out or os.path.join(cfg.CKPT, "vis_data")
    os.makedirs(out_dir, exist_ok=True)
    written = 0
    for i, (sample, label_space) in enumerate(itertools.islice(samples(cfg, args.split), args.num)):
        names = [label_space.name(int(label)) for label in sample["labels"]]
        masks = sample["masks"].numpy() if "masks" in sample else None
        canvas = draw_detections(sample["image"], sample["boxes"].numpy(), names, masks=masks)
        path = os.path.join(out_dir, f"{args.split}_{i:03d}_id{sample['image_id']}.png")
        cv2.imwrite(path, cv2.cvtColor(canvas, cv2.COLOR_RGB2BGR))
        written += 1
    logger.info(f"Wrote {written} {args.split} images with their ground truth to {out_dir}")


if __name__ == "__main__":
    launch_cli(main)
