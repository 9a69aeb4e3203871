"""Samplers that shard a dataset over distributed ranks.

Training samplers yield ``(index, seed)``: the seed drives that sample's random
transforms, so the stream of batches depends only on the base seed and the rank,
never on the number of DataLoader workers. All ranks draw the same global order and
each takes its own share, so they never overlap.

The repeat-factor samplers (LVIS' class-balanced sampling) draw each pass with image i
repeated ``r_i`` times (see :func:`pet.data.balance.repeat_factors`): ``floor(r_i)`` copies
plus one more with probability ``r_i - floor(r_i)``, drawn per pass from the pass's seeded
generator, so the counts match ``r_i`` in expectation and the stream is fixed by the seed.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from pet.utils import comm

__all__ = [
    "TrainingSampler", "EpochSampler", "RepeatFactorTrainingSampler", "RepeatFactorEpochSampler", "InferenceSampler",
    "GroupedBatchSampler", "BatchSampler",
]

_SEED_LIMIT = 2**31 - 1


class _ShuffledSampler(Sampler):
    """What the training samplers share: ``size`` items drawn in seeded (shuffled) passes, sharded over ranks.

    ``rank`` / ``world_size`` default to this process's.
    """

    def __init__(self, size: int, seed: int, shuffle: bool = True, rank: int | None = None,
                 world_size: int | None = None) -> None:
        if size <= 0:
            raise ValueError(f"{type(self).__name__} needs a non-empty dataset, got size {size}")
        self.size = size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.rank = comm.get_rank() if rank is None else rank
        self.world_size = comm.get_world_size() if world_size is None else world_size

    @property
    def pass_size(self) -> int:
        """Items in one epoch over all ranks (before an epoch sampler pads it for the ranks)."""
        return self.size

    def _draw(self, g: torch.Generator) -> list[tuple[int, int]]:
        """One pass: every index once, shuffled, each with its own transform seed."""
        return _draw_pass(self.size, g, self.shuffle)


class TrainingSampler(_ShuffledSampler):
    """An infinite, seeded stream of shuffled passes over the data; rank r takes every world_size-th item."""

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return itertools.islice(self._infinite(), self.rank, None, self.world_size)

    def _infinite(self) -> Iterator[tuple[int, int]]:
        g = torch.Generator().manual_seed(self.seed)
        while True:
            yield from self._draw(g)


class EpochSampler(_ShuffledSampler):
    """One shuffled pass per epoch, reshuffled by ``set_epoch``; every rank gets ceil(pass_size / world_size) items.

    The pass is padded by repeating its start (or, when a drawn pass is longer, cut at the
    end) to ``len(self) * world_size`` items, so that all ranks run the same number of
    iterations (as ``torch.utils.data.DistributedSampler`` does).
    """

    epoch = 0  # until set_epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-self.pass_size // self.world_size)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        g = torch.Generator().manual_seed(self.seed + self.epoch * 1_000_003)
        items = self._draw(g)
        total = len(self) * self.world_size
        items = (items * (-(-total // len(items))))[:total]
        return iter(items[self.rank:total:self.world_size])


class _RepeatFactors(_ShuffledSampler):
    """A pass holds image i ``floor(r_i)`` times, plus once more with probability ``r_i - floor(r_i)``, shuffled.

    Each copy gets its own transform seed, so repeated images are augmented differently.
    """

    def __init__(self, repeat_factors: Sequence[float] | np.ndarray, seed: int, shuffle: bool = True,
                 rank: int | None = None, world_size: int | None = None) -> None:
        factors = np.asarray(repeat_factors, dtype=np.float64).reshape(-1)
        if factors.size and not (factors >= 1).all():
            raise ValueError(f"repeat factors must be >= 1, got min {factors.min()}")
        super().__init__(len(factors), seed, shuffle, rank, world_size)
        self.repeat_factors = factors
        self._whole = np.floor(factors).astype(np.int64)
        self._fraction = torch.from_numpy(factors - self._whole)

    @property
    def pass_size(self) -> int:
        """The expected number of items a pass draws, sum(r_i), rounded to the nearest integer."""
        return max(1, int(round(float(self.repeat_factors.sum()))))

    def _draw(self, g: torch.Generator) -> list[tuple[int, int]]:
        extra = (torch.rand(self.size, generator=g, dtype=torch.float64) < self._fraction).numpy()
        indices = np.repeat(np.arange(self.size), self._whole + extra)
        order = torch.randperm(len(indices), generator=g).numpy() if self.shuffle else np.arange(len(indices))
        seeds = torch.randint(_SEED_LIMIT, (len(indices),), generator=g)
        return list(zip(indices[order].tolist(), seeds.tolist()))


class RepeatFactorTrainingSampler(_RepeatFactors, TrainingSampler):
    """:class:`TrainingSampler` over repeat-factor passes (``DATA.SAMPLER RepeatFactorTrainingSampler``).

    The infinite stream is pass after pass, each of random length (``sum(r_i)`` in expectation);
    rank r takes every world_size-th item of it, so shards are disjoint and together cover every
    pass, and resuming skips items by index arithmetic like the plain sampler.
    """


class RepeatFactorEpochSampler(_RepeatFactors, EpochSampler):
    """:class:`EpochSampler` over repeat-factor passes (``DATA.SAMPLER RepeatFactorTrainingSampler`` in epoch mode).

    An epoch has a fixed length, ``pass_size`` = round(sum(r_i)), so the schedule knows its
    iterations: each epoch's drawn pass (shuffled, of random length) is cut at the end or padded
    with its start to ``ceil(pass_size / world_size) * world_size`` items, which the ranks share
    as in :class:`EpochSampler`. Because the pass is shuffled before it is cut or padded, what is
    cut or repeated is a random choice, and counts stay proportional to ``r_i`` in expectation.
    """


class InferenceSampler(Sampler):
    """Every index exactly once over all ranks, in order: rank r gets the contiguous slice [start, end)."""

    def __init__(self, size: int, rank: int | None = None, world_size: int | None = None) -> None:
        self.size = size
        rank = comm.get_rank() if rank is None else rank
        world_size = comm.get_world_size() if world_size is None else world_size
        shard, extra = divmod(size, world_size)
        self.start = rank * shard + min(rank, extra)
        self.end = self.start + shard + (1 if rank < extra else 0)

    def __len__(self) -> int:
        return self.end - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))


class _ResumableBatches:
    """``set_start_iter(n)``: the next pass starts at its n-th batch, as an uninterrupted run would.

    Batches are formed from indices alone, so skipping costs no image decoding; a
    resumed run then sees exactly the batches (and per-sample seeds) it would have seen.
    "The next pass" is the first one a batch is drawn from: a DataLoader with workers calls
    ``iter()`` twice when it starts (once in its constructor, once in its reset) and draws from
    the second only.
    """

    _start_iter = 0

    def set_start_iter(self, start_iter: int) -> None:
        self._start_iter = start_iter

    def _resume(self, batches: Iterator[list]) -> Iterator[list]:
        skip = self._start_iter

        def resumed() -> Iterator[list]:
            self._start_iter = 0  # runs at the first batch drawn, not at iter()
            yield from itertools.islice(batches, skip, None)

        return resumed()


class BatchSampler(_ResumableBatches, torch.utils.data.BatchSampler):
    """torch's BatchSampler, forwarding ``set_epoch`` to the sampler (the train loop calls it on the batch sampler)."""

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list]:
        return self._resume(super().__iter__())


class GroupedBatchSampler(_ResumableBatches, Sampler):
    """Batches whose images share a group (e.g. landscape vs portrait), so less padding is needed.

    Indices are buffered per group and a batch is emitted when a group has ``batch_size``
    of them. For a finite sampler, the leftovers are batched together at the end in the
    order they arrived, so a pass yields exactly ``len(sampler) // batch_size`` batches.
    """

    def __init__(self, sampler: Sampler, group_ids: Sequence[int] | np.ndarray, batch_size: int) -> None:
        self.sampler = sampler
        self.group_ids = np.asarray(group_ids)
        self.batch_size = batch_size

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list]:
        return self._resume(self._batches())

    def _batches(self) -> Iterator[list]:
        buckets: dict[int, list[tuple[int, object]]] = defaultdict(list)
        for arrival, item in enumerate(self.sampler):
            index = item[0] if isinstance(item, tuple) else item
            bucket = buckets[int(self.group_ids[index])]
            bucket.append((arrival, item))
            if len(bucket) == self.batch_size:
                yield [it for _, it in bucket]
                bucket.clear()
        leftovers = [it for _, it in sorted(itertools.chain.from_iterable(buckets.values()), key=lambda p: p[0])]
        for start in range(0, len(leftovers) - self.batch_size + 1, self.batch_size):
            yield leftovers[start:start + self.batch_size]


def _draw_pass(size: int, g: torch.Generator, shuffle: bool) -> list[tuple[int, int]]:
    order = torch.randperm(size, generator=g) if shuffle else torch.arange(size)
    seeds = torch.randint(_SEED_LIMIT, (size,), generator=g)
    return list(zip(order.tolist(), seeds.tolist()))
