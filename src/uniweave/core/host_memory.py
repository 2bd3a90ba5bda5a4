"""`run.host_mmap_threshold`: how the C library's allocator returns host memory.

torch allocates CPU tensors with the C library's `posix_memalign`. glibc serves a block
at or above its mmap threshold with its own `mmap` and gives it back to the kernel with
`munmap` when the tensor is freed; a smaller block comes from the heap, whose freed
pages stay in the process (resident) until the top of the heap happens to be free.
glibc starts the threshold at 128 KiB and, by default, raises it to the size of every
mmapped block that is freed, up to 32 MiB. A training step frees blocks of a few MiB to
a few tens of MiB (a layer's MLP activations, a chunk of logits), so after the first
layer the threshold sits at 32 MiB and the rest of the step's temporaries come from the
heap and stay resident: on the Janus-Pro-1B SFT step (bench/full_shape.py, fp32, LoRA,
gradient checkpointing) the resident set grew 4.56 GiB over the weights, against 0.52 GiB
with the threshold fixed at 1 MiB.

Fixing the threshold (`mallopt(M_MMAP_THRESHOLD, n)`, which also stops glibc's dynamic
adjustment) makes every block of n bytes or more go back to the kernel when freed, so
the resident set follows the live tensors and `uniweave plan --host` can predict it
(docs/plan.md). The cost is one `mmap`/`munmap` pair and fresh zero-filled pages per
large block: within noise in fp32 (that SFT step: 47.5 s at 1 MiB, 49.2 s unset), but
1.45-2.09x slower steps under CPU bf16 autocast, which re-casts every frozen weight at
every forward (docs/plan.md has the table), and on the tiny recipes, whose steps are
short, 1.6x slower runs (bench/step_overhead.py). So the default is `None`, which leaves
the allocator as the environment configured it (glibc's dynamic default, or a
`MALLOC_MMAP_THRESHOLD_` variable), and `uniweave plan --host` then prints the range of
peaks glibc's retention allowed at Janus-Pro-1B instead of one figure
(`uniweave.plan.GLIBC_RETENTION`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>
MAX_THRESHOLD = 32 * 1024 * 1024  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: mallopt refuses more


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else ctypes.CDLL(None)
    except OSError:
        return None


def set_mmap_threshold(nbytes: int | None) -> str | None:
    """Apply `run.host_mmap_threshold` to this process. Returns None when applied (or
    nothing was asked), else the one line the run's log prints: why it was not applied.
    The setting is process-wide and stays until the process ends or the threshold is set
    again. ValueError for a value glibc refuses."""
    if nbytes is None:
        return None
    if not 0 < nbytes <= MAX_THRESHOLD:
        raise ValueError(f"run.host_mmap_threshold={nbytes}: must be in 1..{MAX_THRESHOLD}")
    lib, version = platform.libc_ver()
    libc = _libc()
    if lib != "glibc" or libc is None or not hasattr(libc, "mallopt"):
        return (
            f"run.host_mmap_threshold={nbytes}: not applied, this C library is "
            f"{lib or platform.system()}, not glibc (its allocator keeps its own policy)"
        )
    if libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(nbytes)) != 1:
        raise ValueError(f"run.host_mmap_threshold={nbytes}: glibc {version} refused it")
    return None


def apply_mmap_threshold(nbytes: int | None) -> None:
    """`set_mmap_threshold` for a process that starts a run (`uniweave train`, `uniweave eval`, a
    Ray actor, bench/full_shape.py): the line saying why it was not applied goes to the
    process's log."""
    note = set_mmap_threshold(nbytes)
    if note is not None:
        print(note, flush=True)
