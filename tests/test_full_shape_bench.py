"""`bench/full_shape.py --tiny` (the full-shape CPU bench at `write-full-shape --shape small`
sizes): every phase runs through the real trainer, the measurements are consistent, and
the in-process plan equals what `uniweave plan --host` prints (the bench checks that itself
and exits non-zero otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "full_shape.py"

# fp32 rollout (incremental decode over the KV cache) and fp32 replay (one teacher-forced
# forward) compute the same log-softmax with different kernels and summation orders:
# each rounding is ~eps32 x |log p| <= 1.2e-7 x ln(102400) ~ 1.4e-6, and 1e-4 allows ~70 of
# them to line up; one bf16 rounding anywhere (2^-8 ~ 4e-3 relative) would exceed it.
FP32_GAP_BOUND = 1e-4


def test_tiny_bench_runs_every_phase_and_reports_consistent_figures(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(BENCH), "--tiny", "--one-process", "--precisions", "fp32",
           "--threads", "1", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("result: ")
    result = dict(kv.split("=", 1) for kv in last[len("result: ") :].split())
    rows = json.loads(out.read_text())["rows"]
    assert [r["phase"] for r in rows] == ["t2i", "i2t", "opd", "sft"]
    for r in rows:
        key = f"{r['phase']}_fp32"
        assert float(result[f"{key}_peak_gib"]) > 0 and float(result[f"{key}_plan_ratio"]) > 0
        # the step's high-water mark starts at the RSS it was reset to
        assert r["step_peak"] >= r["rss_before"] > 0
        assert r["step_s"] > 0 and r["loss"] == r["loss"]  # finite loss (not NaN)
    for phase in ("t2i", "i2t"):  # GRPO: the trainer's own rollout-vs-replay diagnostic
        row = next(r for r in rows if r["phase"] == phase)
        assert 0.0 <= row["gap_mean"] <= row["gap_max"] < FP32_GAP_BOUND
        assert float(result[f"{phase}_fp32_gap_max"]) == float(f"{row['gap_max']:.3g}")
    t2i = next(r for r in rows if r["phase"] == "t2i")
    assert t2i["new_tokens"] == t2i["image_tokens"] == 16  # the small shape's 4x4 grid
