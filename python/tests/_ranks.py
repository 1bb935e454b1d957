"""One rank of the collectives tests (a module of its own, so that a spawned process can import
it by name): joins from torchrun's environment and checks every collective against numpy."""

import os


def expected_reduce(np, inputs, op, size):
    acc = inputs[0].copy()
    for x in inputs[1:]:
        if op in ("sum", "avg"):
            acc = acc + x
        elif op == "prod":
            acc = acc * x
        elif op == "min":
            acc = np.minimum(acc, x)
        else:
            acc = np.maximum(acc, x)
    if op == "avg":
        acc = acc // size if np.issubdtype(acc.dtype, np.integer) else acc / acc.dtype.type(size)
    return acc.astype(inputs[0].dtype)


def run(rank, size, port, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    import numpy as np

    from ferroce.collectives import Communicator

    bad = []
    try:
        comm = Communicator(timeout=20)
        assert (comm.rank, comm.size) == (rank, size)

        def data(seed, n, dtype, op):
            i = np.arange(n)
            v = (i + seed) % 2 + 1 if op == "prod" else (i * 7 + seed * 3) % 4 + 1
            return v.astype(dtype)

        for dtype in (np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8):
            for n in (0, 1, 13, 4099, 300001):
                for op in ("sum", "prod", "min", "max", "avg"):
                    inputs = [data(r, n, dtype, op) for r in range(size)]
                    buf = inputs[rank].copy()
                    comm.allreduce(buf, op=op)
                    if not np.array_equal(buf, expected_reduce(np, inputs, op, size)):
                        bad.append(f"allreduce {np.dtype(dtype).name} {op} {n}")
                # reduce_scatter: block b of rank r is stream r * size + b.
                ins = [np.concatenate([data(r * size + b, n, dtype, "sum") for b in range(size)])
                       for r in range(size)]
                out = np.zeros(n, dtype)
                comm.reduce_scatter(ins[rank], out, op="sum")
                want = expected_reduce(np, [data(r * size + rank, n, dtype, "sum")
                                            for r in range(size)], "sum", size)
                if not np.array_equal(out, want):
                    bad.append(f"reduce_scatter {np.dtype(dtype).name} {n}")
        # bfloat16 has no buffer format: its bits, with the type named.
        def bf16(values):
            return (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        n = 1001
        buf = bf16((np.arange(n) * 7 + rank * 3) % 4 + 1)
        comm.allreduce(buf, op="sum", dtype="bfloat16")
        want = bf16(sum((np.arange(n) * 7 + r * 3) % 4 + 1 for r in range(size)))
        if not np.array_equal(buf, want):
            bad.append("allreduce bfloat16")
        for n in (0, 5, 70001):
            mine = data(rank, n, np.float32, "sum")
            out = np.zeros(n * size, np.float32)
            comm.allgather(mine, out)
            if not np.array_equal(out, np.concatenate([data(r, n, np.float32, "sum") for r in range(size)])):
                bad.append(f"allgather {n}")
            for root in range(size):
                b = data(100 + root, n, np.int64, "sum") if rank == root else np.zeros(n, np.int64)
                comm.broadcast(b, root=root)
                if not np.array_equal(b, data(100 + root, n, np.int64, "sum")):
                    bad.append(f"broadcast {n} root {root}")
            inp = np.concatenate([data(10 * rank + j, n, np.uint8, "sum") for j in range(size)])
            out = np.zeros_like(inp)
            comm.alltoall(inp, out)
            if not np.array_equal(out, np.concatenate([data(10 * i + rank, n, np.uint8, "sum")
                                                       for i in range(size)])):
                bad.append(f"alltoall {n}")
            if size > 1:
                if rank == 0:
                    comm.send(data(7, n, np.float64, "sum"), 1)
                elif rank == 1:
                    got = np.zeros(n, np.float64)
                    comm.recv(got, 0)
                    if not np.array_equal(got, data(7, n, np.float64, "sum")):
                        bad.append(f"send/recv {n}")
        # Bytes-like objects other than numpy arrays, and read-only inputs.
        ba = bytearray([rank + 1] * 64)
        comm.allreduce(ba, op="sum")
        if ba != bytearray([sum(range(1, size + 1)) % 256] * 64):
            bad.append("allreduce bytearray")
        out = bytearray(3 * size)
        comm.allgather(bytes([rank] * 3), out)
        if out != bytearray(b"".join(bytes([r] * 3) for r in range(size))):
            bad.append("allgather from bytes")
        comm.barrier()
    except Exception as err:  # reported, not lost with the process
        bad.append(f"{type(err).__name__}: {err}")
    results.put((rank, bad))
