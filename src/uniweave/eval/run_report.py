"""`report.md` + `report.html` (+ `report.json`) of a run directory, and the side-by-side
comparison of two runs (`uniweave report RUN_DIR`, `uniweave report A B`; docs/reports.md).

Everything is read from the run directory, so a report can be rebuilt at any time:
`config.yaml` (the `health:` thresholds), `config_hash`, `evals/<split>-update-NNNNNN/`
(the evaluator's records) and `metrics.jsonl` (curves, and the alarms replayed through
`uniweave.eval.health.HealthMonitor`). Writing a report also (re)draws the run's
`curves.png` (`uniweave.eval.curves`: one panel per signal, no constant or duplicate
curve).

Sections, in order: alarms; the run (config hash, parent: `model.path` and, when it is
another run's `model/`, that run's config hash); one verdict line per (split, task,
metric) — the latest evaluation against the baseline (update 0), with the paired test of
`uniweave.eval.paired`; the held-out table (value at every evaluation, and its paired
difference ± SE from the start); the training curves (`curves.png`, what it left out, and
each curve's least-squares drift and residual noise, `uniweave.eval.drift`); a gallery of
the first rows of every task at the baseline and at the latest evaluation, the same in
both files: text escaped (HTML in the html, `md_text` in the markdown), control
characters as escapes (`printable`), the prompt's and the response's images (`<img>`
tags: relative paths in the markdown, base64 data URIs in the self-contained html).

Files are written atomically (temporary + rename), so a reader never sees half a report.
"""

from __future__ import annotations

import base64
import html
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from uniweave.config import HealthConfig
from uniweave.core.atomic import write_text_atomic
from uniweave.eval import curves as training_curves
from uniweave.eval.drift import DriftNoise, drift_to_noise
from uniweave.eval.health import Alarm, HealthMonitor, once_each
from uniweave.eval.paired import ALL, Paired, compare, per_prompt, read_records
from uniweave.eval.records import printable

EVALS = "evals"
METRICS = "metrics.jsonl"
REPORT_MD, REPORT_HTML, REPORT_JSON = "report.md", "report.html", "report.json"
COMPARE_MD, COMPARE_HTML = "compare.md", "compare.html"
CURVES_PNG = "curves.png"
GALLERY_ROWS = 3
GALLERY_HEAD = ["task", "prompt", "response", "images", "finish", "reward"]
_EVAL_DIR = re.compile(r"^(train|val|test)-update-(\d{6})$")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def eval_dirs(run_dir: Path) -> dict[str, list[tuple[int, Path]]]:
    """split -> [(update, directory)] of the run's evaluations that have records, by update."""
    out: dict[str, list[tuple[int, Path]]] = defaultdict(list)
    root = Path(run_dir) / EVALS
    if root.is_dir():
        for d in sorted(root.iterdir()):
            m = _EVAL_DIR.match(d.name)
            if m and (d / "results.jsonl").is_file():
                out[m.group(1)].append((int(m.group(2)), d))
    return {k: sorted(v) for k, v in sorted(out.items())}


def _config(run_dir: Path) -> dict[str, Any]:
    """The run's recorded config (`config.yaml`); {} (the defaults) without one."""
    path = Path(run_dir) / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def _run_of(path: str) -> tuple[str, str] | None:
    """(run directory, config hash) when `path` (a `model/` or `adapter/`) sits in a run."""
    hash_file = Path(path).parent / "config_hash"
    if hash_file.is_file():
        return str(Path(path).parent), hash_file.read_text().strip()
    return None


def _parent(cfg: dict[str, Any]) -> dict[str, str] | None:
    """Where the run started from: `model.path` (and the run it came from), the
    `model.initial_adapter` (and its run) and `run.parent` (docs/campaigns.md)."""
    model = cfg.get("model") or {}
    path, adapter = model.get("path"), model.get("initial_adapter")
    run_parent = (cfg.get("run") or {}).get("parent")
    if not path and not run_parent:
        return None
    parent: dict[str, str] = {}
    if path:
        parent["model_path"] = str(path)
        found = _run_of(path)
        if found is not None:
            parent["run_dir"], parent["config_hash"] = found
    if adapter:
        parent["initial_adapter"] = str(adapter)
        found = _run_of(adapter)
        if found is not None:
            parent["adapter_run_dir"], parent["adapter_config_hash"] = found
    if run_parent:
        parent["run_parent"] = str(run_parent)
    return parent


def _collect(run_dir: Path) -> dict[str, Any]:
    """Everything a report shows, computed from the run directory (module docstring)."""
    run_dir = Path(run_dir)
    cfg = _config(run_dir)
    health = HealthConfig(**(cfg.get("health") or {}))
    z = health.heldout_se
    hash_file = run_dir / "config_hash"
    monitor = HealthMonitor(health)
    records = _read_jsonl(run_dir / METRICS)
    events: list[tuple[int, int, Any]] = [(r.get("update", 0), 0, r) for r in records]
    evals = eval_dirs(run_dir)
    splits: dict[str, Any] = {}
    for split, runs in evals.items():
        loaded = [(u, d, read_records(d)) for u, d in runs]
        base = loaded[0] if loaded[0][0] == 0 else None
        steps = []
        for u, d, recs in loaded:
            comps = compare(base[2], recs, z) if base is not None and u > 0 else []
            steps.append({"update": u, "dir": d, "records": recs, "comparisons": comps})
            if comps:
                events.append((u, 1, (split, comps)))
        splits[split] = {"baseline": base is not None, "steps": steps}
    for update, kind, payload in sorted(events, key=lambda e: (e[0], e[1])):
        if kind == 0:
            monitor.observe(update, payload)
        else:
            monitor.heldout(update, *payload)
    panels = training_curves.select(records)
    curves = [(x.key, x.points, f) for x in panels.series if (f := _fit(x)) is not None]
    return {
        "run_dir": run_dir,
        "name": (cfg.get("run") or {}).get("name", ""),
        "algorithm": (cfg.get("algorithm") or {}).get("name", "?"),
        "config_hash": hash_file.read_text().strip() if hash_file.is_file() else "?",
        "parent": _parent(cfg),
        "updates": max((r.get("update", 0) for r in records), default=0),
        "total_updates": (cfg.get("trainer") or {}).get("total_updates"),
        "done": (run_dir / "DONE").is_file(),
        "health": health,
        "z": z,
        "alarms": monitor.fired,
        "splits": splits,
        "curves": curves,
        "panels": panels,
        "curves_png": run_dir / CURVES_PNG,
    }


def _fit(series: training_curves.Series) -> DriftNoise | None:
    """A drawn curve's least-squares drift and residual noise (>= 3 points)."""
    return drift_to_noise(series.values) if len(series.points) >= 3 else None


def verdicts(data: dict[str, Any]) -> list[tuple[str, Paired]]:
    """(split, comparison) of every split's latest evaluation against its baseline."""
    out: list[tuple[str, Paired]] = []
    for split, s in data["splits"].items():
        last = s["steps"][-1]
        out.extend((split, p) for p in last["comparisons"])
    return out


# -- markdown ---------------------------------------------------------------------------


def _fmt_paired(p: Paired | None) -> str:
    if p is None:
        return "-"
    return f"{p.after:.3f} ({p.diff:+.3f} ± {p.se:.3f})"


def _heldout_rows(split: str, s: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of a split's held-out table: value at each evaluation (and, after
    the baseline, its paired diff ± SE from the start)."""
    steps = s["steps"]
    head = ["task", "metric", *(f"update {st['update']}" for st in steps)]

    firsts = [per_prompt(st["records"]) for st in steps]
    tasks = {t for pp in firsts for t in pp if t != ALL}
    keys = sorted(
        {(t, m) for pp in firsts for t in pp for m in pp[t] if t != ALL or len(tasks) > 1}
    )
    rows = []
    for task, metric in keys:
        row = [task, metric]
        for st, pp in zip(steps, firsts):
            comp = next(
                (p for p in st["comparisons"] if p.task == task and p.metric == metric), None
            )
            vals = pp.get(task, {}).get(metric, {})
            if comp is not None:
                row.append(_fmt_paired(comp))
            elif vals:
                row.append(f"{sum(vals.values()) / len(vals):.3f}")
            else:
                row.append("-")
        rows.append(row)
    return head, rows


class Markup(str):
    """A markdown cell that is markup of ours (the gallery's `<img>` tags), not text."""


def md_text(text: object) -> str:
    """`text` for markdown: `&` and `<` as entities (a markdown renderer would read `<b>`
    as a tag and `&amp;` as `&`; `>` alone opens nothing and stays readable) and on one
    line (a table cell)."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace("\n", " ")


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    def esc(c: object) -> str:
        return (c if isinstance(c, Markup) else md_text(c)).replace("|", "\\|")

    return [
        "| " + " | ".join(map(esc, head)) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(map(esc, r)) + " |" for r in rows),
    ]


def _curve_row(key: str, fit: DriftNoise) -> list[str]:
    return [
        key,
        str(fit.n),
        f"{fit.first_mean:.4g}",
        f"{fit.last_mean:.4g}",
        f"{fit.drift:+.4g}",
        f"{fit.noise:.4g}",
        f"{fit.ratio:.2f}",
    ]


CURVE_HEAD = ["metric", "updates", "first-10 mean", "last-10 mean", "drift", "noise", "drift/noise"]


def _gallery(s: dict[str, Any]) -> list[tuple[int, list[dict[str, Any]]]]:
    """(update, records) of the first and the latest evaluation: member 0 of the first
    `GALLERY_ROWS` rows of every task."""
    steps = s["steps"]
    chosen = [steps[0]] if len(steps) == 1 else [steps[0], steps[-1]]
    out = []
    for st in chosen:
        seen: dict[str, int] = defaultdict(int)
        picked = []
        for r in st["records"]:
            if r.get("member", 0) != 0 or seen[str(r["task"])] >= GALLERY_ROWS:
                continue
            seen[str(r["task"])] += 1
            picked.append({**r, "_dir": st["dir"]})
        out.append((st["update"], picked))
    return out


def _gallery_images(record: dict[str, Any]) -> list[str]:
    """A gallery record's images on disk (the prompt's, then the response's), relative
    to its evaluation directory."""
    names = [*record.get("prompt_images", []), *record.get("images", [])]
    return [p for p in names if (Path(record["_dir"]) / p).is_file()]


def _alarm_summary(alarms: list[Alarm]) -> list[str]:
    """One line per alarm (name and metric): its first firing, then the updates it fired
    again at (after clearing)."""
    lines = []
    for first, again in once_each(alarms):
        line = first.line().removeprefix("health alarm: ")
        if again:
            line += f"; again at update{'s' if len(again) > 1 else ''} "
            line += ", ".join(map(str, again))
        lines.append(line)
    return lines


def _head_lines(data: dict[str, Any]) -> list[str]:
    parent = data["parent"]
    if parent is None:
        ptext = "none (initialised from run.seed)"
    else:
        bits = []
        if "config_hash" in parent:
            bits.append(f"{parent['run_dir']} (config hash {parent['config_hash'][:12]})")
        elif "model_path" in parent:
            bits.append(parent["model_path"])
        if "adapter_config_hash" in parent:
            bits.append(
                f"+ adapter of {parent['adapter_run_dir']} "
                f"(config hash {parent['adapter_config_hash'][:12]})"
            )
        elif "initial_adapter" in parent:
            bits.append(f"+ adapter {parent['initial_adapter']}")
        if "run_parent" in parent:
            bits.append(f"(run.parent {parent['run_parent']})")
        ptext = " ".join(bits)
    state = "finished" if data["done"] else f"in progress ({data['updates']} updates logged)"
    return [
        f"run `{data['run_dir']}` ({data['algorithm']}, {data['updates']}/"
        f"{data['total_updates']} updates, {state})",
        f"config hash `{data['config_hash']}`; parent: {ptext}",
    ]


def render_md(data: dict[str, Any]) -> str:
    z = data["z"]
    lines = [f"# uniweave run report: {data['name']}", ""]
    lines += [f"- {md_text(x)}" for x in _head_lines(data)]
    alarms = _alarm_summary(data["alarms"])
    lines += ["", f"## Alarms ({len(alarms)})", ""]
    lines += [f"- {md_text(x)}" for x in alarms] or ["none fired"]
    lines += ["", "## Verdicts (latest evaluation vs the start)", ""]
    vs = verdicts(data)
    if vs:
        lines += [f"- {md_text(f'{split} {p.line(z)}')}" for split, p in vs]
    else:
        lines.append("no verdicts: no evaluation after a baseline (update 0; health.baseline_eval)")
    lines += [
        "",
        f"Test: per prompt, d = value after − value at the start (same prompts and seeds); "
        f"improved / got worse when |mean d| > {z:g} x SE (SE = std(d, ddof=1)/sqrt(n)), "
        "else no detectable change. invalid_frac is better lower.",
    ]
    for split, s in data["splits"].items():
        head, rows = _heldout_rows(split, s)
        lines += ["", f"## Held-out: {split} (value, and paired diff ± SE from the start)", ""]
        lines += _md_table(head, rows)
    lines += ["", "## Training curves (least-squares drift, residual noise)", ""]
    if data["curves"]:
        lines += _md_table(CURVE_HEAD, [_curve_row(k, f) for k, _, f in data["curves"]])
        lines += ["", "A learning claim needs |drift/noise| >= 3 and a held-out verdict."]
    else:
        lines.append("no curve of 3 or more logged updates")
    if data["curves_png"].is_file():
        lines += ["", f"![curves]({CURVES_PNG})"]
    if data["panels"].caption():
        lines += ["", md_text(data["panels"].caption())]
    for split, s in list(data["splits"].items())[-1:]:
        lines += ["", f"## Gallery ({split})", ""]
        for update, recs in _gallery(s):
            lines += [f"### update {update}", ""]
            rows = []
            for r in recs:
                rel = Path(r["_dir"]).relative_to(data["run_dir"])
                imgs = " ".join(
                    f'<img width="64" alt="{html.escape(p)}" src="{html.escape(str(rel / p))}">'
                    for p in _gallery_images(r)
                )
                rows.append(
                    [
                        str(r["task"]),
                        printable(r["prompt"]),
                        printable(r["response"]) or "(unparsed)",
                        Markup(imgs),
                        str(r.get("finish_reason", "")),
                        f"{r['total']:.3f}",
                    ]
                )
            lines += _md_table(GALLERY_HEAD, rows)
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# -- html -------------------------------------------------------------------------------


def _data_uri(path: Path) -> str:
    kind = "png" if path.suffix.lower() == ".png" else "jpeg"
    return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode("ascii")


_CSS = (
    "body{font-family:sans-serif;max-width:72em;margin:1em auto;padding:0 1em}"
    "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ccc;padding:3px 6px;"
    "vertical-align:top;font-size:13px}th{background:#eee}.alarm{color:#a00}"
    ".improved{color:#070}.worse{color:#a00;font-weight:bold}img{image-rendering:pixelated;"
    "margin:1px}pre{white-space:pre-wrap;max-width:28em;margin:0}"
    "p>img{max-width:100%}"
)


def _html_table(head: list[str], rows: list[list[str]], raw: bool = False) -> str:
    cell = (lambda c: str(c)) if raw else (lambda c: html.escape(str(c)))
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{cell(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _verdict_class(v: str) -> str:
    return {"improved": "improved", "got worse": "worse"}.get(v, "same")


def render_html(data: dict[str, Any]) -> str:
    z = data["z"]
    e = html.escape
    parts = [f"<h1>uniweave run report: {e(str(data['name']))}</h1><ul>"]
    parts += [f"<li>{e(x).replace('`', '')}</li>" for x in _head_lines(data)]
    alarms = _alarm_summary(data["alarms"])
    parts.append(f"</ul><h2>Alarms ({len(alarms)})</h2>")
    parts.append(
        "<ul>" + "".join(f'<li class="alarm">{e(a)}</li>' for a in alarms) + "</ul>"
        if alarms
        else "<p>none fired</p>"
    )
    parts.append("<h2>Verdicts (latest evaluation vs the start)</h2>")
    vs = verdicts(data)
    if vs:
        parts.append(
            "<ul>"
            + "".join(
                f'<li class="{_verdict_class(p.verdict)}">{e(split)} {e(p.line(z))}</li>'
                for split, p in vs
            )
            + "</ul>"
        )
    else:
        parts.append("<p>no verdicts: no evaluation after a baseline (update 0)</p>")
    parts.append(
        f"<p>Test: per prompt, d = value after − value at the start (same prompts and seeds); "
        f"improved / got worse when |mean d| &gt; {z:g} × SE (SE = std(d, ddof=1)/√n), else no "
        "detectable change. invalid_frac is better lower.</p>"
    )
    for split, s in data["splits"].items():
        head, rows = _heldout_rows(split, s)
        parts.append(f"<h2>Held-out: {e(split)} (value, and paired diff ± SE from the start)</h2>")
        parts.append(_html_table(head, rows))
    parts.append("<h2>Training curves (least-squares line ± residual noise)</h2>")
    if data["curves"]:
        parts.append(_html_table(CURVE_HEAD, [_curve_row(k, f) for k, _, f in data["curves"]]))
    else:
        parts.append("<p>no curve of 3 or more logged updates</p>")
    if data["curves_png"].is_file():
        parts.append(f'<p><img alt="{CURVES_PNG}" src="{_data_uri(data["curves_png"])}"></p>')
    if data["panels"].caption():
        parts.append(f"<p>{e(data['panels'].caption())}</p>")
    for split, s in list(data["splits"].items())[-1:]:
        parts.append(f"<h2>Gallery ({e(split)})</h2>")
        for update, recs in _gallery(s):
            rows = []
            for r in recs:
                imgs = "".join(
                    f'<img width="64" alt="{e(p)}" src="{_data_uri(Path(r["_dir"]) / p)}">'
                    for p in _gallery_images(r)
                )
                rows.append(
                    [
                        e(str(r["task"])),
                        f"<pre>{e(printable(r['prompt']))}</pre>",
                        f"<pre>{e(printable(r['response']) or '(unparsed)')}</pre>",
                        imgs,
                        e(str(r.get("finish_reason", ""))),
                        f"{r['total']:.3f}",
                    ]
                )
            parts.append(f"<h3>update {update}</h3>")
            parts.append(_html_table(GALLERY_HEAD, rows, raw=True))
    return _page(f"uniweave report {data['name']}", "".join(parts))


def _page(title: str, body: str) -> str:
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_CSS}</style></head><body>{body}</body></html>\n"
    )


def summary_json(data: dict[str, Any]) -> dict[str, Any]:
    return {
        "config_hash": data["config_hash"],
        "parent": data["parent"],
        "updates": data["updates"],
        "alarms": [{**a.as_dict(), "again_at": again} for a, again in once_each(data["alarms"])],
        "verdicts": [{"split": s, **p.as_dict()} for s, p in verdicts(data)],
        "curves": {k: f.as_dict() for k, _, f in data["curves"]},
        "curves_left_out": {
            "constant": dict(data["panels"].constant),
            "duplicate": dict(data["panels"].duplicate),
        },
    }


def write_report(run_dir: Path) -> dict[str, Any]:
    """(Re)write `report.md`, `report.html` and `report.json` of `run_dir` atomically;
    return the report.json content."""
    run_dir = Path(run_dir)
    data = _collect(run_dir)
    training_curves.draw(data["panels"], run_dir / CURVES_PNG, data["name"] or None)
    summary = summary_json(data)
    write_text_atomic(run_dir / REPORT_MD, render_md(data))
    write_text_atomic(run_dir / REPORT_HTML, render_html(data))
    write_text_atomic(run_dir / REPORT_JSON, json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


# -- two runs side by side ----------------------------------------------------------------


def compare_runs(a: Path, b: Path, out: Path) -> Path:
    """`compare.md` + `compare.html` in `out`: the two runs' identities, alarms and
    verdicts side by side, and, for every split both evaluated, B's latest evaluation
    against A's latest on the prompts both saw (the paired test, "improved" meaning B is
    better). Returns the markdown path."""
    da, db = _collect(Path(a)), _collect(Path(b))
    z = da["z"]
    rows = [
        ["run", str(da["run_dir"]), str(db["run_dir"])],
        ["algorithm", da["algorithm"], db["algorithm"]],
        ["config hash", da["config_hash"][:12], db["config_hash"][:12]],
        ["updates", str(da["updates"]), str(db["updates"])],
        ["alarms", str(len(once_each(da["alarms"]))), str(len(once_each(db["alarms"])))],
    ]
    for name, d in (("A", da), ("B", db)):
        for split, p in verdicts(d):
            rows.append([f"{name} {split} {p.task} {p.metric}", *(
                [p.verdict, ""] if name == "A" else ["", p.verdict]
            )])  # fmt: skip
    head = ["", "A", "B"]
    cross = []
    for split in sorted(set(da["splits"]) & set(db["splits"])):
        ra = da["splits"][split]["steps"][-1]
        rb = db["splits"][split]["steps"][-1]
        for p in compare(ra["records"], rb["records"], z):
            cross.append(
                [
                    f"{split} (A update {ra['update']}, B update {rb['update']})",
                    p.task,
                    p.metric,
                    f"{p.before:.3f}",
                    f"{p.after:.3f}",
                    f"{p.diff:+.3f} ± {p.se:.3f} (n {p.n})",
                    p.verdict,
                ]
            )
    chead = ["split", "task", "metric", "A", "B", "B − A ± SE", "B vs A"]
    md = ["# uniweave: two runs side by side", "", *_md_table(head, rows), ""]
    md += [f"## Latest held-out evaluations, B vs A (paired, |diff| > {z:g} SE)", ""]
    md += _md_table(chead, cross) if cross else ["no split evaluated by both runs"]
    md += ["", "## Alarms", ""]
    for name, d in (("A", da), ("B", db)):
        md += [f"- {name}: {md_text(x)}" for x in _alarm_summary(d["alarms"])] or [
            f"- {name}: none"
        ]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / COMPARE_MD, "\n".join(md) + "\n")
    body = (
        "<h1>uniweave: two runs side by side</h1>"
        + _html_table(head, rows)
        + f"<h2>Latest held-out evaluations, B vs A (paired, |diff| &gt; {z:g} SE)</h2>"
        + (_html_table(chead, cross) if cross else "<p>no split evaluated by both runs</p>")
        + "<h2>Alarms</h2><ul>"
        + "".join(
            f'<li class="alarm">{n}: {html.escape(x)}</li>'
            for n, d in (("A", da), ("B", db))
            for x in _alarm_summary(d["alarms"])
        )
        + "</ul>"
    )
    write_text_atomic(out / COMPARE_HTML, _page("uniweave compare", body))
    return out / COMPARE_MD
