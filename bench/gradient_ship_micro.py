#!/usr/bin/env python
"""One shipped gradient's frames and their decode, pickled NOTIFY against the gradient layout.

    python bench/gradient_ship_micro.py [N ...]

In one process, no socket: a 64 x N float32 gradient with the arguments
``native_pass._ship`` gives ``engine._propagate``. "pickled" is what a gradient cost
before ``Kind.GRADS`` (``dumps`` + ``encode_fast`` on the sender; ``fast_header`` +
``decode_fast`` + ``loads`` on the receiver), "binary" the gradient layout
(``encode_grads``; ``fast_header`` + ``decode_fast`` + ``grads_args``). Printed: the
median over 7 rounds of 3,000 calls of each, in microseconds of the thread's CPU.
Both decode to the same arguments (checked first).
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

import distgrad
from distgrad.autograd.engine import _propagate
from distgrad.wire import Kind, dumps, encode_fast, loads
from distgrad.wire.fast_header import decode_fast, encode_grads, fast_header, grads_args

_WHAT = "distgrad.autograd.engine._propagate"


def _cpu_us(fn, *args, reps: int = 3000) -> float:
    out = []
    for _ in range(7):
        t0 = time.thread_time_ns()
        for _ in range(reps):
            fn(*args)
        out.append((time.thread_time_ns() - t0) / reps / 1e3)
    return statistics.median(out)


def main(sizes: list[int]) -> None:
    print(f"message path: {distgrad.info()['message_path']}")
    for n in sizes:
        args = ((7 << 48) | 5, (0, 12345), 0, 0, (3 << 48) | 99, [torch.randn(64, n)], 3, [])

        def send_pickled(args=args):
            payload, tensors = dumps((_propagate, args, {}))
            return encode_fast(Kind.NOTIFY, 1, _WHAT, payload, tensors)

        def send_binary(args=args):
            return encode_grads(1, args)

        def recv_pickled(frames):
            msg = decode_fast(frames, 1, fast_header(frames))
            return loads(msg.payload, msg.specs, msg.buffers, tensors=msg.tensors)[1]

        def recv_binary(frames):
            return grads_args(decode_fast(frames, 1, fast_header(frames)))

        old = [bytearray(f) for f in send_pickled()]
        new = [bytearray(f) for f in send_binary()]
        a, b = recv_pickled(old), recv_binary(new)
        assert a[:5] == b[:5] and a[6:] == b[6:] and torch.equal(a[5][0], b[5][0])
        print(f"64 x {n}: send pickled {_cpu_us(send_pickled):.2f} us, "
              f"binary {_cpu_us(send_binary):.2f} us; receive pickled {_cpu_us(recv_pickled, old):.2f} us, "
              f"binary {_cpu_us(recv_binary, new):.2f} us")


if __name__ == "__main__":
    main([int(s) for s in sys.argv[1:]] or [16, 256])
