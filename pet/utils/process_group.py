"""Joining the run's process group (every round of an elastic restart too), and telling a lost or hung peer
from a bug when a collective fails.

**Why a restarted round needs its own keys.** Under ``torchrun --rdzv-backend c10d`` the agent of node 0
hosts one TCPStore for the whole job and hands its address to every round of workers
(``TORCHELASTIC_USE_AGENT_STORE=True``); the store outlives the workers, and with it every key they
wrote. torch's ``env://`` initialisation connects to that store as it is, without a prefix per round
(``torch.distributed.rendezvous._create_c10d_store``), so gloo's key for each rank's address is shared
by all rounds: a restarted worker that reads a peer's key before the new peer has written it gets the
address of a dead worker of the previous round ("Gloo connectFullMesh failed ... Connection refused").
A restart count would not fix it: each node's agent counts its own restarts, and a node that restarts
because another one rejoined does not count it, so the nodes of one round may disagree.

:func:`round_store` gives each round a fresh key space instead, agreed through the store without
trusting any key a previous round may have left: every process asks under a key only it knows (a
random token), global rank 0 answers every token it sees with a fresh random nonce and waits until
every rank has acknowledged that nonce (under keys that name it, so no old key counts), and all ranks
then use ``PrefixStore("pet/round/<nonce>/")``. A stale token is answered too, harmlessly: its
process is gone.

**Failures.** When a peer dies, gloo fails the next collective on the survivors with a transport
error ("Connection closed by peer", "Connection reset by peer"); when a peer hangs, the collective
times out after the group's timeout (``DIST.TIMEOUT_S``, passed to ``init_process_group``; gloo applies
it to every collective's wait). :func:`collective_failure` turns either into one line for the user.
"""
from __future__ import annotations

import os
import re
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

__all__ = ["join_process_group", "round_store", "collective_failure", "PEER_LOST_EXIT_CODE"]

# EX_TEMPFAIL (sysexits.h), as for a dead data-loading worker: the same command, run again, resumes.
PEER_LOST_EXIT_CODE = 75

_PREFIX = "pet/round"
_POLL_S = 0.02
# What gloo's transport says when a peer's process is gone, and when a collective waited past the group's timeout.
_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|connectFullMesh failed|Connection refused")
_TIMED_OUT = re.compile(r"Timed out waiting")


def join_process_group(backend: str, timeout_s: float) -> None:
    """``init_process_group`` for torchrun's (or :mod:`pet.utils.launch_env`'s) environment, every collective
    bounded by ``timeout_s``; through :func:`round_store` when the store belongs to torchrun's agent."""
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)  # env://: rank 0 hosts a store of its own
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=round_store(agent_store, rank, world_size, timeout_s), rank=rank,
                            world_size=world_size, timeout=timeout)


def round_store(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> dist.PrefixStore:
    """``store`` under a key prefix no earlier round used, the same on every rank (see the module docstring)."""
    token = uuid.uuid4().hex
    if rank != 0:
        store.set(f"{_PREFIX}/ask/{rank}", token)
        nonce = store.get(f"{_PREFIX}/answer/{token}").decode()  # waits up to the store's timeout
        store.set(f"{_PREFIX}/{nonce}/joined/{rank}", "1")
        return dist.PrefixStore(f"{_PREFIX}/{nonce}/", store)
    nonce = token
    answered: set[str] = set()
    waiting = set(range(1, world_size))
    deadline = time.monotonic() + timeout_s
    while waiting:
        for peer in sorted(waiting):
            ask = f"{_PREFIX}/ask/{peer}"
            if store.check([ask]):
                asked = store.get(ask).decode()
                if asked not in answered:
                    store.set(f"{_PREFIX}/answer/{asked}", nonce)
                    answered.add(asked)
            if store.check([f"{_PREFIX}/{nonce}/joined/{peer}"]):
                waiting.discard(peer)
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"Rank(s) {sorted(waiting)} did not join the process group within {timeout_s:g} s "
                               "(DIST.TIMEOUT_S)")
        if waiting:
            time.sleep(_POLL_S)
    return dist.PrefixStore(f"{_PREFIX}/{nonce}/", store)


def collective_failure(exc: BaseException, rank: int) -> str | None:
    """One line saying what happened when ``exc`` is torch.distributed's report of a lost or hung peer (None for
    any other error): what this rank saw, and what to do."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, NotImplementedError):
        return None
    text = str(exc)
    detail = text.strip().splitlines()[-1] if text.strip() else type(exc).__name__
    detail = re.sub(r"\[/[^\]]*\]\s*", "", detail)  # gloo's source location
    detail = re.split(r"(?<=\.) ", detail, maxsplit=1)[0][:200].rstrip(".")  # its first sentence (gloo adds advice)
    restart = (" torchrun --max-restarts restarts the group, which resumes from the last checkpoint; without it,"
               " run the same command again.")
    if _LOST.search(text):
        return (f"Stopped: rank {rank} lost another process of the run ({detail}); that process's own log "
                f"(CKPT/log.txt.rank<N>, or its node's terminal) says why.{restart}")
    if _TIMED_OUT.search(text):
        return (f"Stopped: rank {rank} waited DIST.TIMEOUT_S for another process of the run, which hung or died "
                f"({detail}). Its log (CKPT/log.txt.rank<N>) shows where it stopped; raise DIST.TIMEOUT_S "
                f"if a step can legitimately take longer (a long validation, a slow disk).{restart}")
    return None
