"""Figures: one seaborn theme, one function per figure type (DataFrame in, Figure out), one saver.

Takes tables, never models. `save_figure` writes NAME.png (fixed dpi, byte-stable) and NAME.csv beside it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

DPI = 120
THEME = {"style": "whitegrid", "context": "notebook", "palette": "colorblind"}


def set_theme() -> None:
    sns.set_theme(**THEME)
    plt.rcParams["svg.hashsalt"] = "harp"


def _atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=path.suffix)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def save_figure(fig, table: pd.DataFrame, name: str, out_dir: str | Path) -> Path:
    """Write out_dir/name.png and out_dir/name.csv (the plotted numbers) atomically; close the figure."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / f"{name}.png"
    _atomic(png, lambda tmp: fig.savefig(tmp, dpi=DPI, bbox_inches="tight", metadata={"Software": None}))
    _atomic(out_dir / f"{name}.csv", lambda tmp: table.to_csv(tmp, index=False, float_format="%.6g"))
    plt.close(fig)
    return png


def line_by_depth(df: pd.DataFrame, title: str, ylabel: str, hue: str = "model", x: str = "depth",
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


def bars(df: pd.DataFrame, x: str, y: str, hue: str, title: str, xlabel: str, ylabel: str, col: str | None = None,
         row: str | None = None, logy: bool = False):
    """Grouped bars, optionally one panel per `col` (and `row`); x labels rotated to stay readable."""
    set_theme()
    grid = sns.catplot(data=df, x=x, y=y, hue=hue, col=col, row=row, kind="bar", height=3.6, aspect=1.3,
                       sharey=False, errorbar=None)
    grid.set_axis_labels(xlabel, ylabel)
    for ax in grid.axes.flat:
        if logy:
            ax.set_yscale("log")
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    grid.figure.suptitle(title, y=1.04)
    return grid.figure


def line_panels(df: pd.DataFrame, x: str, y: str, col: str, hue: str, title: str, xlabel: str,
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
