"""Sharded data parallelism: FSDP2 (`fully_shard`) per trunk block and per head, on CPU and GPU.

`mtp fit --trainer.strategy fsdp` maps to `mtp.train.cli.FSDPStrategy`, a Lightning
`ModelParallelStrategy` whose device mesh is all data parallel (Lightning's own `fsdp` string is
FSDP1, which refuses a CPU accelerator). `MTPModule.configure_model` calls `shard_model` on that
mesh. This module itself imports no Lightning: the ranks of `run_ranks` start in seconds.

Why FSDP2 through `ModelParallelStrategy`: FSDP2 shards parameters as DTensors per module, so a
head can be its own sharded unit like a trunk block. The sequential path of the heads' loss
(`mtp.train.loss`) runs every head's forward and backward inside one autograd node, which FSDP's
module hooks cannot follow; it gathers each head itself for its turn
(`FSDPModule.unshard`), reduce-scatters the head's gradients to their shards (a DTensor
redistribution from partial sums, averaged as FSDP averages), and frees it again (`reshard`), so
one head at a time is whole. The embedding, the shared final norm and the unembedding form the
root unit, which FSDP2 keeps gathered from forward to backward: W is used by all K heads.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from mtp.model.transformer import MTPTransformer


def shard_model(model: MTPTransformer, mesh, *, param_dtype: torch.dtype | None = None) -> None:
    """Apply `fully_shard` to every trunk block, every head, then the model (the root unit).

    Args:
        model: The model, in place.
        mesh: A 1-D device mesh of the data-parallel ranks.
        param_dtype: Gather parameters in this dtype for compute (bf16 for `bf16-mixed`), with
            gradients reduced in fp32; None keeps the parameters' own dtype.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {"mesh": mesh}
    if param_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype,
                                               reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kw)
    for head in dict.fromkeys(model.heads):  # eagle's heads 2..K are one module: once
        if any(True for _ in head.parameters()):  # deepseek's head 1 holds none
            fully_shard(head, **kw)
    fully_shard(model, **kw)


def is_sharded(model: MTPTransformer) -> bool:
    """Whether `shard_model` was applied (the parameters are DTensors)."""
    from torch.distributed.tensor import DTensor

    return isinstance(model.embed.weight, DTensor)


def full_model(model: MTPTransformer) -> MTPTransformer | None:
    """An unsharded copy of a sharded model on rank 0 (None on the other ranks); the model itself
    when it is not sharded. A collective: every rank must call it."""
    if not is_sharded(model):
        return model
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    full = MTPTransformer(model.cfg)
    full.load_state_dict(state)
    return full


def run_ranks(fn: Callable[..., None], world: int, *args: Any, backend: str = "gloo",
              timeout: float = 300.0) -> None:
    """Run `fn(rank, world, *args)` in `world` spawned processes, one process group among them.

    The ranks meet through a file in a fresh temporary directory (no port to pick and race for);
    gloo talks over the loopback interface. Nothing can hang the caller: the process group's
    collectives time out after `timeout` seconds, a rank still running then prints every thread's
    stack to its stderr and exits, and a rank that outlives that is killed. Every process is gone
    when this returns or raises, so none is left for the interpreter to wait on at exit.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback included).
        torch.multiprocessing.ProcessExitedException: a rank died, e.g. on its deadline.
        TimeoutError: the ranks outlived their deadline by 30 s and were killed.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="mtp-ranks-") as tmp:
        init = f"file://{Path(tmp) / 'rendezvous'}"
        context = mp.start_processes(_rank_main, args=(fn, world, init, backend, timeout, args),
                                     nprocs=world, start_method="spawn", join=False)
        deadline = time.monotonic() + timeout + 30
        try:
            while not context.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{world} ranks of {fn.__qualname__} were still running "
                                       f"{timeout + 30:.0f} s after they started, and were killed")
        finally:
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
                proc.join()


def _rank_main(rank: int, fn: Callable[..., None], world: int, init: str, backend: str,
               timeout: float, args: tuple) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.dump_traceback_later(timeout, exit=True)  # stacks to stderr, then exit
    if backend == "gloo" and "lo" in (name for _, name in socket.if_nameindex()):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()
