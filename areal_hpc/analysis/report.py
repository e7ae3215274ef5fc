"""`areal-hpc report`: one self-contained HTML file comparing runs (or a sweep's points): tables, figures, configs."""

from __future__ import annotations

import base64
import html
import io
import os
from pathlib import Path

from jinja2 import Environment

from areal_hpc.analysis import figures, tables
from areal_hpc.analysis.runs import Run, as_runs, load_run, sweep_runs, varying
from areal_hpc.rundir import SweepDir
from areal_hpc.utils import atomic_write_text

_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{{ title }}</title>
<style>
body { font-family: sans-serif; margin: 2em; max-width: 1200px; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
tr.differs td { background: #fff6d5; }
img { max-width: 100%; display: block; margin: 1em 0; }
</style></head><body>
<h1>{{ title }}</h1>
<p>Baseline: <b>{{ baseline }}</b>{% if target_acc is not none %}; target held-out accuracy {{ target_acc }}{% endif %}.
Throughput is tokens trained on per second of RL.</p>
<h2>Speedup</h2>
{{ speedup | safe }}
{% if sharing %}<h2>Prefix sharing</h2>
<ul>{% for line in sharing %}<li>{{ line }}</li>{% endfor %}</ul>
{% endif %}{% for name, png in images %}<h2>{{ name }}</h2><img alt="{{ name }}" src="data:image/png;base64,{{ png }}">
{% endfor %}
<h2>Configs</h2>
<p>Keys whose values differ between the runs are highlighted and listed first.</p>
{{ configs | safe }}
</body></html>
"""


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return base64.b64encode(buf.getvalue()).decode()


def _configs_table(runs: list[Run]) -> str:
    differ = varying(runs)
    keys = differ + [k for k in dict.fromkeys(k for r in runs for k in r.config) if k not in differ]
    head = "".join(f"<th>{html.escape(r.name)}</th>" for r in runs)
    rows = []
    for k in keys:
        cells = "".join(f"<td>{html.escape(str(r.config.get(k, '')))}</td>" for r in runs)
        rows.append(f"<tr{' class=differs' if k in differ else ''}><td>{html.escape(k)}</td>{cells}</tr>")
    return f"<table><tr><th>key</th>{head}</tr>{''.join(rows)}</table>"


def _sharing_lines(per_version) -> list[str]:
    """One sentence per run whose trainers counted the positions they computed."""
    lines = []
    for run, r in tables.prefix_sharing_totals(per_version).iterrows():
        computed, unshared = int(r["train_tokens_computed"]), int(r["train_tokens_unshared"])
        if not unshared:  # nothing trained yet: no share to give
            continue
        lines.append(
            f"{run}: the trainers computed {computed:,} of the {unshared:,} token positions they stand for "
            f"({r['saved']:.1%} saved)"
        )
    return lines


def expand(paths: list[os.PathLike | str]) -> list[Run]:
    """Runs from run directories and sweep directories (a sweep stands for its points)."""
    runs: list[Run] = []
    for p in paths:
        if SweepDir(p).record.exists():
            runs += sweep_runs(p)
        else:
            runs.append(load_run(p))
    return runs


def write_report(
    paths: list[os.PathLike | str], out: os.PathLike | str, baseline=None, target_acc: float | None = None
) -> Path:
    """Compare the runs in one HTML file at `out` (written atomically) and return its path."""
    runs = as_runs(expand(paths))
    if not runs:
        raise ValueError("report: no run directories among the paths given (a sweep without finished points?)")
    if baseline is not None and not isinstance(baseline, Run) and Path(baseline).is_dir():
        base_path = Path(baseline).resolve()
        if all(r.path.resolve() != base_path for r in runs):  # a baseline outside the compared runs joins them
            runs = as_runs([load_run(base_path), *runs])
    speedup = tables.speedup_table(runs, baseline=baseline, target_acc=target_acc)
    curves = tables.learning_curves(runs)
    images = [
        ("Speedup", _png(figures.speedup_figure(speedup))),
        ("Learning curves (wall time)", _png(figures.learning_figure(curves, x="wall_s"))),
        ("Learning curves (version)", _png(figures.learning_figure(curves, x="version"))),
        ("Staleness", _png(figures.staleness_figure(tables.staleness_distribution(runs)))),
    ]
    shared = tables.prefix_sharing(runs)
    if len(shared):  # runs whose trainers counted the positions they computed (docs/prefix-sharing.md)
        images.append(("Prefix sharing per version", _png(figures.prefix_sharing_figure(shared))))
    gaps = tables.mismatch_curves(runs)
    if len(gaps):  # runs that measured the training-inference gap (docs/algorithm.md)
        images.append(
            ("Training-inference gap (solid: staleness 0; dashed: all tokens)", _png(figures.mismatch_figure(gaps)))
        )
    for r in runs:
        images.append((f"Utilisation: {r.name}", _png(figures.utilisation_figure(tables.utilisation(r), r.name))))
    page = Environment(autoescape=True).from_string(_PAGE)
    text = page.render(
        title=f"areal-hpc report: {len(runs)} runs",
        baseline=speedup.attrs["baseline"],
        target_acc=target_acc,
        speedup=speedup.to_html(float_format=lambda v: f"{v:.3f}", na_rep="–"),
        images=images,
        configs=_configs_table(runs),
        sharing=_sharing_lines(shared),
    )
    out = Path(out)
    atomic_write_text(out, text)
    return out
