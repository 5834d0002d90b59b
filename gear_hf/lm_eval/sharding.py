"""Data-parallel evaluation across processes that do not each own a CUDA device (CPU processes, or several
processes sharing one GPU).

lm-eval's HFLM shards requests only when more than one CUDA device exists; otherwise every process of an
`accelerate launch` / `torchrun` evaluates the whole task. Two things fix that:

1. `prepare_process_group()`, before the Accelerator is built: under a multi-process launcher on a machine
   without CUDA, accelerate (1.x) only builds a process group when told the run is on CPU
   (`ACCELERATE_USE_CPU`); `torchrun` and `accelerate launch --multi_gpu` do not say so, and
   `accelerate launch --cpu` starts one process unless given an MPI hostfile. So the variable is set here,
   which gives a gloo process group (`DistributedType.MULTI_CPU`).
2. `shard_across_processes(lm)`, after HFLM.__init__: when accelerate reports several processes but HFLM left
   rank 0 / world size 1, take rank and world size from accelerate. lm-eval's evaluator then splits the
   documents (`islice(rank, limit, world_size)`), pads request counts, and gathers metrics and samples to
   rank 0 with `accelerator.gather` / `torch.distributed.gather_object`, which work over gloo.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def launched_world_size() -> int:
    for var in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return 1


def prepare_process_group() -> None:
    """Make accelerate build a CPU (gloo) process group when launched multi-process without CUDA."""
    if launched_world_size() <= 1:
        return
    import torch

    if torch.cuda.is_available():
        return
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true", "yes"):
        os.environ["ACCELERATE_USE_CPU"] = "true"
        log.info("gear_hf: %d processes without CUDA: using a CPU (gloo) process group", launched_world_size())


def shard_across_processes(lm) -> None:
    """Give an HFLM the rank / world size of accelerate when HFLM itself did not shard."""
    accelerator = getattr(lm, "accelerator", None)
    if accelerator is None or accelerator.num_processes <= 1 or lm.world_size > 1:
        return
    lm._rank = accelerator.process_index
    lm._world_size = accelerator.num_processes
    if lm._rank == 0:
        log.info("gear_hf: data parallel over %d processes on %s", lm._world_size, accelerator.device)
