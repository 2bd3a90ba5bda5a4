"""A fresh interpreter that frees host temporaries under a given `run.host_mmap_threshold`
and reports what stayed resident (tests/test_host_memory.py, the knob's probe in
tests/test_knobs.py). Each call is its own process: the threshold is process-wide and
glibc's dynamic adjustment, once stopped, cannot be restarted in the process that
stopped it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MiB = 2**20

# A step's pattern in miniature: one 24 MiB temporary freed (glibc then raises its dynamic
# threshold to 24 MiB, and its heap-trim threshold to twice that), then 8 temporaries of
# 4 MiB (a layer's MLP activations, a chunk of logits) written and freed.
PATTERN = textwrap.dedent(
    """
    import sys, torch
    from uniweave.core.host_memory import set_mmap_threshold
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    value = None if sys.argv[1] == "none" else int(sys.argv[1])
    assert set_mmap_threshold(value) is None
    torch.ones(64).add_(1)  # the first op's one-off runtime setup (1.5-5.6 MB) before the base
    base = rss()
    big = torch.ones(24 * 2**20 // 4)
    del big
    temporaries = [torch.ones(2**20) for _ in range(8)]
    peak = rss()
    temporaries.clear()
    print(peak - base, rss() - base)
    """
)


def resident_after_free(value: str) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", PATTERN, value],
        env={"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    peak, after = (int(x) for x in out.stdout.split())
    return peak, after
