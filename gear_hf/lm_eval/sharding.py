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


def close_process_group() -> None:
    """After a finished run, every rank: wait for the others, then tear down the process group a multi-process run
    built. (A rank that exits with its gloo group still up can abort in gloo's threads: "terminate called without
    an active exception", seen once on rank 1 of a 2-process CPU run.)"""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def shard_across_processes(lm) -> None:
    """Give an HFLM the rank / world size of accelerate when HFLM itself did not shard."""
    accelerator = getattr(lm, "accelerator", None)
    if accelerator is None or accelerator.num_processes <= 1 or lm.world_size > 1:
        return
    lm._rank = accelerator.process_index
    lm._world_size = accelerator.num_processes
    if lm._rank == 0:
        log.info("gear_hf: data parallel over %d processes on %s", lm._world_size, accelerator.device)


def _launcher_processes(cmdline: list[str]) -> int | None:
    """--num_processes N of an `accelerate launch` command line (None when it is not one or gives none)."""
    text = " ".join(cmdline)
    if "accelerate" not in text or "launch" not in text:
        return None
    for i, arg in enumerate(cmdline):
        for name in ("--num_processes", "--num-processes"):
            if arg == name and i + 1 < len(cmdline) and cmdline[i + 1].isdigit():
                return int(cmdline[i + 1])
            if arg.startswith(name + "=") and arg.split("=", 1)[1].isdigit():
                return int(arg.split("=", 1)[1])
    return None


def _parent_cmdline() -> list[str]:
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:  # not Linux: nothing to check
        return []


UNSHARDED_HINT = ("for N processes without CUDA run `accelerate launch --multi_gpu --num_processes N "
                  "-m gear_hf.lm_eval ...` (gear_hf then builds a CPU process group) or `torchrun "
                  "--nproc_per_node N -m gear_hf.lm_eval ...`")


def refuse_unsharded_launch(parent_cmdline: list[str] | None = None) -> None:
    """Stop when `accelerate launch --num_processes N` (N > 1) started only this one process: without
    `--multi_gpu` accelerate runs a single process on a machine without CUDA (and with `--cpu` it needs MPI),
    which would evaluate everything once while the user expects N shards."""
    if launched_world_size() > 1:
        return
    requested = _launcher_processes(_parent_cmdline() if parent_cmdline is None else parent_cmdline)
    if requested is not None and requested > 1:
        raise SystemExit(f"gear-lm-eval: error: accelerate launch asked for {requested} processes but started one "
                         f"(no --multi_gpu, so no process group); {UNSHARDED_HINT}")
