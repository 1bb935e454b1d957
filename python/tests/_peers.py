"""The peer processes of the verbs tests (a module of its own, so that a spawned process can
import it by name)."""

import struct

import ferroce
from ferroce import enums as e

SIZE = 1 << 20


def pattern(seed, n):
    """`n` bytes of stream `seed`: a block of prime length repeated, so a misplaced or stale
    byte shows."""
    block = bytes((i * 31 + seed * 7 + (i >> 3)) & 0xFF for i in range(4093))
    return (block * (n // len(block) + 1))[:n]


def side(provider):
    ctx = ferroce.Context("lo", provider=provider)
    pd = ferroce.PD(ctx)
    cq = ferroce.CQ(ctx, 256)
    qp = ferroce.QP(pd, cq)
    mr = ferroce.MR(pd, SIZE, 15)
    return ctx, pd, cq, qp, mr


def one(cq):
    wcs = cq.wait(1, 10.0)
    assert len(wcs) == 1, "no completion within 10 s"
    return wcs[0]


def recv(conn, timeout=20.0):
    assert conn.poll(timeout), "the other process said nothing for 20 s"
    return conn.recv()

def target(conn, provider):
    """The passive side: offers its region, then reports what landed in it."""
    ctx, pd, cq, qp, mr = side(provider)
    mr.write(pattern(2, SIZE))
    mr.write(struct.pack("<Q", 1000), 0)
    conn.send(qp.endpoint(mr))
    qp.connect(recv(conn))
    recv(conn)  # the initiator is done
    conn.send(mr.read(SIZE))


def sender(conn, provider):
    _, pd, cq, qp, mr = side(provider)
    conn.send(qp.endpoint())
    qp.connect(recv(conn))
    mr.write(pattern(5, SIZE))
    qp.post_send(ferroce.SendWR(11, e.IBV_WR_SEND, [ferroce.SGE(mr.addr, SIZE, mr.lkey)]))
    addr, rkey, _ = recv(conn)
    qp.post_send(ferroce.SendWR(12, e.IBV_WR_RDMA_WRITE_WITH_IMM, [ferroce.SGE(mr.addr, 4096, mr.lkey)],
                                addr + 4096, rkey, imm_data=0xABCD))
    conn.send([one(cq).status, one(cq).status])


