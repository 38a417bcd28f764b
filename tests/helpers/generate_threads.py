"""generate.py's main under torchrun, then the threads still running in this rank: what
the interpreter would find alive at exit (tests/test_generate.py).

    PYTHONPATH=. torchrun --nproc_per_node 2 tests/helpers/generate_threads.py --run-dir RUN --prompt x

Prints "rank R: threads after main: NAME NAME ..." (Linux thread names: gloo's workers
are pt_gloo_runloop, its transport's socket loops gloo_tcp_loop) and exits with main's code.
"""
import glob
import os
import sys

import generate  # the repository root on PYTHONPATH (the test sets it)


def thread_names():
    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended while listed
            pass
    return sorted(names)


if __name__ == "__main__":
    code = generate.main(sys.argv[1:])
    # one write(2) of under PIPE_BUF bytes: the two ranks' lines cannot interleave
    line = f"rank {os.environ['RANK']}: threads after main: {' '.join(thread_names())}\n"
    sys.stdout.flush()
    os.write(1, line.encode())
    sys.exit(code)
