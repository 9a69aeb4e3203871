"""Resuming the batch samplers (``set_start_iter``) by pass arithmetic: the resumed stream is the uninterrupted one's
continuation, and the uninterrupted stream is the item-by-item definition (every world_size-th item of seeded passes,
grouped item by item)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pet.data.samplers import (
    BatchSampler,
    EpochSampler,
    GroupedBatchSampler,
    RepeatFactorEpochSampler,
    RepeatFactorTrainingSampler,
    TrainingSampler,
)

SIZE = 37  # odd, so a rank's phase in the global stream changes from pass to pass
SEED = 11
# Images 3 and 30 form the rare group: a rank's bucket of it carries over several passes.
GROUP_IDS = np.isin(np.arange(SIZE), [3, 30]).astype(np.int64)
FACTORS = np.where(np.arange(SIZE) % 5 == 0, 2.5, 1.0)  # passes of random length, ~44 items
BATCH = 2
PASSES_LATER = 50


class _Plain(torch.utils.data.Sampler):
    """The same sampler seen only through iteration: the batch samplers then skip item by item."""

    def __init__(self, sampler: torch.utils.data.Sampler) -> None:
        self.sampler = sampler

    def __iter__(self):
        return iter(self.sampler)


def _sampler(kind: str, rank: int, world_size: int):
    if kind == "plain":
        return TrainingSampler(SIZE, SEED, rank=rank, world_size=world_size)
    return RepeatFactorTrainingSampler(FACTORS, SEED, rank=rank, world_size=world_size)


def _batcher(grouped: bool, sampler):
    return GroupedBatchSampler(sampler, GROUP_IDS, BATCH) if grouped else BatchSampler(sampler, BATCH, drop_last=True)


def _pass_ends(kind: str, rank: int, world_size: int) -> list[int]:
    """How many items of rank's stream precede the end of each pass, from the pass lengths drawn directly."""
    g = torch.Generator().manual_seed(SEED)
    sampler = _sampler(kind, 0, 1)
    ends = itertools.accumulate(len(sampler._draw(g)[0]) for _ in range(PASSES_LATER + 10))
    return [len(range(rank, end, world_size)) for end in ends]


def _emitted_by(batches: list[list], stream: list, ends: list[int]) -> list[int]:
    """For each pass end: how many batches are complete by then (a batch is emitted with its last item)."""
    position = {item: i for i, item in enumerate(stream)}  # (index, seed) pairs are distinct here
    emissions = [position.get(batch[-1], len(stream)) for batch in batches]
    return [sum(e < end for e in emissions) for end in ends]


@pytest.mark.slow
def test_the_stream_is_every_world_size_th_item_of_seeded_passes():
    """The definition the skip must follow: each pass is randperm then randint from one generator; rank r takes
    the global positions p with p % world_size == r, across pass boundaries."""
    g = torch.Generator().manual_seed(SEED)
    stream = []
    for _ in range(PASSES_LATER + 2):
        order = torch.randperm(SIZE, generator=g)
        stream += zip(order.tolist(), torch.randint(2**31 - 1, (SIZE,), generator=g).tolist())
    for world_size in (1, 3):
        for rank in range(world_size):
            shard = stream[rank::world_size]
            assert list(itertools.islice(TrainingSampler(SIZE, SEED, rank=rank, world_size=world_size),
                                         len(shard))) == shard
    whole = list(itertools.islice(RepeatFactorTrainingSampler(FACTORS, SEED, rank=0, world_size=1), 2000))
    for rank in range(3):
        assert list(itertools.islice(_sampler("repeat", rank, 3), 600)) == whole[rank::3][:600]


@pytest.mark.parametrize("grouped", [False, True], ids=["batches", "grouped"])
@pytest.mark.parametrize("kind", ["plain", "repeat"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_a_resumed_stream_continues_the_uninterrupted_one(kind, grouped, world_size):
    """Skip points: none, one batch, mid-pass, exactly at a pass boundary, and 50 passes later; every rank."""
    for rank in range(world_size):
        ends = _pass_ends(kind, rank, world_size)
        total = ends[-1] // BATCH  # covers 30 batches after the last skip point: 10 passes of >= 12 items
        uninterrupted = list(itertools.islice(_batcher(grouped, _sampler(kind, rank, world_size)), total))
        # Item by item (the fallback for samplers without shard_passes): the same batches, so the uninterrupted
        # stream is what it was before the skip learnt arithmetic.
        plain = _batcher(grouped, _Plain(_sampler(kind, rank, world_size)))
        assert list(itertools.islice(plain, total)) == uninterrupted
        if grouped:
            stream = list(itertools.islice(_sampler(kind, rank, world_size), ends[-1]))
            emitted = _emitted_by(uninterrupted, stream, ends)
            # A pass whose last item fills a bucket: the resume point is exactly at the pass boundary.
            boundary = next(n for end, n in zip(ends, emitted) if n and stream[end - 1] == uninterrupted[n - 1][-1])
        else:
            emitted = [end // BATCH for end in ends]
            boundary = next(end // BATCH for end in ends if end % BATCH == 0)
        mid_pass = emitted[0] // 2
        assert 0 < mid_pass < emitted[0]
        for skip in (0, 1, mid_pass, boundary, emitted[PASSES_LATER - 1], emitted[PASSES_LATER - 1] + 3):
            expected = uninterrupted[skip:skip + 30]
            assert len(expected) == 30
            resumed = _batcher(grouped, _sampler(kind, rank, world_size))
            resumed.set_start_iter(skip)
            assert list(itertools.islice(resumed, 30)) == expected, (rank, skip)
            fallback = _batcher(grouped, _Plain(_sampler(kind, rank, world_size)))
            fallback.set_start_iter(skip)
            assert list(itertools.islice(fallback, 30)) == expected, (rank, skip)


def _epoch_batcher(sampler, grouped: bool):
    """Batches of 4 from three groups: a rank's epoch often ends with a batch of leftovers from several groups."""
    return GroupedBatchSampler(sampler, np.arange(SIZE) % 3, 4) if grouped else BatchSampler(sampler, 4, drop_last=True)


@pytest.mark.parametrize("grouped", [False, True], ids=["batches", "grouped"])
@pytest.mark.parametrize("sampler_class,data", [(EpochSampler, SIZE), (RepeatFactorEpochSampler, FACTORS)],
                         ids=["epoch", "repeat-epoch"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_a_resumed_epoch_continues_the_uninterrupted_one(sampler_class, data, grouped, world_size):
    """Every skip point of an epoch, the grouped sampler's final leftovers batch included, and past the end."""
    leftovers = 0
    for rank in range(world_size):
        sampler = sampler_class(data, SEED, rank=rank, world_size=world_size)
        sampler.set_epoch(3)
        batcher = _epoch_batcher(sampler, grouped)
        uninterrupted = list(batcher)
        assert list(_epoch_batcher(_Plain(sampler), grouped)) == uninterrupted
        leftovers += len({i % 3 for i, _ in uninterrupted[-1]}) > 1
        for skip in range(len(uninterrupted) + 2):
            batcher.set_start_iter(skip)
            assert list(batcher) == uninterrupted[skip:], (rank, skip)
    # With 37 images in groups of 13, 12 and 12, a whole epoch leaves one image over: no leftovers batch.
    assert leftovers or not grouped or (sampler_class, world_size) == (EpochSampler, 1)


def test_the_skip_applies_to_the_first_pass_a_batch_is_drawn_from():
    """A DataLoader calls iter() twice before drawing: both iterators skip; the pass after them does not."""
    batcher = _batcher(True, _sampler("plain", 0, 1))
    uninterrupted = list(itertools.islice(batcher, 20))
    batcher.set_start_iter(7)
    first, second = iter(batcher), iter(batcher)
    assert list(itertools.islice(second, 5)) == uninterrupted[7:12]
    assert list(itertools.islice(first, 5)) == uninterrupted[7:12]
    assert list(itertools.islice(batcher, 5)) == uninterrupted[:5]
