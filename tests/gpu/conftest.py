"""GPU tests: an NCCL world of one process on one CUDA device (the lent GPU machines have one).

``cuda_world1`` initialises the default process group in the pytest process itself (NCCL,
world size 1, a ``FileStore`` in a temporary directory: no port) and destroys it at the end of
the session. Every test here is marked ``gpu`` and skips cleanly without CUDA.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="session")
def cuda_world1() -> Iterator[None]:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA/NCCL; no GPU available")
    import torch.distributed as dist

    if dist.is_initialized():  # another module made it: share it
        yield
        return
    torch.cuda.set_device(0)
    path = os.path.join(tempfile.mkdtemp(prefix="ap-nccl-"), "store")
    dist.init_process_group("nccl", store=dist.FileStore(path, 1), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    # matmuls compared against plain torch at fp32 tolerances: no TF32 on either side
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        dist.destroy_process_group()
