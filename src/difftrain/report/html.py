"""Write ``report.html`` for a run directory: plots, validation grids over time, config, checkpoints.

Everything is inline (SVG plots, PNG grids as data URIs, CSS), so the page opens from a file,
offline, in any browser, and can be mailed or attached as it is.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import json
import re
from pathlib import Path

from PIL import Image

from difftrain.report.plots import RAMP, svg_line_plot
from difftrain.checkpoints.checkpoint import list_checkpoints, read_best

MAX_GRIDS = 12  # grids shown in the strip, evenly spread over the run
GRID_WIDTH_PX = 320  # each grid is shown at this width: larger ones downscaled, smaller ones enlarged (pixelated)

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:20px;color:#222;max-width:1500px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:22px 0 8px;border-bottom:1px solid #ddd}
.plots{display:flex;flex-wrap:wrap;gap:12px} figure{margin:0} figcaption{font-weight:600;font-size:13px}
.legend{font-size:11px;display:flex;flex-wrap:wrap;gap:2px 10px;max-width:410px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:3px;vertical-align:middle}
.strip{display:flex;gap:8px;overflow-x:auto;padding-bottom:6px} .strip figure{text-align:center;font-size:12px}
.strip img{image-rendering:pixelated;border:1px solid #ccc;width:320px;height:auto}
pre{background:#f5f5f5;padding:10px;max-height:420px;overflow:auto;font-size:12px}
table{border-collapse:collapse;font-size:13px} td,th{padding:2px 10px;border-bottom:1px solid #eee;text-align:left}
.meta{color:#555}
"""

# Runs after load: counts what rendered, so a headless browser can check the page worked.
_SCRIPT = """
window.addEventListener('load', function () {
  var plots = document.querySelectorAll('figure.plot svg .series').length;
  var grids = Array.prototype.filter.call(document.querySelectorAll('.strip img'),
      function (img) { return img.complete && img.naturalWidth > 0; }).length;
  document.body.setAttribute('data-rendered', 'series=' + plots + ';grids=' + grids);
});
"""


def read_metrics(path: Path) -> dict[int, dict[str, float]]:
    """``metrics.jsonl`` as step -> merged metrics (a later line for the same step wins, so a
    resumed run's repeated steps read as the newest values)."""
    rows: dict[int, dict[str, float]] = {}
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        step = record.pop("step", None)
        if isinstance(step, int):
            rows.setdefault(step, {}).update(record)
    return dict(sorted(rows.items()))


def _series(rows: dict[int, dict[str, float]], key: str) -> tuple[list[float], list[float]]:
    pts = [(s, r[key]) for s, r in rows.items() if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def _data_uri(path: Path) -> str:
    img = Image.open(path).convert("RGB")
    if img.width > GRID_WIDTH_PX:
        img = img.resize((GRID_WIDTH_PX, round(img.height * GRID_WIDTH_PX / img.width)), Image.Resampling.BOX)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _grids(folder: Path) -> list[tuple[int, Path]]:
    found = []
    for p in folder.glob("step_*.png") if folder.is_dir() else []:
        m = re.match(r"step_(\d+)\.png$", p.name)
        if m:
            found.append((int(m.group(1)), p))
    found.sort()
    if len(found) > MAX_GRIDS:  # evenly spread, always with the first and the last
        idx = sorted({round(i * (len(found) - 1) / (MAX_GRIDS - 1)) for i in range(MAX_GRIDS)})
        found = [found[i] for i in idx]
    return found


def _strip(title: str, grids: list[tuple[int, Path]]) -> str:
    if not grids:
        return ""
    cells = "".join(
        f'<figure><img alt="step {s}" src="{_data_uri(p)}"><figcaption>step {s:,}</figcaption></figure>'
        for s, p in grids
    )
    return f"<h2>{html.escape(title)}</h2><div class=\"strip\">{cells}</div>"


def _plots(rows: dict[int, dict[str, float]]) -> str:
    keys = {k for r in rows.values() for k in r}
    buckets = sorted((k for k in keys if k.startswith("heldout/loss_bucket/")), key=lambda k: int(k.rsplit("/", 1)[1]))
    train_buckets = sorted((k for k in keys if k.startswith("loss_bucket/")), key=lambda k: int(k.rsplit("/", 1)[1]))
    held_out = "heldout/loss" in keys or "heldout_raw/loss" in keys  # no held-out set: no held-out panels
    figs = [
        svg_line_plot("training loss", {"loss": _series(rows, "loss")}, log_y=True),
        held_out and svg_line_plot(
            "held-out loss",
            {name: _series(rows, key) for name, key in
             (("EMA weights", "heldout/loss"), ("raw weights", "heldout_raw/loss"), ("training loss", "loss"))},
            log_y=True,
        ),
        held_out and svg_line_plot("held-out loss by noise-level bucket (EMA; 0 = least noise)",
                      {f"bucket {k.rsplit('/', 1)[1]}": _series(rows, k) for k in buckets}, log_y=True, colors=RAMP),
        svg_line_plot("training loss by noise-level bucket",
                      {f"bucket {k.rsplit('/', 1)[1]}": _series(rows, k) for k in train_buckets}, log_y=True,
                      colors=RAMP),
        *_score_plots(rows, keys),
        "memorization/near_copy_share" in keys and svg_line_plot(
            "near-copies of training images (share of the validation samples; lower is better)",
            {"near-copy share": _series(rows, "memorization/near_copy_share"),
             "FID samples": _series(rows, "fid_samples/memorization/near_copy_share")}),
        "memorization/median_ratio" in keys and svg_line_plot(
            "median distance to the nearest training image / its own nearest-neighbour distance",
            {"validation samples": _series(rows, "memorization/median_ratio"),
             "FID samples": _series(rows, "fid_samples/memorization/median_ratio")}),
        "diversity/vendi" in keys and svg_line_plot(
            "diversity (Vendi score) of the validation samples and of as many training images",
            {"samples": _series(rows, "diversity/vendi"), "training images": _series(rows, "diversity/vendi_data")}),
        svg_line_plot("gradient norm (before clipping)", {"grad_norm": _series(rows, "grad_norm")}, log_y=True),
        svg_line_plot("learning rate", {"lr": _series(rows, "lr")}),
        svg_line_plot("throughput (images/s)", {"images/s": _series(rows, "images_per_s")}),
        svg_line_plot("fraction of time waiting for data", {"data wait": _series(rows, "data_wait_frac")}),
        svg_line_plot("memory (MiB)", {"CPU max RSS": _series(rows, "cpu_max_rss_mib"),
                                       "GPU max allocated": _series(rows, "gpu_max_allocated_mib")}),
    ]
    return '<div class="plots">' + "".join(f for f in figs if f) + "</div>"


# Sample-quality scores: (metric, its sample count's key, title); a panel only when the run logged it.
SCORES = (
    ("fid", "fid_num_samples", "FID of the EMA weights (lower is better)"),
    ("clip_score", "clip_score_images", "CLIP score of the validation images (higher is better)"),
    ("inception_score", "inception_score_images", "Inception Score of the validation images (higher is better)"),
)


def _score_plots(rows: dict[int, dict[str, float]], keys: set[str]) -> list[str]:
    """One panel per score the run logged, its title naming the sample count (a score means
    little without it) and, for FID, what the samples were conditioned on."""
    figs = []
    for key, count_key, title in SCORES:
        if key not in keys:
            continue
        counts = sorted({int(r[count_key]) for r in rows.values() if isinstance(r.get(count_key), (int, float))})
        if counts:
            title += f", {'/'.join(f'{c:,}' for c in counts)} images"
        conditioned = {r["fid_conditioned_on"] for r in rows.values() if key == "fid" and "fid_conditioned_on" in r}
        if conditioned:
            title += f"; conditioned on {', '.join(sorted(conditioned))}"
        figs.append(svg_line_plot(title, {key: _series(rows, key)}))
    return figs


def _checkpoints(run_dir: Path) -> str:
    found = list_checkpoints(run_dir / "checkpoints")
    if not found:
        return "<p>no checkpoints</p>"
    best = read_best(run_dir / "checkpoints")

    def name(p: Path) -> str:
        if best is None or p.name != best[0]:
            return html.escape(p.name)
        return f'{html.escape(p.name)} <b class="best">best FID {best[1]:.3f}</b> (RUN/best)'

    rows = "".join(
        f"<tr><td>{s:,}</td><td>{name(p)}</td><td>{p.stat().st_size / 2**20:.1f} MiB</td>"
        f"<td>{datetime.datetime.fromtimestamp(p.stat().st_mtime, datetime.timezone.utc):%Y-%m-%d %H:%M} UTC</td></tr>"
        for s, p in found
    )
    return f"<table><tr><th>step</th><th>file</th><th>size</th><th>written</th></tr>{rows}</table>"


def _read_warnings(path: Path) -> list[tuple[int, str]]:
    """(step, text) of every ``warning`` line of ``metrics.jsonl`` (several may share a step)."""
    found = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("warning"), str):
            found.append((record.get("step", 0), record["warning"]))
    return found


def _warnings(warnings: list[tuple[int, str]]) -> str:
    """The run's warnings (training/warnings.py), one line each; nothing when there were none."""
    if not warnings:
        return ""
    items = "".join(f"<li>{html.escape(text)}</li>" for _, text in warnings)
    return f'<h2>Warnings</h2><ul class="warnings">{items}</ul>'


def build_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``run_dir/report.html``); return its path."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file() and not (run_dir / "config.toml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no metrics.jsonl or config.toml)")
    out = Path(out) if out is not None else run_dir / "report.html"
    rows = read_metrics(run_dir / "metrics.jsonl")
    last_step = max(rows) if rows else 0
    last = rows.get(last_step, {})
    config = (run_dir / "config.toml").read_text() if (run_dir / "config.toml").is_file() else ""
    summary = f"{len(rows)} logged steps, last step {last_step:,}"
    if "loss" in last:
        summary += f"; loss {last['loss']:.4f}"
    warnings = _read_warnings(run_dir / "metrics.jsonl")
    held = [r["heldout/loss"] for r in rows.values() if "heldout/loss" in r]
    if held:
        summary += f"; held-out loss {held[-1]:.4f} (best {min(held):.4f})"
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>difftrain report: {html.escape(run_dir.name)}</title>
<style>{_CSS}</style></head><body>
<h1>difftrain run: {html.escape(run_dir.name)}</h1>
<p class="meta">{html.escape(summary)}. Written {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC
from {html.escape(str(run_dir.resolve()))}.</p>
{_warnings(warnings)}<h2>Curves</h2>{_plots(rows)}
{_strip("Validation grids (EMA weights, fixed noise)", _grids(run_dir / "samples"))}
{_strip("Validation grids (raw weights)", _grids(run_dir / "samples" / "raw"))}
{_strip("Each validation sample beside its nearest training image (nearest first; red bar: near-copy)",
        _grids(run_dir / "samples" / "neighbours"))}
<h2>Checkpoints</h2>{_checkpoints(run_dir)}
<h2>Config</h2><pre>{html.escape(config)}</pre>
<script>{_SCRIPT}</script>
</body></html>
"""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out
