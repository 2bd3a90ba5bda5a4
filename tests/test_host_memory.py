"""`run.host_mmap_threshold` (uniweave.core.host_memory): with glibc's dynamic threshold a
freed mid-size tensor stays resident; with the threshold fixed it goes back to the OS.

Each case runs in a fresh interpreter: the threshold is process-wide and glibc's dynamic
adjustment, once stopped, cannot be restarted in the process that stopped it.
"""

from __future__ import annotations

import platform

import pytest
from allocator_helpers import MiB, resident_after_free

from uniweave.config import ConfigError, load_config
from uniweave.core.host_memory import MAX_THRESHOLD

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's"
)


def test_a_fixed_threshold_returns_freed_tensors_and_the_dynamic_one_keeps_them():
    """The 8 x 4 MiB = 32 MiB of temporaries are resident at the peak either way. Freed,
    they stay resident under glibc's dynamic threshold (the first free raised it to
    24 MiB, so the 4 MiB blocks came from the heap, and the heap is trimmed only when
    its free top exceeds 48 MiB) and leave under the fixed 1 MiB one (each block was its
    own mapping, unmapped when freed). Bounds: the whole 32 MiB less one block stays in
    the first case; less than one block (4 MiB) in the second."""
    peak_dyn, after_dyn = resident_after_free("none")
    peak_fix, after_fix = resident_after_free(str(MiB))
    for peak in (peak_dyn, peak_fix):
        # every page of the 8 blocks was written; up to 1 MiB of them may land on heap
        # pages resident before the base (glibc's 128 KiB top pad, the warm-up's freed
        # pages), which add nothing to RSS (seen: 33,501,184 bytes = 32 MiB - 52 KiB)
        assert peak >= 31 * MiB, peak
    assert after_dyn >= 28 * MiB, after_dyn
    assert after_fix < 4 * MiB, after_fix


@pytest.mark.parametrize("value", [0, MAX_THRESHOLD + 1])
def test_values_glibc_would_refuse_are_config_errors(tmp_path, value):
    path = tmp_path / "c.yaml"
    path.write_text(f"run:\n  host_mmap_threshold: {value}\n")
    with pytest.raises(ConfigError, match="host_mmap_threshold"):
        load_config(path)
    # the schema's bound is glibc's own limit, which the process setting also accepts
    path.write_text(f"run:\n  host_mmap_threshold: {MAX_THRESHOLD}\n")
    assert load_config(path).run.host_mmap_threshold == MAX_THRESHOLD == 32 * MiB
