"""Peak memory of `uniweave data convert` at two row counts: flat in the number of rows.

For each count N (`--rows`, default 10000 and 100000) the script writes a synthetic
Zebra-CoT parquet file of N rows (row groups of `--group` rows, written one group at a
time so the writer's memory is bounded too): a question with one inline problem image,
a three-image reasoning trace, a final answer; one row in 50 references a missing image
(a reject). Images are drawn from a pool of 256 small PNGs (32x32 RGB), so the output
holds 256 distinct files whatever N. Then a fresh Python process converts the file
(shard_rows 1000, batch_rows 64) and reports its resident-set high-water mark (VmHWM
from /proc/self/status), its resident size after importing pyarrow, PIL and the
converter (before converting), and the time.

Flat means: peak RSS at 100k rows is within a few MiB of the peak at 10k rows; a
converter that kept rows, rejects or image names in memory would grow with N.

    PYTHONPATH=src .venv/bin/python bench/convert_memory.py [--rows 10000 100000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
import pyarrow, pyarrow.parquet, PIL.Image
from uniweave.data.convert import convert
before = rss("VmRSS:")
start = time.perf_counter()
summary = convert("zebra-cot", sys.argv[1], sys.argv[2], shard_rows=1000, batch_rows=64)
print(json.dumps({"seconds": time.perf_counter() - start, "rss_before_mib": before,
                  "peak_mib": rss("VmHWM:"), "summary": summary}))
"""


def write_source(path: Path, n: int, group: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(0)
    pool = []
    for _ in range(256):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, "PNG")
        pool.append(buf.getvalue())
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema(
        [("Question", pa.string()), ("Text Reasoning Trace", pa.string()),
         ("Final Answer", pa.string()), ("problem_image_1", image)]
        + [(f"reasoning_image_{k}", image) for k in (1, 2, 3)]
    )  # fmt: skip
    trace = (
        "THOUGHT 0: first look. <image_start>[reasoning_image_1]<image_end> THOUGHT 1: "
        "closer. <image_start>[reasoning_image_2]<image_end> THOUGHT 2: check. "
        "<image_start>[reasoning_image_3]<image_end> THOUGHT 3: so the answer follows."
    )
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, n, group):
            rows = []
            for i in range(start, min(n, start + group)):
                cells = [{"bytes": pool[(i * 7 + k) % 256], "path": f"img/{i}_{k}.png"}
                         for k in range(4)]  # fmt: skip
                if i % 50 == 49:
                    cells[2] = None  # reasoning_image_2 missing: a reject
                rows.append({
                    "Question": f"Question {i}: what is shown? "
                    "<image_start>[problem_image_1]<image_end>",
                    "Text Reasoning Trace": trace,
                    "Final Answer": str(i % 10),
                    "problem_image_1": cells[0],
                    "reasoning_image_1": cells[1],
                    "reasoning_image_2": cells[2],
                    "reasoning_image_3": cells[3],
                })  # fmt: skip
            writer.write_table(pa.Table.from_pylist(rows, schema=schema))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--group", type=int, default=1000, help="parquet row group size")
    parser.add_argument("--keep", type=Path, default=None, help="work here (kept) not in /tmp")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        print(f"{'rows':>8} {'converted':>9} {'rejected':>8} {'images':>6} {'shards':>6} "
              f"{'rss before MiB':>14} {'peak RSS MiB':>12} {'seconds':>8} {'rows/s':>7}")  # fmt: skip
        for n in args.rows:
            src, out = root / f"zebra-{n}.parquet", root / f"out-{n}"
            write_source(src, n, args.group)
            result = subprocess.run(
                [sys.executable, "-c", CHILD, str(src), str(out)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            r = json.loads(result.stdout.strip().splitlines()[-1])
            s = r["summary"]
            print(f"{n:>8} {s['rows']:>9} {s['rejected']:>8} {s['images']:>6} {s['shards']:>6} "
                  f"{r['rss_before_mib']:>14.1f} {r['peak_mib']:>12.1f} {r['seconds']:>8.1f} "
                  f"{n / r['seconds']:>7.0f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - start:.1f} s")
