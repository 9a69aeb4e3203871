"""Generate a large picture in the style of the shapes demo set, with its ground truth, to try tiled prediction:
python tools/make_scene.py [--output data/scene] [--size 3000 4000] [--objects 150] [--tile 256] [--tile-overlap 0.25]

Writes OUTPUT/scene.jpg and OUTPUT/scene.json (COCO format: one image, a box per object). Objects are 20-100 px;
a third of them are centred exactly on the seams of the tile grid that --tile and --tile-overlap give (as
tools/predict.py cuts it), including crossings of two seams, so some are cut by seams and, being larger than
the overlap, whole in no tile. Predict on it with

    python tools/predict.py --cfg cfgs/shapes/faster_rcnn_R-10-FPN.yaml --input data/scene/scene.jpg --tile 256
"""
import argparse
import json
import os

import cv2
import numpy as np

from pet.data.shapes import SHAPE_CLASSES, render_scene
from pet.predict.tiling import TileSpec


def seam_centers(height: int, width: int, tile: TileSpec, count: int, seed: int) -> list[tuple[float, float]]:
    """``count`` object centres on the grid's inner tile edges: on vertical seams, horizontal seams and crossings,
    spread over the picture."""
    tiles = tile.grid(height, width)
    xs = sorted({int(v) for v in tiles[:, [0, 2]].ravel() if 0 < v < width})
    ys = sorted({int(v) for v in tiles[:, [1, 3]].ravel() if 0 < v < height})
    rng = np.random.default_rng(seed)
    centers = []
    for k in range(count):
        kind = k % 3
        if kind == 0 or not ys:
            centers.append((float(xs[k % len(xs)]), float(rng.uniform(60, height - 60))))
        elif kind == 1 or not xs:
            centers.append((float(rng.uniform(60, width - 60)), float(ys[k % len(ys)])))
        else:
            centers.append((float(xs[(5 * k) % len(xs)]), float(ys[(7 * k) % len(ys)])))
    return centers


def make_scene(output: str, height: int = 3000, width: int = 4000, objects: int = 150, tile: int = 256,
               overlap: float = 0.25, seed: int = 0) -> tuple[str, str, list[dict]]:
    """Write ``output``/scene.jpg and scene.json; returns their paths and the objects (label index, box XYXY)."""
    centers = seam_centers(height, width, TileSpec(tile, overlap), objects // 3, seed)
    image, placed = render_scene(height, width, objects, seed, centers=centers)
    os.makedirs(output, exist_ok=True)
    image_path, json_path = os.path.join(output, "scene.jpg"), os.path.join(output, "scene.json")
    cv2.imwrite(image_path, image, [cv2.IMWRITE_JPEG_QUALITY, 92])
    coco = {
        "images": [{"id": 1, "file_name": "scene.jpg", "height": height, "width": width}],
        "annotations": [{"id": i + 1, "image_id": 1, "category_id": o["label"] + 1, "iscrowd": 0,
                         "bbox": [o["box"][0], o["box"][1], o["box"][2] - o["box"][0], o["box"][3] - o["box"][1]],
                         "area": (o["box"][2] - o["box"][0]) * (o["box"][3] - o["box"][1])}
                        for i, o in enumerate(placed)],
        "categories": [{"id": i + 1, "name": name} for i, name in enumerate(SHAPE_CLASSES)],
    }
    with open(json_path, "w") as f:
        json.dump(coco, f)
    return image_path, json_path, placed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default="data/scene", metavar="DIR")
    parser.add_argument("--size", type=int, nargs=2, default=(3000, 4000), metavar=("H", "W"))
    parser.add_argument("--objects", type=int, default=150)
    parser.add_argument("--tile", type=int, default=256, help="the tile size whose seams objects are put on")
    parser.add_argument("--tile-overlap", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    image, coco, placed = make_scene(args.output, *args.size, args.objects, args.tile, args.tile_overlap, args.seed)
    print(f"Wrote {image} ({args.size[1]}x{args.size[0]}, {len(placed)} objects) and its ground truth {coco}")


if __name__ == "__main__":
    main()
