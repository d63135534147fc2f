"""One process per GPU under `torchrun` (DDP; NCCL on GPU, gloo on CPU), or a single process."""

from __future__ import annotations

import os

import torch

from dflash_pipeline.errors import PipelineError


class Dist:
    def __init__(self, device_arg: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = torch.cuda.is_available() and device_arg != "cpu"
        if device_arg.startswith("cuda") and not torch.cuda.is_available():
            raise PipelineError(f"--device {device_arg}: no CUDA device is visible")
        if use_cuda:
            idx = int(device_arg.split(":")[1]) if ":" in device_arg else self.local_rank
            self.device = torch.device("cuda", idx)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if self.world > 1:
            import torch.distributed as dist

            dist.init_process_group("nccl" if use_cuda else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def barrier(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
