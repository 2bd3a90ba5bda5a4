"""`summary.json` and `index.html` of an evaluation, computed from its records.

Per task and over all rows, with n rollouts per sample and total reward r_{i,m}:

- `mean@n` = mean_i (1/n) sum_m r_{i,m}; `pass@n` = mean_i [max_m passed_{i,m}], where a
  rollout passes when r >= `evaluation.pass_threshold` (`uniweave.rewards.passes`);
- the task's headline metric, when it declares one (`uniweave.rewards.TASK_VERIFIERS`):
  `accuracy`, `score` or `exact_match`, equal to its `mean@n` (the names the digits
  evaluations have always reported, read by `uniweave demo`, `bench/` and eval.json users);
- `<plugin>/mean`: each plugin's mean score over the rollouts it scored;
- `invalid_frac`: share of rollouts a plugin scoring them found malformed;
- `finish_<reason>_frac`: share of rollouts per finish reason;
- `n_samples`, `n_rollouts`;
- for rows whose records carry the masked-image probe (`draw_then_answer`,
  `uniweave.eval.masked`): `exact_match_unmasked`, `exact_match_masked_image`,
  `masked_drop`, over those rollouts.

The HTML page is one table (prompt, prompt images, generated images, response, finish
reason, total and plugin scores); clicking a column header sorts by it.
"""

from __future__ import annotations

import html
import json
from collections import Counter, defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from uniweave.core.atomic import write_json_atomic, write_text_atomic
from uniweave.eval.masked import masked_metrics
from uniweave.eval.records import printable

SUMMARY = "summary.json"
PAGE = "index.html"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _stats(records: list[dict[str, Any]], headline: str | None = None) -> dict[str, float]:
    by_id: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_id[r["id"]].append(r)
    mean_n = _mean([_mean([r["total"] for r in rs]) for rs in by_id.values()])
    out = {
        "n_samples": float(len(by_id)),
        "n_rollouts": float(len(records)),
        "mean@n": mean_n,
        "pass@n": _mean([float(any(r["passed"] for r in rs)) for rs in by_id.values()]),
        "invalid_frac": _mean([float(bool(r.get("invalid"))) for r in records]),
    }
    if headline is not None:
        out[headline] = mean_n
    plugins = sorted({k for r in records for k in r["scores"]})
    for name in plugins:
        out[f"{name}/mean"] = _mean([r["scores"][name] for r in records if name in r["scores"]])
    for reason, count in sorted(Counter(r["finish_reason"] for r in records).items()):
        out[f"finish_{reason}_frac"] = count / len(records)
    probed = [r["masked"] for r in records if "masked" in r]
    if probed:
        out.update(
            masked_metrics([p["unmasked"] for p in probed], [p["masked_image"] for p in probed])
        )
    return out


def summarize(
    records: list[dict[str, Any]], n: int, headline: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The summary of `records` (module docstring), overall and per task; `headline`
    maps a task to the name of its headline metric."""
    headline = headline or {}
    tasks = sorted({str(r["task"]) for r in records})
    return {
        "rollouts_per_sample": n,
        "all": _stats(records),
        "tasks": {
            t: _stats([r for r in records if str(r["task"]) == t], headline.get(t)) for t in tasks
        },
    }


def write_json(path: Path, data: Any) -> None:
    """Write `data` as JSON atomically (`uniweave.core.atomic`)."""
    write_json_atomic(path, data, indent=2, sort_keys=True)


_SORT_JS = """
function sortBy(col) {
  const body = document.querySelector("tbody");
  const rows = Array.from(body.rows);
  const key = r => r.cells[col].dataset.v ?? r.cells[col].textContent;
  const num = rows.every(r => !isNaN(parseFloat(key(r))));
  const dir = body.dataset.col == col && body.dataset.dir == "1" ? -1 : 1;
  rows.sort((a, b) => dir * (num ? parseFloat(key(a)) - parseFloat(key(b))
                                 : key(a).localeCompare(key(b))));
  body.dataset.col = col; body.dataset.dir = dir;
  rows.forEach(r => body.appendChild(r));
}
"""


def _imgs(paths: list[str]) -> str:
    return "".join(f'<img src="{html.escape(p)}" width="96" alt="{html.escape(p)}">' for p in paths)


def write_page(path: Path, records: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """The sortable results page (module docstring), written atomically."""
    plugins = sorted({k for r in records for k in r["scores"]})
    heads = [
        "id",
        "task",
        "member",
        "prompt",
        "prompt images",
        "images",
        "response",
        "finish",
        "total",
        *plugins,
    ]
    th = "".join(f'<th onclick="sortBy({k})">{html.escape(h)}</th>' for k, h in enumerate(heads))
    rows = []
    for r in records:
        cells = [
            f"<td>{html.escape(r['id'])}</td>",
            f"<td>{html.escape(str(r['task']))}</td>",
            f"<td>{r['member']}</td>",
            f"<td><pre>{html.escape(printable(r['prompt']))}</pre></td>",
            f"<td>{_imgs(r['prompt_images'])}</td>",
            f"<td>{_imgs(r['images'])}</td>",
            f"<td><pre>{html.escape(printable(r['response']))}</pre></td>",
            f"<td>{html.escape(r['finish_reason'])}</td>",
            f'<td data-v="{r["total"]}">{r["total"]:.4g}</td>',
            *(
                f'<td data-v="{r["scores"][p]}">{r["scores"][p]:.4g}</td>'
                if p in r["scores"]
                else '<td data-v="-1">-</td>'
                for p in plugins
            ),
        ]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    overall = html.escape(json.dumps(summary["all"], sort_keys=True))
    page = (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>uniweave eval</title>'
        "<style>table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px;"
        "vertical-align:top}th{cursor:pointer;background:#eee}img{image-rendering:pixelated;"
        "margin:2px}pre{white-space:pre-wrap;max-width:32em;margin:0}</style>"
        f"<script>{_SORT_JS}</script></head><body><h1>uniweave eval</h1><p>{overall}</p>"
        f"<table><thead><tr>{th}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
        "</body></html>\n"
    )
    write_text_atomic(path, page)
