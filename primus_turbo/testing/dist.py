"""Two-rank tests in spawned processes: :func:`run_ranks`.

Each rank initialises a process group (NCCL on CUDA, one GPU per rank; gloo on CPU) from a file
store in the test's own temporary folder (no TCP port to race other tests for), runs
``body(rank, world, device, work_dir, *args)``, and on success waits on a barrier, leaves a marker
and exits without interpreter teardown: gloo's worker threads, held alive by objects that keep the
process group (FSDP, DeviceMesh), can abort a process at exit ("terminate called without an active
exception") after every check has passed. A rank killed by a signal therefore fails the run only
when no marker exists; a marker is written only after the final barrier, which returns only once
every rank has finished its body, so one marker means every rank passed. An exception in a body
(an assertion) is re-raised by ``torch.multiprocessing.spawn`` and always fails the run.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import torch

__all__ = ["run_ranks"]


def _rank_main(rank, world, device_type, work_dir, body, args):
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        from primus_turbo.triton.interpreter import fix_bf16_dot

        fix_bf16_dot()
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dev = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                            init_method="file://" + os.path.join(work_dir, "store"), rank=rank, world_size=world)
    try:
        body(rank, world, dev, work_dir, *args)
        dist.barrier()  # no rank closes its connections while a peer still flushes its last collective
    except BaseException:
        dist.destroy_process_group()
        raise
    open(os.path.join(work_dir, f"rank{rank}.passed"), "w").close()
    dist.destroy_process_group()
    os._exit(0)


def run_ranks(body, *args, world: int = 2, device_type: str = "cpu", label: str = "") -> None:
    """Run ``body(rank, world, device, work_dir, *args)`` (a module-level function) on ``world``
    spawned ranks; see the module docstring for the teardown rule."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as work_dir:
        try:
            mp.spawn(_rank_main, args=(world, device_type, work_dir, body, args), nprocs=world, join=True)
        except mp.ProcessExitedException:
            if not any(f.endswith(".passed") for f in os.listdir(work_dir)):
                raise
            warnings.warn(f"{label or body.__name__}: a rank died in process-group teardown after every check passed")
