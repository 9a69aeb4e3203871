"""Samplers that shard a dataset over distributed ranks.

Training samplers yield ``(index, seed)``: the seed drives that sample's random
transforms, so the stream of batches depends only on the base seed and the rank,
never on the number of DataLoader workers. All ranks draw the same global order and
each takes its own share, so they never overlap.

The repeat-factor samplers (LVIS' class-balanced sampling) draw each pass with image i
repeated ``r_i`` times (see :func:`pet.data.balance.repeat_factors`): ``floor(r_i)`` copies
plus one more with probability ``r_i - floor(r_i)``, drawn per pass from the pass's seeded
generator, so the counts match ``r_i`` in expectation and the stream is fixed by the seed.

Resuming skips batches by arithmetic on the passes, not by walking them: the training samplers offer
their rank's stream pass by pass as arrays (``shard_passes``), and the batch samplers skip whole passes
by counting (see :class:`_ResumableBatches`). A torch Generator cannot jump ahead, so each skipped pass
is still drawn, as two or three tensor calls (tens of microseconds for a thousand images).
"""
from __future__ import annotations

import itertools
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Sampler

from pet.utils import comm

__all__ = [
    "ProgressClock",
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

    def _draw(self, g: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
        """One pass, as (indices, seeds): every index once, shuffled, each with its own transform seed."""
        order = torch.randperm(self.size, generator=g) if self.shuffle else torch.arange(self.size)
        seeds = torch.randint(_SEED_LIMIT, (self.size,), generator=g)
        return order.numpy(), seeds.numpy()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return _items(self.shard_passes())

    def shard_passes(self, skip: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """This rank's items, after its first ``skip``, pass by pass as (indices, seeds) arrays.

        Iterating the sampler yields the same items one by one; the batch samplers use the arrays
        to skip whole passes when resuming without touching their items in Python.
        """
        raise NotImplementedError


class TrainingSampler(_ShuffledSampler):
    """An infinite, seeded stream of shuffled passes over the data; rank r takes every world_size-th item."""

    def shard_passes(self, skip: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        g = torch.Generator().manual_seed(self.seed)
        start = 0  # the global position of the pass's first item
        while True:
            indices, seeds = self._draw(g)
            # Rank r takes the global positions p with p % world_size == r: in this pass, from offset `phase` on.
            phase = (self.rank - start) % self.world_size
            start += len(indices)
            count = len(range(phase, len(indices), self.world_size))
            if skip >= count:
                skip -= count
                continue
            first = phase + skip * self.world_size
            skip = 0
            yield indices[first::self.world_size], seeds[first::self.world_size]


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

    def shard_passes(self, skip: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """This epoch's share of the rank after its first ``skip`` items, as one (indices, seeds) pair."""
        g = torch.Generator().manual_seed(self.seed + self.epoch * 1_000_003)
        total = len(self) * self.world_size
        # np.resize repeats the pass from its start up to `total` items, or cuts it there.
        indices, seeds = (np.resize(a, total)[self.rank::self.world_size][skip:] for a in self._draw(g))
        yield indices, seeds


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

    def _draw(self, g: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
        extra = (torch.rand(self.size, generator=g, dtype=torch.float64) < self._fraction).numpy()
        indices = np.repeat(np.arange(self.size), self._whole + extra)
        order = torch.randperm(len(indices), generator=g).numpy() if self.shuffle else np.arange(len(indices))
        seeds = torch.randint(_SEED_LIMIT, (len(indices),), generator=g)
        return indices[order], seeds.numpy()


class RepeatFactorTrainingSampler(_RepeatFactors, TrainingSampler):
    """:class:`TrainingSampler` over repeat-factor passes (``DATA.SAMPLER RepeatFactorTrainingSampler``).

    The infinite stream is pass after pass, each of random length (``sum(r_i)`` in expectation);
    rank r takes every world_size-th item of it, so shards are disjoint and together cover every
    pass. Resuming draws each skipped pass to learn its length, then skips it whole, like the plain sampler.
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


@dataclass(frozen=True)
class ProgressClock:
    """Turns a batch's place in the stream (the pass, set by ``set_epoch``, and its position in it) into the
    training (iteration, epoch) it is drawn for.

    ``iters_per_epoch``: iterations per epoch (in iteration mode, the nominal one: the dataset's images over the
    images per iteration); ``accum_steps``: batches per iteration (SOLVER.ACCUM_STEPS).
    """

    iters_per_epoch: int
    accum_steps: int = 1

    def __call__(self, pass_number: int, position: int) -> tuple[int, int]:
        iteration = pass_number * self.iters_per_epoch + position // self.accum_steps
        return iteration, iteration // max(self.iters_per_epoch, 1)


class _ResumableBatches:
    """``set_start_iter(n)``: the next pass starts at its n-th batch, as an uninterrupted run would.

    Batches are formed from indices alone, so skipping costs no image decoding; a
    resumed run then sees exactly the batches (and per-sample seeds) it would have seen.
    "The next pass" is the first one a batch is drawn from: a DataLoader with workers calls
    ``iter()`` twice when it starts (once in its constructor, once in its reset) and draws from
    the second only. Over a sampler with ``shard_passes`` (Pet's training samplers) the skip
    counts whole passes of arrays, so its cost grows with the passes skipped, not the batches;
    over any other sampler the skipped items are drawn one by one. (MMEngine's iteration loop
    instead advances its loader batch by batch on resume, loading each batch.)
    """

    _start_iter = 0
    _epoch = 0
    progress: ProgressClock | None = None

    def set_start_iter(self, start_iter: int) -> None:
        self._start_iter = start_iter

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the sampler (the train loop calls it on the batch sampler); kept for the progress stamp."""
        self._epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def stamp_progress(self, clock: ProgressClock) -> None:
        """Yield ``(index, seed, iteration, epoch)`` items: the training progress each batch is drawn for, which
        scheduled augmentations switch on. A resumed pass counts from its start batch, so the stamps are those of
        an uninterrupted run."""
        self.progress = clock

    def __iter__(self) -> Iterator[list]:
        skip = self._start_iter

        def resumed() -> Iterator[list]:
            self._start_iter = 0  # runs at the first batch drawn, not at iter()
            if self.progress is None:
                yield from self._batches(skip)
                return
            epoch = self._epoch
            for position, batch in enumerate(self._batches(skip), start=skip):
                stamp = self.progress(epoch, position)
                yield [(*item, *stamp) for item in batch]

        return resumed()

    def _batches(self, skip: int) -> Iterator[list]:
        """The batches of one pass after its first ``skip``."""
        raise NotImplementedError


class BatchSampler(_ResumableBatches, torch.utils.data.BatchSampler):
    """torch's BatchSampler, forwarding ``set_epoch`` to the sampler (the train loop calls it on the batch sampler).

    Batches are consecutive runs of ``batch_size`` items, so skipping ``n`` batches is skipping
    ``n * batch_size`` items.
    """

    def _batches(self, skip: int) -> Iterator[list]:
        if hasattr(self.sampler, "shard_passes"):
            items = _items(self.sampler.shard_passes(skip * self.batch_size))
        else:
            items = itertools.islice(iter(self.sampler), skip * self.batch_size, None)
        while batch := list(itertools.islice(items, self.batch_size)):
            if len(batch) == self.batch_size or not self.drop_last:
                yield batch


class GroupedBatchSampler(_ResumableBatches, Sampler):
    """Batches whose images share a group (e.g. landscape vs portrait), so less padding is needed.

    Indices are buffered per group and a batch is emitted when a group has ``batch_size``
    of them. For a finite sampler, the leftovers are batched together at the end in the
    order they arrived, so a pass yields exactly ``len(sampler) // batch_size`` batches.
    Resuming over ``shard_passes`` counts each skipped pass's batches per group
    (:class:`_GroupSkip`) and rebuilds the buckets as they are at the resume point.
    """

    def __init__(self, sampler: Sampler, group_ids: Sequence[int] | np.ndarray, batch_size: int) -> None:
        self.sampler = sampler
        self.group_ids = np.asarray(group_ids)
        self.batch_size = batch_size
        # Each group as 0..G-1: the buckets' keys, and what the skip counts with.
        self._groups, self._codes = np.unique(self.group_ids, return_inverse=True)
        self._codes = self._codes.reshape(-1)

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size  # type: ignore[arg-type]

    def _batches(self, skip: int) -> Iterator[list]:
        buckets: dict[int, list[tuple[int, object]]] = defaultdict(list)
        items: Iterator[tuple[int, object]] = enumerate(self.sampler)
        if skip and hasattr(self.sampler, "shard_passes"):
            state = _GroupSkip(self._codes, len(self._groups), self.batch_size)
            items, skip = state.skip(self.sampler.shard_passes(), skip)
            buckets.update(state.buckets())
        return itertools.islice(self._grouped(items, buckets), skip, None)

    def _grouped(self, items: Iterator[tuple[int, object]],
                 buckets: dict[int, list[tuple[int, object]]]) -> Iterator[list]:
        """The batches of ``(arrival, item)`` pairs, added to ``buckets`` (one list per group)."""
        for arrival, item in items:
            index = item[0] if isinstance(item, tuple) else item
            bucket = buckets[int(self._codes[index])]
            bucket.append((arrival, item))
            if len(bucket) == self.batch_size:
                yield [it for _, it in bucket]
                bucket.clear()
        leftovers = [it for _, it in sorted(itertools.chain.from_iterable(buckets.values()), key=lambda p: p[0])]
        for start in range(0, len(leftovers) - self.batch_size + 1, self.batch_size):
            yield leftovers[start:start + self.batch_size]


class _GroupSkip:
    """The buckets of :class:`GroupedBatchSampler` carried over a rank's stream pass by pass, counted with arrays.

    For each group, ``carry`` counts the items waiting in its bucket (fewer than ``batch_size``):
    a pass with ``count`` items of the group emits ``(carry + count) // batch_size`` batches, each
    at the arrival of the item that fills the bucket, so the batch order is the order of those
    arrivals. The waiting items are the last ``carry`` of their group; in a rare group they can
    come from several passes back, so the passes since the oldest waiting item are kept
    (``since``: per group, the pass of its oldest waiting item) to rebuild the buckets at the end.
    """

    def __init__(self, codes: np.ndarray, num_groups: int, batch_size: int) -> None:
        self.codes = codes
        self.num_groups = num_groups
        self.batch_size = batch_size
        self.carry = np.zeros(num_groups, dtype=np.int64)
        self.since = np.zeros(num_groups, dtype=np.int64)
        self.recent: deque[tuple[int, np.ndarray, np.ndarray]] = deque()  # (pass number, indices, seeds)
        self.arrived = 0  # items of the stream consumed so far

    def skip(self, passes: Iterator[tuple[np.ndarray, np.ndarray]],
             skip: int) -> tuple[Iterator[tuple[int, tuple[int, int]]], int]:
        """Consume ``passes`` up to the item that emits batch ``skip``.

        Returns the stream after that item as ``(arrival, (index, seed))`` and the batches still to
        skip (non-zero only when a finite stream ends first: they come from its leftovers).
        """
        for number, (indices, seeds) in enumerate(passes):
            groups = self.codes[indices]
            counts = np.bincount(groups, minlength=self.num_groups)
            emitted = int(((self.carry + counts) // self.batch_size).sum())
            if emitted < skip:
                self._take(number, indices, seeds, counts)
                skip -= emitted
                continue
            # The bucket sizes as each item arrives, counting from the group's last batch; a batch leaves when
            # its bucket is full.
            fill = self.carry[groups] + _places(groups, counts)
            cut = np.flatnonzero(fill % self.batch_size == 0)[skip - 1] + 1
            self._take(number, indices[:cut], seeds[:cut], np.bincount(groups[:cut], minlength=self.num_groups))
            rest = itertools.chain(_items([(indices[cut:], seeds[cut:])]), _items(passes))
            return enumerate(rest, self.arrived), 0
        return iter(()), skip

    def buckets(self) -> dict[int, list[tuple[int, tuple[int, int]]]]:
        """The waiting items as the grouped sampler's buckets: group -> [(arrival, (index, seed)), ...].

        Only the arrivals' order matters (for a finite stream's leftovers): the waiting items are
        numbered in their order, below the arrival of any item still to come.
        """
        indices = np.concatenate([i for _, i, _ in self.recent] or [np.empty(0, np.int64)])
        seeds = np.concatenate([s for _, _, s in self.recent] or [np.empty(0, np.int64)])
        groups = self.codes[indices]
        counts = np.bincount(groups, minlength=self.num_groups)
        waiting = counts[groups] - _places(groups, counts) < self.carry[groups]  # the last `carry` of each group
        buckets: dict[int, list[tuple[int, tuple[int, int]]]] = defaultdict(list)
        items = zip(indices[waiting].tolist(), seeds[waiting].tolist(), groups[waiting].tolist())
        for arrival, (index, seed, group) in enumerate(items):
            buckets[group].append((arrival, (index, seed)))
        return buckets

    def _take(self, number: int, indices: np.ndarray, seeds: np.ndarray, counts: np.ndarray) -> None:
        """Count in items of pass ``number``; keep the passes that hold waiting items."""
        total = self.carry + counts
        # A group that emitted here, or had nothing waiting, now waits for items of this pass (if any).
        self.since = np.where((total >= self.batch_size) | (self.carry == 0), number, self.since)
        self.carry = total % self.batch_size
        self.since[self.carry == 0] = number + 1
        self.recent.append((number, indices, seeds))
        while self.recent and self.recent[0][0] < self.since.min():
            self.recent.popleft()
        self.arrived += len(indices)


def _places(groups: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each item's 1-based place among the items of its group (``counts`` per group)."""
    by_group = np.argsort(groups, kind="stable")
    places = np.empty(len(groups), dtype=np.int64)
    places[by_group] = np.arange(1, len(groups) + 1) - np.repeat(np.cumsum(counts) - counts, counts)
    return places


def _items(passes: Iterable[tuple[np.ndarray, np.ndarray]]) -> Iterator[tuple[int, int]]:
    """The (index, seed) pairs of (indices, seeds) arrays, as Python ints."""
    return itertools.chain.from_iterable(zip(indices.tolist(), seeds.tolist()) for indices, seeds in passes)
