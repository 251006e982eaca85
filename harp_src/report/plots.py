"""Figures: one seaborn theme, one function per figure type (DataFrame in, Figure out), one saver.

Takes tables, never models. `save_figure` writes NAME.png (fixed dpi, byte-stable) and NAME.csv beside it, and
shows the PNG in the notebook that called it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import matplotlib
from IPython import get_ipython
from IPython.display import Image, display

from .files import atomic_path

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

DPI = 120
THEME = {"style": "whitegrid", "context": "notebook", "palette": "colorblind"}


def set_theme() -> None:
    sns.set_theme(**THEME)
    plt.rcParams["svg.hashsalt"] = "harp"


def save_figure(fig, table: pd.DataFrame, name: str, out_dir: str | Path) -> Path:
    """Write out_dir/name.png and out_dir/name.csv (the plotted numbers) atomically; close the figure."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / f"{name}.png"
    with atomic_path(png) as tmp:
        fig.savefig(tmp, dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    with atomic_path(out_dir / f"{name}.csv") as tmp:
        table.to_csv(tmp, index=False, float_format="%.6g")
    plt.close(fig)
    show_saved(png)
    return png


FIGURE_KEY = "harp_figure"  # output metadata of a figure shown in a notebook: {"file": name, "sha256": hex}


def show_saved(png: Path) -> None:
    """Show a saved PNG in the notebook that runs this (nothing outside a kernel): the file's own bytes, with their
    SHA-256 in the output's metadata, so an executed notebook can be checked against the committed figures."""
    if get_ipython() is None:
        return
    data = png.read_bytes()
    display(Image(data=data), metadata={FIGURE_KEY: {"file": png.name, "sha256": hashlib.sha256(data).hexdigest()}})


def line_by_depth(df: pd.DataFrame, title: str, ylabel: str, *, hue: str = "model", x: str = "depth",
                  xlabel: str = "relative layer depth (0 = first layer, 1 = last)", style: str | None = None,
                  logy: bool = False):
    """One line per `hue` of value against (normalised) depth."""
    set_theme()
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.lineplot(data=df, x=x, y="value", hue=hue, style=style, marker="o", markersize=4, ax=ax,
                 errorbar=None)
    if logy:
        ax.set_yscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    return fig


def band_by_depth(df: pd.DataFrame, title: str, ylabel: str):
    """Mean line with a min–max band (e.g. attention entropy over heads)."""
    set_theme()
    fig, ax = plt.subplots(figsize=(7, 4))
    for (model, part), color in zip(df.groupby("model"), sns.color_palette(), strict=False):
        ax.plot(part.depth, part.value, marker="o", markersize=4, color=color, label=f"{model} (mean over heads)")
        ax.fill_between(part.depth, part["min"], part["max"], color=color, alpha=0.2)
    ax.set(title=title, xlabel="relative layer depth (0 = first layer, 1 = last)", ylabel=ylabel)
    ax.legend()
    return fig


def ppl_curves(df: pd.DataFrame, title: str, x: str, xlabel: str, hue: str, col: str = "model"):
    """Perplexity (log scale) against `x`, one panel per model, one line per `hue`."""
    set_theme()
    grid = sns.relplot(data=df, x=x, y="ppl", hue=hue, col=col, kind="line", marker="o",
                       facet_kws={"sharey": False}, height=3.6, aspect=1.2)
    grid.set(yscale="log")
    grid.set_axis_labels(xlabel, "test perplexity (log scale)")
    grid.figure.suptitle(title, y=1.04)
    return grid.figure


def bars(df: pd.DataFrame, x: str, y: str, hue: str, title: str, *, xlabel: str = "", ylabel: str = "",
         col: str | None = None, row: str | None = None, logy: bool = False, ylim: tuple[float, float] | None = None,
         reference: list[float] | None = None):
    """Grouped bars, optionally one panel per `col` (and `row`); x labels rotated to stay readable.

    `reference` draws one dashed black line per panel (panels in row-major order), e.g. the dense model's value.
    """
    set_theme()
    grid = sns.catplot(data=df, x=x, y=y, hue=hue, col=col, row=row, kind="bar", height=3.6, aspect=1.3,
                       sharey=False, errorbar=None)
    grid.set_axis_labels(xlabel, ylabel)
    for ax in grid.axes.flat:
        if logy:
            ax.set_yscale("log")
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    grid.figure.suptitle(title, y=1.04)
    for ax in grid.axes.flat if ylim else ():
        ax.set_ylim(*ylim)
    for ax, value in zip(grid.axes.flat, reference or (), strict=bool(reference)):
        ax.axhline(value, ls="--", c="k")
    return grid.figure


def line_panels(df: pd.DataFrame, x: str, y: str, col: str, hue: str, title: str, *, xlabel: str,
                ylabels: dict | str, style: str | None = None, logy: tuple = ()):
    """One panel per value of `col` (own y axis and label), lines by `hue` (and `style`)."""
    set_theme()
    grid = sns.relplot(data=df, x=x, y=y, col=col, hue=hue, style=style, kind="line", marker="o", markersize=4,
                       height=3.6, aspect=1.15, facet_kws={"sharey": False}, errorbar=None)
    for name, ax in grid.axes_dict.items():
        ax.set_title(str(name))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabels[name] if isinstance(ylabels, dict) else ylabels)
        if name in logy:
            ax.set_yscale("log")
    grid.figure.suptitle(title, y=1.04)
    return grid.figure


def _log2_x(ax) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1024:g}k" if v >= 1024
                                                                 else f"{v:g}"))


def latency_loglog(df: pd.DataFrame, title: str):
    """Prefill seconds and decode ms/token against context length, log–log; dense vs HARP per model/device."""
    set_theme()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = {"prefill": ("Prefill: whole prompt", "seconds per prompt (log)"),
              "decode": ("Decode: one new token after the prompt", "ms per token (log)")}
    for ax, (phase, (name, ylabel)) in zip(axes, labels.items(), strict=True):
        part = df[df.phase == phase].assign(run=lambda d: d.model + " · " + d.device.str.split(" ").str[0])
        sns.lineplot(data=part, x="seq_len", y="latency", hue="variant", style="run", marker="o", ax=ax,
                     errorbar=None)
        _log2_x(ax)
        ax.set_yscale("log")
        ax.set(title=name, xlabel="context length (tokens, log)", ylabel=ylabel)
    fig.suptitle(title, y=1.02)
    return fig


def speedup_vs_bound(df: pd.DataFrame, bounds: pd.DataFrame | None, title: str):
    """Measured speed-up (markers) and the FLOP-model bound (dashed) against length; prefill and decode panels.

    `bounds` adds bound-only curves (model, seq_len, flop_bound, decode_flop_bound), e.g. a config-only model.
    """
    set_theme()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    runs = df.assign(run=df.model + " · " + df.device.str.split(" ").str[0])
    colors = dict(zip(list(runs.run.unique()) + ([] if bounds is None else list(bounds.model.unique())),
                      sns.color_palette(), strict=False))
    for ax, (meas, bound, name) in zip(axes, [("speedup", "flop_bound", "Prefill"),
                                              ("decode_speedup", "decode_flop_bound", "Decode (per token)")],
                                       strict=True):
        for run, part in runs.groupby("run", sort=False):
            ax.plot(part.seq_len, part[meas], marker="o", color=colors[run], label=f"{run}: measured")
            ax.plot(part.seq_len, part[bound], ls="--", color=colors[run], label=f"{run}: FLOP bound")
        if bounds is not None:
            for model, part in bounds.groupby("model", sort=False):
                ax.plot(part.seq_len, part[bound], ls=":", color=colors[model], label=f"{model}: FLOP bound")
        ax.axhline(1.0, color="grey", lw=0.8)
        _log2_x(ax)
        ax.set(title=name, xlabel="context length (tokens, log)", ylabel="speed-up of HARP over dense (×)")
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle(title, y=1.02)
    return fig


def kv_and_memory(df: pd.DataFrame, title: str):
    """KV-cache bytes after prefill (with the (L−N)/L expectation dashed) and peak prefill memory, per length."""
    set_theme()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    mb = df.assign(kv_mb=df.kv_bytes / 2**20, expected_mb=df.kv_expected / 2**20, peak_mb=df.peak_mem_bytes / 2**20,
                   run=df.model + " · " + df.device.str.split(" ").str[0])
    sns.lineplot(data=mb, x="seq_len", y="kv_mb", hue="variant", style="run", marker="o", ax=axes[0], errorbar=None)
    for _, part in mb[mb.variant == "HARP"].groupby("run"):
        axes[0].plot(part.seq_len, part.expected_mb, ls="--", color="black", lw=0.8)
    axes[0].plot([], [], ls="--", color="black", lw=0.8, label="dense minus the pruned layers")
    axes[0].legend(fontsize=8)
    sns.lineplot(data=mb, x="seq_len", y="peak_mb", hue="variant", style="run", marker="o", ax=axes[1],
                 errorbar=None)
    for ax, name, ylabel in [(axes[0], "KV cache after prefill", "MiB (log)"),
                             (axes[1], "Peak extra memory during prefill", "MiB (log)")]:
        _log2_x(ax)
        ax.set_yscale("log")
        ax.set(title=name, xlabel="context length (tokens, log)", ylabel=ylabel)
    fig.suptitle(title, y=1.02)
    return fig


def _interval_panel(data: pd.DataFrame, x: str, hue: str, order: list, hues: list, colors: dict, *, value: str,
                    low: str, high: str, ax) -> None:
    width = 0.8 / max(len(hues), 1)
    for k, h in enumerate(hues):
        part = data[data[hue] == h].set_index(x).reindex(order).dropna(subset=[value])
        pos = [order.index(v) - 0.4 + width * (k + 0.5) for v in part.index]
        err = [part[value] - part[low], part[high] - part[value]]
        ax.errorbar(pos, part[value], yerr=err, fmt="o", ms=4, capsize=3, color=colors[h], label=str(h))
    labels = [str(v) for v in order]
    if max(len(label) for label in labels) > 6:  # long names: slanted, each ending at its tick
        ax.set_xticks(range(len(order)), labels, rotation=30, ha="right", rotation_mode="anchor")
    else:
        ax.set_xticks(range(len(order)), labels)


def intervals(df: pd.DataFrame, x: str, hue: str, title: str, xlabel: str, ylabel: str, *, col: str | None = None,
              row: str | None = None, value: str = "value", low: str = "ci_low", high: str = "ci_high",
              zero_line: bool = False, ylim: tuple[float, float] | None = None, aspect: float = 1.4,
              logy: bool = False):
    """Point estimates with their confidence intervals as error bars, one marker per `hue` beside each other,
    one panel per `col` (and `row`); `zero_line` draws y = 0 (differences: an interval crossing it decides nothing);
    `logy` for positive values spanning orders of magnitude."""
    set_theme()
    order = list(dict.fromkeys(df[x]))
    hues = list(dict.fromkeys(df[hue]))
    colors = dict(zip(hues, sns.color_palette(), strict=False))
    grid = sns.FacetGrid(df, col=col, row=row, height=3.6, aspect=aspect, sharey=False, sharex=False,
                         margin_titles=bool(row and col))
    for ax, (_, part) in zip(grid.axes.flat, _facets(df, row, col), strict=True):
        _interval_panel(part, x, hue, order, hues, colors, value=value, low=low, high=high, ax=ax)
        if zero_line:
            ax.axhline(0, color="grey", lw=0.8)
        if ylim:
            ax.set_ylim(*ylim)
        if logy:
            ax.set_yscale("log")
    grid.set_axis_labels(xlabel, ylabel)
    grid.set_titles(row_template="{row_name}", col_template="{col_name}")
    grid.axes.flat[0].legend(fontsize=8)
    grid.figure.suptitle(title, y=1.02)
    grid.tight_layout()
    return grid.figure


def _facets(df: pd.DataFrame, row: str | None, col: str | None) -> list:
    """(key, subset) per panel in FacetGrid's row-major order (values in order of appearance)."""
    rows = list(dict.fromkeys(df[row])) if row else [None]
    cols = list(dict.fromkeys(df[col])) if col else [None]
    out = []
    for r in rows:
        for c in cols:
            mask = pd.Series(True, index=df.index)
            if row:
                mask &= df[row] == r
            if col:
                mask &= df[col] == c
            out.append(((r, c), df[mask]))
    return out


def heatmaps(df: pd.DataFrame, title: str, row: str = "model", col: str = "metric", value: str = "score",
             labels: dict | None = None):
    """One layer × head heat map per (`row`, `col`) pair, each with its own colour scale (metrics differ in units)."""
    set_theme()
    rows, cols = list(dict.fromkeys(df[row])), list(dict.fromkeys(df[col]))
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(2.6 * len(cols), 3.2 * len(rows)), squeeze=False)
    for r, rname in enumerate(rows):
        for c, cname in enumerate(cols):
            part = df[(df[row] == rname) & (df[col] == cname)]
            grid = part.pivot_table(index="layer", columns="head", values=value)
            sns.heatmap(grid, ax=axes[r, c], cmap="viridis", cbar=True, xticklabels=True,
                        yticklabels=max(1, len(grid) // 6))
            axes[r, c].set_title(f"{rname}\n{(labels or {}).get(cname, cname)}", fontsize=9)
            axes[r, c].set_xlabel("query head")
            axes[r, c].set_ylabel("layer" if c == 0 else "")
    fig.suptitle(title, y=1.01)
    fig.tight_layout()
    return fig


def curves_with_intervals(df: pd.DataFrame, x: str, y: str, low: str, high: str, hue: str, *, style: str, col: str,
                          title: str, xlabel: str, ylabel: str, logy: bool = False, logx: bool = False,
                          zero: bool = False):
    """Lines of `y` against `x` per (`hue`, `style`) with error bars from `low`..`high`, one panel per `col`
    (`zero`: a reference line at y = 0, for differences)."""
    set_theme()
    panels = list(dict.fromkeys(df[col]))
    hues = list(dict.fromkeys(df[hue]))
    styles = list(dict.fromkeys(df[style]))
    colors = dict(zip(hues, sns.color_palette("colorblind", len(hues)), strict=True))
    marks = dict(zip(styles, ["o", "s", "^", "D", "v", "P", "X"] * 3, strict=False))
    lines = dict(zip(styles, ["-", "--", ":", "-.", (0, (3, 1, 1, 1)), (0, (5, 2))] * 3, strict=False))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4), squeeze=False)
    for ax, name in zip(axes[0], panels, strict=True):
        for (h, s), part in df[df[col] == name].groupby([hue, style], sort=False):
            part = part.sort_values(x)
            ax.errorbar(part[x], part[y], yerr=[part[y] - part[low], part[high] - part[y]], color=colors[h],
                        marker=marks[s], ls=lines[s], ms=5, capsize=3, lw=1.2,
                        label=f"{h} · {s}" if len(styles) > 1 else str(h))
        ax.set(title=str(name), xlabel=xlabel, ylabel=ylabel)
        if logy:
            ax.set_yscale("log")
        if logx:
            _log_x_at(ax, sorted(df[x].unique()))
        if zero:
            ax.axhline(0, color="grey", lw=0.8, zorder=0)
    axes[0, -1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1), title=hue, title_fontsize=7)
    fig.suptitle(title, y=1.02)
    fig.tight_layout()
    return fig


def short_count(v: float) -> str:
    """A count in a few characters: 135M, 1.8B, 512k."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= size:
            return f"{v / size:.2g}{unit}" if abs(v) < 10 * size else f"{v / size:.0f}{unit}"
    return f"{v:g}"


def _log_x_at(ax, values: list[float]) -> None:
    """A log x axis ticked at the plotted values when they are few (model sizes, say), else at powers of ten: the
    default minor labels (3×10⁸, 4×10⁸, ...) run into each other across a short span."""
    ax.set_xscale("log")
    if len(values) <= 8:
        ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(values))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: short_count(v)))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def _tokens_label(n: int) -> str:
    return f"{n / 1024:g}k tokens" if n >= 1024 else f"{n} tokens"


def alpha_spread(df: pd.DataFrame, title: str, band: str, x: str = "rank_from_top", hue: str = "sample"):
    """α per layer across calibration samples: one row of panels per model, one panel per calibration size.
    Rows whose method is `band` are drawn as grey 5–95 % bars (alpha_low..alpha_high, median marked); the other
    methods as markers (one marker shape per method, one colour per `hue` value, dodged)."""
    set_theme()
    models = list(dict.fromkeys(df.model))
    sizes = {m: sorted(df[df.model == m].calib_tokens.unique()) for m in models}
    ncols = max(len(s) for s in sizes.values())
    fig, axes = plt.subplots(len(models), ncols, figsize=(3.3 * ncols, 3.0 * len(models)), squeeze=False,
                             sharey=True)
    points = df[df.method != band]
    hues = list(dict.fromkeys(points[hue]))
    colors = dict(zip(hues, sns.color_palette("colorblind", len(hues)), strict=True))
    marks = dict(zip(dict.fromkeys(points.method), ["o", "x", "s", "^"], strict=False))
    for r, model in enumerate(models):
        for c in range(ncols):
            ax = axes[r, c]
            if c >= len(sizes[model]):
                ax.set_visible(False)
                continue
            part = df[(df.model == model) & (df.calib_tokens == sizes[model][c])]
            bar = part[part.method == band]
            ax.vlines(bar[x], bar.alpha_low, bar.alpha_high, color="0.6", lw=6, alpha=0.6,
                      label="bootstrap 5–95 %" if len(bar) else None)
            ax.scatter(bar[x], bar.alpha, marker="_", color="0.3", s=80)
            for k, h in enumerate(hues):
                for method, mark in marks.items():
                    p = part[(part[hue] == h) & (part.method == method)]
                    ax.scatter(p[x] + 0.12 * (k - (len(hues) - 1) / 2), p.alpha, marker=mark, s=22,
                               color=colors[h], label=f"{method} · {h}" if len(p) else None)
            ax.set(title=f"{model}, {_tokens_label(sizes[model][c])}", xlabel="layer rank from the top (1 = last)",
                   ylabel="α" if c == 0 else "", ylim=(-0.05, 1.05))
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    handles = {}
    for ax in axes.flat:
        for hd, lb in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lb, hd)
    fig.legend(handles.values(), handles.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 0.95))
    fig.suptitle(title, y=1.01)
    fig.tight_layout()
    return fig


def quality_by_sample(df: pd.DataFrame, title: str, y: str, low: str, high: str, ylabel: str):
    """One panel per model: `y` with its interval (low..high) per calibration size (x), one colour per method,
    the samples of a size dodged side by side."""
    set_theme()
    models = list(dict.fromkeys(df.model))
    methods = list(dict.fromkeys(df.method))
    colors = dict(zip(methods, sns.color_palette("colorblind", len(methods)), strict=True))
    fig, axes = plt.subplots(1, len(models), figsize=(5.6 * len(models), 4.0), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        part = df[df.model == model]
        sizes = sorted(part.calib_tokens.unique())
        for c, size in enumerate(sizes):
            at = part[part.calib_tokens == size]
            groups = list(at.groupby(["method", "sample"], sort=False))
            for k, ((method, _), g) in enumerate(groups):
                pos = c - 0.35 + 0.7 * (k + 0.5) / len(groups)
                ax.errorbar([pos], g[y], yerr=[g[y] - g[low], g[high] - g[y]], fmt="o", ms=4, capsize=2,
                            color=colors[method], label=method)
        ax.set_xticks(range(len(sizes)), [_tokens_label(s) for s in sizes])
        ax.set(title=model, xlabel="calibration tokens (one marker per sample)", ylabel=ylabel)
    handles = {}
    for ax in axes.flat:
        for hd, lb in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lb, hd)
    axes[0, -1].legend(handles.values(), handles.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle(title, y=1.02)
    fig.tight_layout()
    return fig


def frontier_lines(df: pd.DataFrame, x: str, title: str, xlabel: str, *, ylabels: dict, logy: tuple = (),
                   emphasise: str = "harp"):
    """Quality against a cost, one line per method through its budgets (sorted by `x`), error bars from
    ci_low..ci_high; one panel per model (rows) and metric (columns, labelled by `ylabels`). The `emphasise`d
    method is drawn black and thicker; a method with one point is a marker only.

    Args:
        df: model, method, metric, value, ci_low, ci_high and the `x` column.
        logy: metrics drawn on a log axis.
    """
    set_theme()
    methods = list(dict.fromkeys(df.method))
    colors = dict(zip([m for m in methods if m != emphasise], sns.color_palette("tab20"), strict=False))
    colors[emphasise] = "black"
    grid = sns.FacetGrid(df, row="model", col="metric", height=3.6, aspect=1.5, sharey=False, sharex=False,
                         margin_titles=True)
    for ax, ((_, metric), part) in zip(grid.axes.flat, _facets(df, "model", "metric"), strict=True):
        for method, line in part.sort_values(x).groupby("method", sort=False):
            err = [line.value - line.ci_low, line.ci_high - line.value]
            ax.errorbar(line[x], line.value, yerr=err, color=colors[method], marker="o", ms=4, capsize=2,
                        lw=2.2 if method == emphasise else 1.1, label=method, zorder=3 if method == emphasise else 2)
        ax.set_ylabel(ylabels.get(metric, metric))
        if metric in logy:
            ax.set_yscale("log")
    grid.set_titles(row_template="{row_name}", col_template="")
    for ax in grid.axes[-1]:
        ax.set_xlabel(xlabel)
    legend = {}  # every method once, from whichever panel has it
    for ax in grid.axes.flat:
        legend |= {label: h for h, label in zip(*ax.get_legend_handles_labels(), strict=True) if label not in legend}
    grid.figure.legend(list(legend.values()), list(legend), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
                       title="method")
    grid.figure.suptitle(title, y=1.02)
    grid.tight_layout()
    return grid.figure
