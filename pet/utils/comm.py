"""torch.distributed helpers that also work in a single process (no process group)."""
from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def is_main_process() -> bool:
    return get_rank() == 0


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DistributedDataParallel / DataParallel wrapper (``model`` itself when unwrapped)."""
    return model.module if isinstance(getattr(model, "module", None), torch.nn.Module) else model


def synchronize() -> None:
    """A barrier across processes (no-op in a single process)."""
    if get_world_size() > 1:
        dist.barrier()


def collective_device() -> torch.device:
    """Where a tensor handed to a collective must live: the current CUDA device under NCCL, else the CPU.

    NCCL only moves CUDA tensors and gloo is used for CPU runs, so every helper here
    that builds a tensor puts it on this device.
    """
    if is_distributed() and dist.get_backend() == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is true on any process: one small all-reduce (no collective in a single process)."""
    if get_world_size() == 1:
        return flag
    tensor = torch.tensor([int(flag)], device=collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (what the others pass is ignored); ``obj`` itself in one process."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank.

    Under NCCL, torch moves the pickled bytes through the current CUDA device, which
    :func:`pet.cli.init_distributed` sets to this process's GPU.
    """
    if get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def reduce_scalars(
    values: dict[str, float], *, average: bool = True, maximum: tuple[str, ...] = ()
) -> dict[str, float]:
    """Reduce a dict of floats over processes: mean (or sum) by default, max for names in ``maximum``."""
    return reduce_scalars_with_flag(values, 0, average=average, maximum=maximum)[0]


def reduce_scalars_with_flag(
    values: dict[str, float], flag: int, *, average: bool = True, maximum: tuple[str, ...] = ()
) -> tuple[dict[str, float], int]:
    """:func:`reduce_scalars`, plus the largest ``flag`` (an int >= 0) of any process, in the same collectives.

    The train step uses it so every process learns, from the reduction it does anyway,
    whether any of them was asked to stop (the flag is a signal number, 0 for none).

    Processes may hold different names (a detector's denoising losses exist only in a process whose images have
    objects): the result has every process's names, a name a process lacks counting as 0 there, which is what that
    process's term adds to the batch's loss.
    """
    if get_world_size() == 1:
        return values, flag
    device = collective_device()
    names = _names_of_every_process(sorted(values), device)
    tensor = torch.tensor([*(values.get(n, 0.0) for n in names), float(flag)], dtype=torch.float64, device=device)
    summed = tensor.clone()
    dist.all_reduce(summed)
    if average:
        summed /= get_world_size()
    result = dict(zip(names, summed.tolist()))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    largest = tensor.tolist()
    for name, value in zip(names, largest):
        if name in maximum:
            result[name] = value
    return result, int(largest[-1])


def _names_of_every_process(names: list[str], device: torch.device) -> list[str]:
    """``names`` (sorted) when every process holds the same, else the sorted union of all processes' names.

    The check is one all-reduce of four numbers (the count and a CRC-32 of the names, and their negatives, under
    MAX); only a difference costs the gathering of every process's names."""
    digest = float(zlib.crc32("\0".join(names).encode()))
    check = torch.tensor([len(names), digest, -len(names), -digest], dtype=torch.float64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX)
    if check[0] == -check[2] and check[1] == -check[3]:
        return names
    return sorted(set().union(*all_gather_object(names)))


def all_reduce_buffers(module: torch.nn.Module) -> None:
    """Average every floating-point buffer of ``module`` over processes (one all-reduce per dtype/device)."""
    world = get_world_size()
    if world == 1:
        return
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for buffer in module.buffers():
        if buffer.dtype.is_floating_point:
            groups.setdefault((buffer.device, buffer.dtype), []).append(buffer)
    for buffers in groups.values():
        flat = torch.cat([b.reshape(-1) for b in buffers])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for buffer in buffers:
            buffer.copy_(flat[offset:offset + buffer.numel()].view_as(buffer))
            offset += buffer.numel()
