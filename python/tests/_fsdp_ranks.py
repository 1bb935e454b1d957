"""The FSDP2 rank function of test_torch.py: one rank of a small transformer trained with
``torch.distributed.fsdp.fully_shard`` (every layer its own unit, activation checkpointing,
optionally bf16 parameters), run in a spawned process."""

import os


def train(rank, size, port, backend, steps, bf16, results):
    """Trains from seed 0 for ``steps`` steps on ``backend`` and puts (rank, backend, the loss of
    every step as all ranks' mean, every parameter whole, error or None) on ``results``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils.checkpoint import checkpoint

    import ferroce.torch  # noqa: F401

    class Checkpointed(torch.nn.Module):
        """A layer whose activations are recomputed in the backward pass."""

        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return checkpoint(self.layer, x, use_reentrant=False)

    losses, params, err = [], {}, None
    try:
        dist.init_process_group(backend, rank=rank, world_size=size)
        torch.manual_seed(0)
        blocks = [Checkpointed(torch.nn.TransformerEncoderLayer(
            d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True))
            for _ in range(3)]
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), *blocks, torch.nn.Linear(32, 4))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if bf16 else MixedPrecisionPolicy()
        # A CPU mesh, named: fully_shard's default mesh is on CUDA wherever a GPU is present,
        # which a CPU model on a CPU backend (gloo's or ferroce's) cannot use.
        mesh = init_device_mesh("cpu", (size,))
        for block in model[1:-1]:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        # SGD: Adam divides by the square root of a running mean of squared gradients, which
        # turns the last-bit differences of another reduction order (4 ranks) into visible ones
        # for parameters whose gradients are near zero.
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        # Each rank's own batch, the same at every step, so that the loss falls.
        g = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(4, 6, 16, generator=g)
        y = torch.randn(4, 6, 4, generator=g)
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            losses.append(mean.item())
        for name, p in model.named_parameters():
            params[name] = p.full_tensor().detach().float().numpy().copy()
        dist.destroy_process_group()
    except Exception as e:
        import traceback
        err = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    results.put((rank, backend, losses, params, err))
