"""Very large images by tiles: where the tiles are, and how their detections become one set.

A detector trained on images of a few hundred pixels misses or merges small objects when a 4000x3000
image is shrunk to its test size, and caps its detections per image. Cut into tiles at the image's own
pixel scale, each tile is an image of the size the model knows. The price is at the seams: an object
cut by a seam is seen in part by one tile and in part (or whole) by its neighbour, and an object larger
than the overlap is whole in no tile at all.

:func:`merge_seams` (the default) uses what a tile-blind merge cannot know, the tile each detection
comes from: a detection that reaches an inner edge of its tile (within ``margin`` px, 1/64 of the tile)
is *cut*, a candidate fragment; any other is *whole*. The aim is the detections the model makes on a
picture small enough to need no tiles.

0. Cross-tile consensus: a detection is dropped when another tile sees most of its box (3/4) and makes
   no detection there (none scoring >= 0.1 covers half of what that tile sees of it). The same pixels
   in another context gave nothing: what a tile took for an object is its reaction to where the tile
   cut the picture (a picture's corner against a plain background taken for a rectangle). An object
   two tiles see is found by both. The detections below 0.1 are the model's noise at a low test
   threshold, which would confirm anything.
1. Whole detections, one view per object: whole detections from different tiles, scoring >= 0.1, whose
   boxes agree (IoU >= 0.6, whatever their classes) are one object seen by several tiles. Each tile's view
   comes with its own classes and its own doubts, so the union of the views holds every view's wrong class;
   a picture small enough to need no tiles gives one view. The tile that sees the object farthest from its
   inner edges (the most context around it, as the uncut picture has) keeps its detections there, with
   every class it gave; the other tiles' go. Then class-wise NMS.
2. The fragment rule: a cut detection lying mostly inside (intersection over its own area >= ``ios``) a
   whole detection from *another* tile, scoring >= 0.05, is a piece of what that tile saw whole:
   dropped, whatever class either has and however much higher the piece scores. A fragment is often
   taken for another class (half a circle looks like a rectangle) and often scores higher than the
   whole copy, so neither may decide; but a whole detection below 0.05 is noise, not a view of the
   object, and may not erase a confident piece of it. The whole copy of an object contains its piece
   except where the piece is cut: a piece reaching out of the covering box by more than 0.3 of its own
   width or height on a side its tile does not cut is a view of something else, and stays. The covering
   detection must be whole, since two pieces of one object cover each other (step 3 joins them).
3. The cut detections left belong to objects no tile saw whole: two from overlapping tiles, of
   comparable scores, whose boxes agree in the region both tiles see (IoU >= ``iou`` there) are pieces
   of one object, whatever classes they were given; pieces are joined, transitively, into one box with the
   best member's score and class. Each side of that box is the side of the most confident piece that sees
   it uncut (the outermost one where every piece is cut there): a doubtful piece straying past the object
   does not widen it. An object spanning three tiles or more is thus rebuilt whole.
4. A last class-wise NMS over the result, then the ``max_det`` best.

The margin, the consensus, the views and the fragment rule's conditions were measured (docs/predict.md,
docs/benchmarks/tiles.md): requiring the covering detection to score at least half the fragment's score (an
earlier version of this merge) kept the confident fragments of cut pictures whose whole view scores
low; no score condition at all let a whole detection at 0.01-0.04 erase an object found at 0.9 by the
tiles that cut it.

:func:`greedy_nmm` is SAHI's default merge (greedy non-maximum merging by intersection over the
smaller box, class-wise), for comparison: it cannot tell a piece of an object from a neighbouring
object, so two objects of one class whose boxes overlap by half the smaller are merged into one.
docs/benchmarks/tiles.md compares every merge here, and SAHI's own with each of its settings, against the
same model on uncut pictures.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torchvision.ops import batched_nms, box_area, box_iou

from pet.utils.errors import ConfigError

__all__ = ["TileSpec", "tile_grid", "merge_seams", "greedy_nmm", "nms_merge", "MERGES", "merge_tiles"]


class TileSpec:
    """``size`` px square tiles overlapping by ``overlap`` (a fraction of ``size``); ``whole_image`` adds a
    pass over the whole image; ``merge``: a name in :data:`MERGES`."""

    def __init__(self, size: int, overlap: float = 0.2, *, whole_image: bool = False, merge: str = "seam",
                 max_det: int = 1000) -> None:
        if size <= 0:
            raise ConfigError(f"--tile must be a positive number of pixels, got {size}.")
        if not 0.0 <= overlap < 1.0:
            raise ConfigError(f"--tile-overlap is a fraction of the tile in [0, 1), got {overlap}.")
        if merge not in MERGES:
            raise ConfigError(f"Unknown tile merge '{merge}'; one of {sorted(MERGES)}.")
        self.size, self.overlap, self.whole_image, self.merge, self.max_det = size, overlap, whole_image, merge, max_det

    @property
    def margin(self) -> float:
        """How close to an inner tile edge a detection must reach to count as cut: 1/64 of the tile (4 px for
        256 px tiles), the slack of a box regressed on an object that ends at the edge. Measured: 8 px
        counts objects near a crossing as cut in every tile that sees them, 2 px misses fragments."""
        return self.size / 64

    @property
    def stride(self) -> int:
        return max(1, self.size - int(round(self.size * self.overlap)))

    def grid(self, height: int, width: int) -> np.ndarray:
        return tile_grid(height, width, self.size, self.stride)

    def __repr__(self) -> str:
        whole = ", whole-image pass" if self.whole_image else ""
        return (f"tiles of {self.size} px, overlap {self.overlap:g} ({self.size - self.stride} px){whole}, "
                f"merge {self.merge}")


def _starts(length: int, size: int, stride: int) -> list[int]:
    if length <= size:
        return [0]
    starts = list(range(0, length - size, stride))
    return starts + [length - size]  # the last tile ends at the border: every tile is full-size


def tile_grid(height: int, width: int, size: int, stride: int) -> np.ndarray:
    """int64 [T, 4] tiles (x0, y0, x1, y1) of at most ``size`` px a side, ``stride`` px apart, row by row,
    covering the image; the last row and column are moved in to end at the border, so tiles are full-size
    (SAHI does the same), and an image smaller than ``size`` is one tile."""
    rows, cols = _starts(height, size, stride), _starts(width, size, stride)
    return np.array([(x, y, min(x + size, width), min(y + size, height)) for y in rows for x in cols],
                    dtype=np.int64).reshape(-1, 4)


# Pairwise overlaps are computed in blocks of this many rows: a 4000x3000 image in 256 px tiles gives ~30k
# detections at a low score threshold, whose full pairwise matrix would take gigabytes.
_BLOCK = 1024
# Two pieces join as one object only when the lower scores at least this fraction of the higher: the many doubtful
# detections a low threshold keeps must not chain confident ones together.
_SCORE_RATIO = 0.5
# The fragment rule's covering detection must score this much: below it, a whole detection is the model's noise at a low
# test threshold (the demo config keeps 0.01), not a view of the object (pet's default ROI_HEADS.SCORE_THRESH_TEST).
_COVER_SCORE = 0.05
# Cross-tile consensus: a detection another tile sees this fraction of must be confirmed there by a detection scoring at
# least _CONFIRM_SCORE covering half of what that tile sees of it. Measured: seen whole (1.0) leaves most of the false
# detections (they lie where one tile alone sees them whole); half (0.5) drops real objects of the scenes.
_SEEN = 0.75
_CONFIRM_SCORE = 0.1
# One view per object: whole detections of different tiles agreeing this much (IoU) are one object. Measured: 0.5, 0.6
# and 0.7 are within two objects of each other on every picture (docs/predict.md); 0.6, the middle, is the default.
_SAME_OBJECT = 0.6
# The fragment rule's cover must contain the fragment but for its cut sides, up to this fraction of the fragment's
# width or height. Measured: 0.1 and 0.2 keep fragments whose box strays a little past their whole copy (scene
# precision 0.919, mosaic 0.606), 0.5 is as no condition at all (wide detections of something else erase pieces).
_STICK_OUT = 0.3


def _pairwise_intersection(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    lt = torch.max(a[:, None, :2], b[None, :, :2])
    rb = torch.min(a[:, None, 2:], b[None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    return wh[..., 0] * wh[..., 1]


def _area(boxes: torch.Tensor) -> torch.Tensor:
    """Areas of XYXY boxes, 0 for empty or inverted ones."""
    return (boxes[:, 2:] - boxes[:, :2]).clamp(min=0).prod(dim=1)


def _unconfirmed(boxes: torch.Tensor, scores: torch.Tensor, tile_ids: torch.Tensor, tiles: torch.Tensor
                 ) -> torch.Tensor:
    """Whether another tile sees ``_SEEN`` of each detection's box and none of its own detections scoring
    ``_CONFIRM_SCORE`` or more covers half of what it sees (step 0 of the module docstring)."""
    tiles = tiles.to(boxes.dtype)
    area = _area(boxes)
    unconfirmed = torch.zeros(len(boxes), dtype=torch.bool)
    for t, tile in enumerate(tiles):
        seen = torch.cat([torch.max(boxes[:, :2], tile[:2]), torch.min(boxes[:, 2:], tile[2:])], dim=1)
        seen_area = _area(seen)
        judged = torch.nonzero((seen_area > 0) & (seen_area >= _SEEN * area) & (tile_ids != t)).flatten()
        if not len(judged):
            continue
        confirming = boxes[(tile_ids == t) & (scores >= _CONFIRM_SCORE)]
        covered = _pairwise_intersection(seen[judged], confirming) >= 0.5 * seen_area[judged, None]
        unconfirmed[judged] |= ~covered.any(dim=1)
    return unconfirmed


def _other_views(boxes: torch.Tensor, scores: torch.Tensor, tile_ids: torch.Tensor, context: torch.Tensor
                 ) -> torch.Tensor:
    """Whether each whole detection is another tile's view of an object some tile sees with more context around
    it (step 1 of the module docstring): among detections scoring ``_CONFIRM_SCORE`` or more, those of different
    tiles with IoU >= ``_SAME_OBJECT`` are one object, transitively; the tile whose member lies farthest from its
    inner edges (``context``, px) keeps its members, the other tiles' are marked. The whole-image pass (tile -1)
    sees objects at another scale, not as another tile: it takes no part."""
    other = torch.zeros(len(boxes), dtype=torch.bool)
    judged = torch.nonzero((scores >= _CONFIRM_SCORE) & (tile_ids >= 0)).flatten()
    if len(judged) < 2:
        return other
    b, t, context = boxes[judged], tile_ids[judged], context[judged]
    pairs = []
    for i in range(0, len(b), _BLOCK):
        same = (box_iou(b[i:i + _BLOCK], b) >= _SAME_OBJECT) & (t[i:i + _BLOCK, None] != t[None])
        found = torch.nonzero(same)
        found[:, 0] += i
        pairs.append(found[found[:, 0] < found[:, 1]])
    for group in _components(len(b), torch.cat(pairs)):
        if len(group) > 1:
            members = torch.tensor(group)
            view = t[members[torch.argmax(context[members])]]
            other[judged[members[t[members] != view]]] = True
    return other


def _covered(pieces: torch.Tensor, piece_cut: torch.Tensor, piece_tiles: torch.Tensor, whole: torch.Tensor,
             whole_tiles: torch.Tensor, whole_scores: torch.Tensor, ios: float) -> torch.Tensor:
    """Whether each piece lies mostly (``ios`` of its own area) inside a whole detection from another tile
    scoring ``_COVER_SCORE`` or more, whatever the class of either, and reaches out of it by at most
    ``_STICK_OUT`` of its own size on each side its tile does not cut (``piece_cut``: [N, 4], x0 y0 x1 y1);
    the fragment rule of the module docstring."""
    whole, whole_tiles = whole[whole_scores >= _COVER_SCORE], whole_tiles[whole_scores >= _COVER_SCORE]
    covered = torch.zeros(len(pieces), dtype=torch.bool)
    if not len(pieces) or not len(whole):
        return covered
    area = box_area(pieces).clamp(min=1e-6)
    pairs = []
    for i in range(0, len(pieces), _BLOCK):
        inside = _pairwise_intersection(pieces[i:i + _BLOCK], whole) / area[i:i + _BLOCK, None] >= ios
        found = torch.nonzero(inside & (whole_tiles[None] != piece_tiles[i:i + _BLOCK, None]))
        found[:, 0] += i
        pairs.append(found)
    piece, cover = torch.cat(pairs).unbind(dim=1)
    p, c = pieces[piece], whole[cover]
    reach = torch.cat([c[:, :2] - p[:, :2], p[:, 2:] - c[:, 2:]], dim=1)  # how far the piece reaches out, per side
    size = (p[:, 2:] - p[:, :2]).repeat(1, 2)
    contained = ((reach <= _STICK_OUT * size) | piece_cut[piece]).all(dim=1)
    covered[piece[contained]] = True
    return covered


def _seam_pairs(boxes: torch.Tensor, scores: torch.Tensor, tile_ids: torch.Tensor, tiles: torch.Tensor,
                iou: float) -> torch.Tensor:
    """[K, 2] pairs (i < j) of cut detections that are pieces of one object: from two overlapping tiles, of
    comparable scores (the lower at least half the higher), their boxes cropped to the region both tiles see
    agree (IoU >= ``iou``).

    Both tiles see the same pixels there, so the two pieces of one object have the same extent in it, while
    two neighbouring objects do not. Classes are not compared: a piece is often taken for another class (a
    cut circle looks like something else), and it is still the same object. (Intersection over the smaller
    whole box, SAHI's test, fails for an object spanning three tiles: the middle piece is a whole tile wide
    and shares only the overlap with the next one.)"""
    candidates = []
    for i in range(0, len(boxes), _BLOCK):
        touching = _pairwise_intersection(boxes[i:i + _BLOCK], boxes) > 0
        touching &= tile_ids[i:i + _BLOCK, None] != tile_ids[None]
        pair_min = torch.min(scores[i:i + _BLOCK, None], scores[None])
        touching &= pair_min >= _SCORE_RATIO * torch.max(scores[i:i + _BLOCK, None], scores[None])
        found = torch.nonzero(touching)
        found[:, 0] += i
        candidates.append(found[found[:, 0] < found[:, 1]])
    pairs = torch.cat(candidates) if candidates else torch.zeros(0, 2, dtype=torch.long)
    a, b = boxes[pairs[:, 0]], boxes[pairs[:, 1]]
    ta, tb = tiles[tile_ids[pairs[:, 0]]].to(boxes.dtype), tiles[tile_ids[pairs[:, 1]]].to(boxes.dtype)
    lo, hi = torch.max(ta[:, :2], tb[:, :2]), torch.min(ta[:, 2:], tb[:, 2:])  # the region both tiles see
    crop_a = torch.cat([torch.max(a[:, :2], lo), torch.min(a[:, 2:], hi)], dim=1)
    crop_b = torch.cat([torch.max(b[:, :2], lo), torch.min(b[:, 2:], hi)], dim=1)
    inter = (torch.min(crop_a[:, 2:], crop_b[:, 2:]) - torch.max(crop_a[:, :2], crop_b[:, :2])).clamp(min=0).prod(dim=1)
    union = _area(crop_a) + _area(crop_b) - inter
    agree = ((hi - lo) > 0).all(dim=1) & (inter >= iou * union.clamp(min=1e-6))
    return pairs[agree]


def _edge_distances(boxes: torch.Tensor, tile_ids: torch.Tensor, tiles: torch.Tensor, size: tuple[int, int]
                    ) -> torch.Tensor:
    """[N, 4]: how far each side (x0, y0, x1, y1) of each detection lies inside the matching edge of its tile, in
    px; infinite where that edge is the image border (no cut there) and for the whole-image pass (tile -1)."""
    height, width = size
    distances = torch.full((len(boxes), 4), float("inf"))
    from_tile = tile_ids >= 0
    t = tiles[tile_ids[from_tile]].to(boxes.dtype)
    b = boxes[from_tile]
    inner = torch.stack([t[:, 0] > 0, t[:, 1] > 0, t[:, 2] < width, t[:, 3] < height], dim=1)
    inside = torch.cat([b[:, :2] - t[:, :2], t[:, 2:] - b[:, 2:]], dim=1)
    distances[from_tile] = torch.where(inner, inside, float("inf"))
    return distances


def _enclosing(boxes: torch.Tensor) -> torch.Tensor:
    """The smallest XYXY box holding every one of ``boxes``."""
    return torch.cat([boxes[:, :2].min(dim=0).values, boxes[:, 2:].max(dim=0).values])


def _joined_box(members: torch.Tensor, member_cut: torch.Tensor, member_scores: torch.Tensor) -> torch.Tensor:
    """One box from the pieces of an object: each side from the most confident piece that sees it uncut, or the
    outermost where every piece is cut there (step 3 of the module docstring)."""
    outermost = _enclosing(members)
    uncut_scores = torch.where(member_cut, -1.0, member_scores[:, None])  # [K, 4]
    best = uncut_scores.argmax(dim=0)
    seen = (~member_cut).any(dim=0)
    return torch.where(seen, members[best, torch.arange(4)], outermost)


def _components(count: int, pairs: torch.Tensor) -> list[list[int]]:
    """Connected components of ``count`` nodes joined by the index ``pairs`` [K, 2] (union-find)."""
    parent = list(range(count))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in pairs.tolist():
        parent[root(i)] = root(j)
    groups: dict[int, list[int]] = {}
    for i in range(count):
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())


def merge_seams(boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, tile_ids: torch.Tensor,
                tiles: torch.Tensor, size: tuple[int, int], *, iou: float = 0.5, ios: float = 0.5,
                margin: float = 4.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The seam-aware merge of the module docstring; returns (boxes, scores, labels, sources), best first:
    ``sources[i]`` is the input detection output i comes from (for pieces joined into one box, the most
    confident piece), so that what else a detection carries (keypoints) can follow it."""
    source = torch.nonzero(~_unconfirmed(boxes, scores, tile_ids, tiles)).flatten()
    boxes, scores, labels, tile_ids = boxes[source], scores[source], labels[source], tile_ids[source]
    distances = _edge_distances(boxes, tile_ids, tiles, size)
    cut_sides = distances <= margin
    cut = cut_sides.any(dim=1)
    whole = torch.nonzero(~cut).flatten()
    whole = whole[~_other_views(boxes[whole], scores[whole], tile_ids[whole], distances[whole].min(dim=1).values)]
    whole = whole[batched_nms(boxes[whole], scores[whole], labels[whole], iou)]
    pieces = torch.nonzero(cut).flatten()
    pieces = pieces[~_covered(boxes[pieces], cut_sides[pieces], tile_ids[pieces], boxes[whole], tile_ids[whole],
                              scores[whole], ios)]
    out_boxes, kept = [boxes[whole]], [whole]
    if len(pieces):
        b, s, t, sides = boxes[pieces], scores[pieces], tile_ids[pieces], cut_sides[pieces]
        for group in _components(len(b), _seam_pairs(b, s, t, tiles, iou)):
            out_boxes.append(_joined_box(b[group], sides[group], s[group])[None])
            kept.append(pieces[group][torch.argmax(s[group])].reshape(1))
    boxes, kept = torch.cat(out_boxes), torch.cat(kept)
    keep = batched_nms(boxes, scores[kept], labels[kept], iou)  # sorted by decreasing score
    return boxes[keep], scores[kept[keep]], labels[kept[keep]], source[kept[keep]]


def greedy_nmm(boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, *, ios: float = 0.5
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy non-maximum merging (SAHI's GREEDYNMM, IOS, class-wise): the best remaining detection absorbs
    every remaining one of its class overlapping it by ``ios`` of the smaller box; the result is their
    union with the best one's score; ``sources`` as :func:`merge_seams`' (the best one)."""
    order = torch.argsort(scores, descending=True, stable=True)
    boxes, scores, labels = boxes[order], scores[order], labels[order]
    area = box_area(boxes).clamp(min=1e-6)
    free = torch.ones(len(boxes), dtype=torch.bool)
    kept, merged = [], []
    for i in range(len(boxes)):
        if not free[i]:
            continue
        free[i] = False
        candidates = torch.nonzero(free & (labels == labels[i])).flatten()
        inter = _pairwise_intersection(boxes[i:i + 1], boxes[candidates])[0]
        group = candidates[inter / torch.min(area[i], area[candidates]) >= ios]
        free[group] = False
        members = torch.cat([boxes[i:i + 1], boxes[group]])
        merged.append(_enclosing(members))
        kept.append(i)
    if not kept:
        return boxes, scores, labels, order
    index = torch.tensor(kept)
    return torch.stack(merged), scores[index], labels[index], order[index]


def nms_merge(boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, *, iou: float = 0.5
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain class-wise NMS over every tile's detections (the baseline: pieces of cut objects survive);
    ``sources`` as :func:`merge_seams`'."""
    keep = batched_nms(boxes, scores, labels, iou)
    return boxes[keep], scores[keep], labels[keep], keep


MERGES = ("seam", "greedy_nmm", "nms")


def merge_tiles(spec: TileSpec, boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor,
                tile_ids: torch.Tensor, tiles: Sequence[Sequence[int]] | np.ndarray, size: tuple[int, int]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every tile's detections (``boxes`` in image pixels, ``tile_ids[i]`` the row of ``tiles`` detection i
    comes from, -1 for the whole-image pass) merged by ``spec.merge``; the ``spec.max_det`` best, best first, as
    (boxes, scores, labels, sources): ``sources[i]``, the input detection output i comes from."""
    boxes, scores, labels = boxes.float(), scores.float(), labels.long()
    if spec.merge == "seam":
        merged = merge_seams(boxes, scores, labels, tile_ids, torch.as_tensor(np.asarray(tiles)), size,
                             margin=spec.margin)
    elif spec.merge == "greedy_nmm":
        merged = greedy_nmm(boxes, scores, labels)
    else:
        merged = nms_merge(boxes, scores, labels)
    order = torch.argsort(merged[1], descending=True, stable=True)[:spec.max_det]
    return merged[0][order], merged[1][order], merged[2][order], merged[3][order]
