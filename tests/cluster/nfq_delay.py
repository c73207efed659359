#!/usr/bin/python3 -IS
"""Delay (and optionally drop) packets with an iptables NFQUEUE, via raw netlink.

Run inside a network namespace (``ip netns exec NS python3 nfq_delay.py ...``) *before*
the ``-j NFQUEUE --queue-num Q --queue-bypass`` rule is inserted; it prints ``READY`` once
it is bound.  Each queued packet is held for ``--delay-ms`` then accepted (or dropped
with probability ``--loss`` percent).  On SIGTERM/SIGINT it accepts everything it still
holds and exits.  Stdlib only (the kernel here has no ``tc netem``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN = 1
NLM_F_REQUEST = 1
NLM_F_ACK = 4
NLMSG_ERROR = 2
NF_DROP = 0
NF_ACCEPT = 1


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * ((4 - length % 4) % 4)


class Queue:
    def __init__(self, num: int) -> None:
        self.num = num
        self.seq = 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind((0, 0))

    def _send(self, msg_type: int, attrs: bytes, flags: int = NLM_F_REQUEST) -> None:
        self.seq += 1
        body = struct.pack("!BBH", socket.AF_UNSPEC, 0, self.num) + attrs
        hdr = struct.pack(
            "=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags, self.seq, 0
        )
        self.sock.send(hdr + body)

    def _config(self, attrs: bytes) -> None:
        self._send(NFQNL_MSG_CONFIG, attrs, NLM_F_REQUEST | NLM_F_ACK)
        data = self.sock.recv(65536)
        _length, kind, _f, _s, _p = struct.unpack_from("=IHHII", data)
        if kind == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, 16)
            if err:
                raise OSError(-err, os.strerror(-err))

    def bind(self, maxlen: int) -> None:
        self._config(_attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, 0)))
        self._config(_attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)))
        self._config(_attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen)))
        flags = struct.pack("!I", NFQA_CFG_F_FAIL_OPEN)
        self._config(_attr(NFQA_CFG_MASK, flags) + _attr(NFQA_CFG_FLAGS, flags))
        self.sock.setblocking(False)

    def verdict(self, packet_id: int, verdict: int) -> None:
        self._send(
            NFQNL_MSG_VERDICT, _attr(NFQA_VERDICT_HDR, struct.pack("!II", verdict, packet_id))
        )

    def packet_ids(self) -> list[int]:
        """Ids of all packets the kernel has queued to us so far (non-blocking)."""
        ids: list[int] = []
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except BlockingIOError:
                return ids
            except OSError:  # ENOBUFS: the kernel dropped messages (fail-open keeps traffic)
                continue
            off = 0
            while off + 16 <= len(data):
                length, kind, _f, _s, _p = struct.unpack_from("=IHHII", data, off)
                if length < 16:
                    break
                if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    pos, end = off + 20, off + length
                    while pos + 4 <= end:
                        alen, atype = struct.unpack_from("=HH", data, pos)
                        if alen < 4:
                            break
                        if atype & 0x3FFF == NFQA_PACKET_HDR:
                            ids.append(struct.unpack_from("!I", data, pos + 4)[0])
                            break
                        pos += (alen + 3) & ~3
                off += (length + 3) & ~3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queue", type=int, default=0)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--loss", type=float, default=0.0, help="percent of packets dropped")
    ap.add_argument("--maxlen", type=int, default=65536)
    args = ap.parse_args()
    delay = args.delay_ms / 1000.0
    loss = args.loss / 100.0
    q = Queue(args.queue)
    q.bind(args.maxlen)
    held: collections.deque[tuple[float, int]] = collections.deque()
    stop = False

    def on_signal(_signo: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    for signo in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signo, on_signal)
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    while not stop:
        now = time.monotonic()
        timeout = max(0.0, held[0][0] - now) if held else 1.0
        with contextlib.suppress(InterruptedError):
            select.select([q.sock], [], [], timeout)
        now = time.monotonic()
        for pid in q.packet_ids():
            if loss and random.random() < loss:
                q.verdict(pid, NF_DROP)
            elif delay <= 0:
                q.verdict(pid, NF_ACCEPT)
            else:
                held.append((now + delay, pid))
        while held and held[0][0] <= now:
            q.verdict(held.popleft()[1], NF_ACCEPT)
    while held:
        q.verdict(held.popleft()[1], NF_ACCEPT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
