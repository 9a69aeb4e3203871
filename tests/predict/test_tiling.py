"""The tile merge's promises on detections written by hand (no model): an object cut by a tile edge is reported
once and whole, its fragments are not, and neighbouring objects at a seam stay apart.

Two 256 px tiles overlapping by 64 px on a 448x256 picture: tile 0 is x 0-256, tile 1 x 192-448; the seam of
the fragment rule is tile 0's right edge (x = 256) and tile 1's left edge (x = 192). ``merge_seams``' margin is
TileSpec(256)'s, 4 px.
"""
from __future__ import annotations

import torch

from pet.predict.tiling import TileSpec, merge_seams

TILES = torch.tensor([[0, 0, 256, 256], [192, 0, 448, 256]])
SIZE = (256, 448)
MARGIN = TileSpec(256).margin


def merge(detections: list[tuple[tuple[float, float, float, float], float, int, int]]
          ) -> list[tuple[list[float], int]]:
    """(box, score, label, tile) rows through the seam merge -> sorted (box, label) pairs."""
    boxes = torch.tensor([d[0] for d in detections], dtype=torch.float32)
    scores = torch.tensor([d[1] for d in detections])
    labels, tile_ids = torch.tensor([d[2] for d in detections]), torch.tensor([d[3] for d in detections])
    merged, _, merged_labels, _ = merge_seams(boxes, scores, labels, tile_ids, TILES, SIZE, margin=MARGIN)
    return sorted(zip(merged.tolist(), merged_labels.tolist()))


def test_a_fragment_and_its_whole_copy_in_another_tile_give_one_detection():
    """A 60 px circle (class 1) across tile 0's right edge: tile 0 sees its left 36 px and takes them for a
    rectangle (class 2) scoring 0.95; tile 1 sees it whole, as a circle scoring 0.40, less than half as much.
    Neither class nor score decides: the fragment goes."""
    assert merge([((220, 100, 256, 160), 0.95, 2, 0), ((220, 100, 280, 160), 0.40, 1, 1)]) == [
        ([220, 100, 280, 160], 1)]


def test_neighbouring_objects_across_a_seam_are_both_kept():
    """Two 40 px objects of one class, one above the other and overlapping by 8 px, both across tile 0's right
    edge: tile 0 reports both fragments, tile 1 both objects whole. Each fragment lies inside its own object's
    whole copy and only 18% inside the neighbour's, so the two objects stay, once each."""
    upper, lower = (230, 60, 270, 104), (230, 96, 270, 140)
    assert merge([((230, 60, 256, 104), 0.9, 1, 0), ((230, 96, 256, 140), 0.9, 1, 0),
                  (upper, 0.8, 1, 1), (lower, 0.8, 1, 1)]) == [(list(upper), 1), (list(lower), 1)]


def test_an_object_larger_than_the_overlap_is_one_box_joined_from_its_pieces():
    """A 90 px object (x 170-260) is whole in no tile: tile 0 sees x 170-256 (class 1), tile 1 x 192-260 (class
    2). The pieces cover each other, but neither is a whole copy, so neither is dropped: they are joined, and a
    small whole neighbour below them in tile 1 stays apart."""
    assert merge([((170, 40, 256, 130), 0.9, 1, 0), ((192, 41, 260, 130), 0.7, 2, 1),
                  ((236, 130, 266, 160), 0.8, 3, 1)]) == [([170, 40, 260, 130], 1), ([236, 130, 266, 160], 3)]


def test_a_detection_another_tile_sees_and_finds_nothing_at_is_dropped():
    """Tile 0 takes something in the overlap for a 40 px rectangle (class 2); tile 1 sees the same pixels in its
    own context and finds nothing there: it goes. A 40 px circle below it, in the overlap too, is found by both
    tiles (as different classes: the other tile's detection confirms whatever its class) and stays, once: as
    tile 1 sees it, 18 px from its edge against tile 0's 6 px."""
    assert merge([((200, 100, 240, 140), 0.9, 2, 0), ((210, 180, 250, 220), 0.9, 1, 0),
                  ((210, 181, 250, 220), 0.8, 3, 1)]) == [([210, 181, 250, 220], 3)]


def test_an_object_two_tiles_see_whole_is_reported_as_one_of_them_sees_it():
    """A 40 px object at x 200-240 is whole in both tiles: tile 0 (16 px from its right edge) calls it a circle
    at 0.9 and, less sure, a rectangle; tile 1 (8 px from its left edge) a circle at 0.85 and a triangle. The
    uncut picture gives one view, so the view with the most context around the object stays, both its classes
    with it; tile 1's triangle goes, as its circle does."""
    box = (200, 100, 240, 140)
    assert merge([(box, 0.9, 1, 0), (box, 0.6, 2, 0), ((201, 101, 240, 140), 0.85, 1, 1),
                  ((201, 101, 240, 140), 0.7, 3, 1)]) == [(list(box), 1), (list(box), 2)]


def test_a_whole_detection_of_noise_does_not_erase_the_pieces_of_an_object():
    """A 67 px circle (x 193-260) is cut by both tiles: tile 0 sees x 193-256, tile 1 reaches its own left edge
    (192 + 4 px). Each tile also makes a whole detection of noise lying over the other
    tile's piece (0.03 / 0.02, classes 2 and 3); below 0.05 it is no view of the object, so the pieces are
    joined, not dropped."""
    noise = [((200, 105, 255, 155), 0.03, 2, 1), ((195, 105, 250, 155), 0.02, 3, 0)]
    assert merge([((193, 100, 256, 160), 0.95, 1, 0), ((193, 100, 260, 160), 0.9, 1, 1), *noise]) == [
        ([193, 100, 260, 160], 1), ([195, 105, 250, 155], 3), ([200, 105, 255, 155], 2)]


def test_a_piece_reaching_far_out_of_a_whole_detection_of_something_else_is_not_its_fragment():
    """A 68 px object starting exactly at tile 1's left edge (x 192-260): tile 1's box touches that edge, so it
    counts as cut; tile 0 sees x 193-256 of it, cut by its right edge. Tile 0 also makes a wide whole detection
    of something else (x 120-235, 0.12) over two thirds of tile 1's box; but tile 1's box reaches 25 px (more
    than 0.3 of its width) out of it on its uncut right side: no whole copy of it. The two pieces are joined,
    the detection of something else stays apart."""
    other = ((120, 95, 235, 165), 0.12, 2, 0)
    assert merge([((192, 100, 260, 160), 0.95, 1, 1), ((193, 100, 256, 160), 0.85, 1, 0), other]) == [
        ([120, 95, 235, 165], 2), ([193, 100, 260, 160], 1)]


def test_a_doubtful_piece_straying_past_an_object_does_not_widen_its_joined_box():
    """The 90 px object of the joined-pieces test (x 170-260, y 40-130), with a third piece from tile 1 scoring
    0.5, taller than the object (y 30-150). Each side of the joined box comes from the most confident piece that
    sees that side uncut: the object's box, not the union of its pieces."""
    assert merge([((170, 40, 256, 130), 0.9, 1, 0), ((192, 41, 260, 130), 0.7, 2, 1),
                  ((192, 30, 262, 150), 0.5, 2, 1)]) == [([170, 40, 260, 130], 1)]
