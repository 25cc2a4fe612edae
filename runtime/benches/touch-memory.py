#!/usr/bin/env python3
"""How fast this machine gives a process new memory.

Allocates 2 GiB and writes one byte per 4 KiB page, then prints the wall and CPU time; run it
several times in a row. With `huge` the memory is an anonymous mapping advised for transparent
huge pages. `runtime/BENCHMARKS.md` ("The heap restore's 2.5 s per GiB against this machine's
memory") has the figures: the first touch of memory is what bounds a heap restore here.

    python3 runtime/benches/touch-memory.py [huge]
"""
import mmap
import resource
import sys
import time

SIZE = 2 << 30
PAGE = 4096


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def main():
    huge = sys.argv[1:] == ["huge"]
    started, (user0, sys0) = time.time(), cpu()
    if huge:
        memory = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        memory.madvise(mmap.MADV_HUGEPAGE)
    else:
        memory = bytearray(SIZE)
    for at in range(0, SIZE, PAGE):
        memory[at] = 1
    user1, sys1 = cpu()
    wall = time.time() - started
    pages = SIZE // PAGE
    print(
        f"{'huge pages' if huge else 'bytearray'}: 2 GiB touched in {wall:.2f} s wall, "
        f"{user1 - user0:.2f} s user, {sys1 - sys0:.2f} s system: "
        f"{(sys1 - sys0) / pages * 1e6:.1f} µs of system time per page"
    )


if __name__ == "__main__":
    main()
