"""Verbs round trips between two processes, pyverbs-style: WRITE, READ, atomics, SEND/RECV and
WRITE with immediate, every byte checked; failed work requests complete with ibverbs' status."""

import multiprocessing as mp
import os
import struct
import sys

import pytest

import ferroce
from ferroce import enums as e

sys.path.insert(0, os.path.dirname(__file__))
from _peers import SIZE, one, pattern, recv, sender, side, target  # noqa: E402


@pytest.mark.parametrize("provider", ["udp", "shm"])
def test_write_read_atomics_send_between_two_processes(provider):
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    peer = ctx.Process(target=target, args=(theirs, provider))
    peer.start()
    try:
        _, pd, cq, qp, mr = side(provider)
        qp.to_init()
        endpoint = qp.endpoint()
        their_endpoint = recv(ours)
        ours.send(endpoint)
        qp.to_rtr(their_endpoint)
        qp.to_rts()
        assert qp.state == "RTS"
        addr, rkey, length = qp.peer_region
        assert length == SIZE

        # READ the peer's pattern, every byte.
        sge = ferroce.SGE(mr.addr, SIZE, mr.lkey)
        qp.post_send(ferroce.SendWR(1, e.IBV_WR_RDMA_READ, [sge], addr, rkey))
        w = one(cq)
        assert (w.wr_id, w.status, w.opcode, w.byte_len) == (1, e.IBV_WC_SUCCESS, e.IBV_WC_RDMA_READ, SIZE)
        assert mr.read(SIZE - 8, 8) == pattern(2, SIZE)[8:]

        # WRITE our pattern over its second half.
        mr.write(pattern(3, SIZE // 2))
        qp.post_send(ferroce.SendWR(2, e.IBV_WR_RDMA_WRITE,
                                    [ferroce.SGE(mr.addr, SIZE // 2, mr.lkey)], addr + SIZE // 2, rkey))
        assert one(cq).status == e.IBV_WC_SUCCESS

        # FETCH_ADD and COMPARE_SWAP on its first word (1000).
        result = ferroce.SGE(mr.addr, 8, mr.lkey)
        qp.post_send(ferroce.SendWR(3, e.IBV_WR_ATOMIC_FETCH_AND_ADD, [result], addr, rkey, compare_add=5))
        w = one(cq)
        assert (w.status, w.opcode) == (e.IBV_WC_SUCCESS, e.IBV_WC_FETCH_ADD)
        assert struct.unpack("<Q", mr.read(8))[0] == 1000
        qp.post_send(ferroce.SendWR(4, e.IBV_WR_ATOMIC_CMP_AND_SWP, [result], addr, rkey,
                                    compare_add=1005, swap=77))
        assert one(cq).status == e.IBV_WC_SUCCESS
        assert struct.unpack("<Q", mr.read(8))[0] == 1005

        # A bad rkey: a completion with the remote access error, not an exception.
        qp.post_send(ferroce.SendWR(5, e.IBV_WR_RDMA_WRITE, [ferroce.SGE(mr.addr, 8, mr.lkey)],
                                    addr, rkey ^ 0x100))
        w = one(cq)
        assert (w.wr_id, w.status) == (5, e.IBV_WC_REM_ACCESS_ERR), w
        assert qp.state == "ERR"
    finally:
        ours.send(None)
    landed = recv(ours)
    peer.join(20)
    assert peer.exitcode == 0
    want = struct.pack("<Q", 77) + pattern(2, SIZE)[8 : SIZE // 2] + pattern(3, SIZE // 2)
    assert landed == want, "the peer's memory after WRITE, FETCH_ADD and COMPARE_SWAP"


@pytest.mark.parametrize("provider", ["udp", "shm"])
def test_send_recv_and_write_with_immediate(provider):
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    peer = ctx.Process(target=sender, args=(theirs, provider))
    peer.start()
    _, pd, cq, qp, mr = side(provider)
    their = recv(ours)
    ours.send(qp.endpoint())
    qp.connect(their)
    qp.post_recv(ferroce.RecvWR(21, [ferroce.SGE(mr.addr, SIZE, mr.lkey)]))
    qp.post_recv(ferroce.RecvWR(22, []))
    w = one(cq)
    assert (w.wr_id, w.status, w.opcode, w.byte_len) == (21, e.IBV_WC_SUCCESS, e.IBV_WC_RECV, SIZE)
    assert mr.read(SIZE) == pattern(5, SIZE)
    ours.send((mr.addr, mr.rkey, SIZE))
    w = one(cq)
    assert (w.wr_id, w.status, w.opcode, w.imm_data) == (22, e.IBV_WC_SUCCESS, e.IBV_WC_RECV_RDMA_WITH_IMM, 0xABCD)
    assert mr.read(4096, 4096) == pattern(5, 4096)
    assert recv(ours) == [e.IBV_WC_SUCCESS, e.IBV_WC_SUCCESS]
    peer.join(20)
    assert peer.exitcode == 0


def test_bad_arguments_raise_verbs_errors():
    with pytest.raises(ferroce.VerbsError):
        ferroce.Context("no-such-device")
    ctx = ferroce.Context("lo")
    pd = ferroce.PD(ctx)
    cq = ferroce.CQ(ctx)
    qp = ferroce.QP(pd, cq)
    mr = ferroce.MR(pd, 64)
    with pytest.raises(ferroce.VerbsError):
        mr.read(65)
    with pytest.raises(ferroce.VerbsError):
        qp.to_rts()  # from RESET
    with pytest.raises(ferroce.VerbsError):
        qp.post_send(ferroce.SendWR(1, 99))
    with pytest.raises(ferroce.VerbsError):
        qp.to_rtr(b"not an endpoint")


@pytest.mark.parametrize("sge", ["wild", "past the end", "wrong key"])
def test_an_sge_outside_its_region_completes_with_a_protection_error(sge):
    """A scatter/gather element's address is checked against the region its lkey names, not
    trusted: a wild address, one running past the region's end, or another key completes with
    IBV_WC_LOC_PROT_ERR, and the target's region is unchanged."""
    ctx = ferroce.Context("lo", provider="udp")
    pd = ferroce.PD(ctx)
    cq = ferroce.CQ(ctx)
    mr = ferroce.MR(pd, 4096)
    dst = ferroce.MR(pd, 4096)
    a, b = ferroce.QP(pd, cq), ferroce.QP(pd, cq)
    ea, eb = a.endpoint(mr), b.endpoint(dst)
    a.connect(eb)
    b.connect(ea)
    mr.write(b"\xab" * 4096)
    addr, length, lkey = {
        "wild": (0xDEAD0000, 64, mr.lkey),
        "past the end": (mr.addr + 4000, 200, mr.lkey),
        "wrong key": (mr.addr, 64, mr.lkey ^ 0x5A5A00),
    }[sge]
    a.post_send(ferroce.SendWR(1, e.IBV_WR_RDMA_WRITE, [ferroce.SGE(addr, length, lkey)],
                               dst.addr, dst.rkey))
    wc = one(cq)
    assert (wc.wr_id, wc.status) == (1, e.IBV_WC_LOC_PROT_ERR), wc
    assert dst.read(4096) == bytes(4096)
