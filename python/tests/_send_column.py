"""Run by torchrun (2 ranks) from test_torch.py: rank 0 sends a 64 MiB column of an (N, 2)
tensor, a non-contiguous view whose contiguous copy is a temporary; rank 1 checks every value.
The backend once took that temporary's address and let it be freed before reading it: rank 0
died with SIGSEGV (or sent freed heap contents)."""

import torch
import torch.distributed as dist

import ferroce.torch  # noqa: F401  (registers "ferroce")

N = 16 << 20  # float32: a 64 MiB column; arange is exact in float32 up to 2**24 = N

dist.init_process_group("ferroce")
rank = dist.get_rank()
if rank == 0:
    base = torch.full((N, 2), -1.0)
    base[:, 0] = torch.arange(N, dtype=torch.float32)
    col = base[:, 0]
    assert not col.is_contiguous()
    dist.send(col, 1)
    # The view and its base are untouched by the send.
    assert torch.equal(base[:, 0], torch.arange(N, dtype=torch.float32))
    assert bool((base[:, 1] == -1.0).all())
    print("rank 0 sent the column", flush=True)
else:
    got = torch.zeros(N)
    dist.recv(got, 0)
    bad = (got != torch.arange(N, dtype=torch.float32)).nonzero()
    print(f"rank 1 received the column: {bad.numel()} wrong values"
          + (f", first at {bad[0].item()}" if bad.numel() else ""), flush=True)
dist.barrier()
dist.destroy_process_group()
