#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets for what peers control (shm_ring, shm_hello,
coll_store, cm_exchange): a few meaningful inputs each, laid out as each target reads its
input (see the targets' module docs). Run from anywhere; rewrites fuzz/corpus/<target>/seed-*.
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(bytes(data))


# shm_ring: size byte (64 + 8 * (b % 57)), mode byte, [mode data], fill byte, then steps:
# 0..4 push (kind byte, [length]), 5..9 pop (kind byte, [length]), 10 room_for then push,
# 11 new producer, 12..15 poke (where, [index], kind, [value]).
def push(n):  # a push of n % (max_packet + 1) bytes
    return [0, 4, n]


POP = [5, 2]
write("shm_ring", "clean-64", [0, 0, 0] + (push(5) + push(16) + POP + push(9) + POP + POP) * 8)
write("shm_ring", "clean-256-wraps", [24, 0, 0] + (push(60) + push(40) + POP + push(33) + POP + POP + [10, 40, 20]) * 10)
write("shm_ring", "clean-at-position", [8, 1] + list(struct.pack("<Q", 0x1234_5678_9000)) + [0] + (push(7) + POP) * 20)
# The peer moves the head a record on, writes a wrap marker, rewrites the tail, then a pop.
write("shm_ring", "pokes", [8, 0, 0] + push(20) + [12, 0, 3, 1] + POP + [13, 2, 0, 0, 4] + POP + [12, 1, 2, 0xff] + push(9) + POP + [12, 0, 0] + list(struct.pack("<Q", 1 << 40)) + POP)
write("shm_ring", "garbage-data", [16, 3, 2] + list(struct.pack("<Q", 64)) + list(struct.pack("<H", 0)) + [1] + [0x10, 0, 0, 0, 0, 0, 0, 0] * 24 + [0] + POP * 6)

# shm_hello: any message; a good hello, and one with a byte too many.
hello = b"FRSH" + bytes([2, 0, 0, 0]) + struct.pack("<II", 0x11, 0x22)
write("shm_hello", "hello", hello)
write("shm_hello", "long", hello + b"\0")
write("shm_hello", "reserved-set", hello[:5] + b"\x01" + hello[6:])

# coll_store: 32 bytes of choices, then the peer's bytes.
def choices(*b):
    out = bytes(b)
    return out + bytes(32 - len(out))


def store_hello(rank, world, token=b""):
    return b"FRC2" + struct.pack(">III", 8 + len(token), rank, world) + token


# Hello step: pass 0, no built hello (flag 0), piece size, seed, eof.
write("coll_store", "hello-whole", choices(0, 0, 0, 64, 0, 7, 0, 0, 0, 1) + store_hello(1, 4, b"secret"))
write("coll_store", "hello-trickle", choices(0, 0, 1, 0, 3, 0, 0, 0, 0) + store_hello(3, 8))
write("coll_store", "hello-oversized", choices(0, 0, 0, 16, 1, 0, 0, 0, 1) + b"FRC2" + struct.pack(">I", 4096))
write("coll_store", "hello-http", choices(0, 0, 0, 16, 1, 0, 0, 0, 1) + b"GET / HTTP/1.0\r\n\r\n")
# Message reader: pass 1, limit 4096 (kind 2), no length prefix added (flag 0).
write("coll_store", "msg", choices(1, 2, 0) + struct.pack(">I", 5) + b"hello")
write("coll_store", "msg-lying-length", choices(1, 0, 0) + struct.pack(">I", 1 << 24) + b"x" * 20)
# Table reader: pass 2, round, n, round prefix flag 1.
cards = [b"a", b"", b"ccc"]
table = b"".join(struct.pack(">I", len(c)) + c for c in cards)
write("coll_store", "table", choices(2, *struct.pack("<Q", 7), 3, 1) + table)
write("coll_store", "table-abort", choices(2, *struct.pack("<Q", 7), 2, 0) + b"\xff" * 8 + b"rank 2 left")

# cm_exchange: ENDPOINTS messages as a peer sends them, and READY.
def endpoint(qpn, region=True):
    flags = (1 if region else 0) | 2
    gid = bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 1])
    r = struct.pack(">QQI", 0x7F00_0000_1000, 1 << 20, 0x1234) if region else bytes(20)
    return struct.pack(">II", qpn, 0xABCDEF) + gid + struct.pack(">HHBB", 4791, 1024, 16, flags) + bytes(2) + r + bytes(4)


def message(kind, eps):
    body = b"".join(eps)
    return b"FRCE" + bytes([1, kind]) + struct.pack(">HI", len(eps), len(body)) + body


write("cm_exchange", "one", message(1, [endpoint(0x11)]))
write("cm_exchange", "three", message(1, [endpoint(0x11), endpoint(0x12, False), endpoint(0x13)]))
write("cm_exchange", "ready", message(2, []))

# rdmacm_messages: REQ, REJ and RTU as a peer sends them (REQ and REP also with an ECE).
req = b"FRCM" + bytes([1]) + struct.pack(">II", 0x12, 0x345) + bytes(range(16)) + bytes([3, 16, 16, 7, 7, 8]) + b"perftest"
write("rdmacm_messages", "req", req)
# The same REQ with the sender's ECE (kind 6): ferroce's vendor, selective repeat; and a REP
# with one (kind 7).
write("rdmacm_messages", "req-ece", b"FRCM" + bytes([6]) + req[5:] + struct.pack(">II", 0x46524345, 1))
write("rdmacm_messages", "rep-ece", b"FRCM" + bytes([7]) + req[5:] + struct.pack(">II", 0x15B3, 0x10000001))
write("rdmacm_messages", "rej", b"FRCM" + bytes([3, 3]) + b"abc")
write("rdmacm_messages", "rtu-dreq", b"FRCM\x04FRCM\x05")
