"""One report, three renderings: rich tables in the terminal, a self-contained HTML page, a JSON file.

A report is an ordered list of parts (headings, paragraphs, tables, plots) plus the data behind them. The
terminal shows the text and tables; the HTML page adds the plots, drawn with matplotlib and embedded as
base64 PNG so the file can be mailed or attached to a ticket; the JSON file holds every figure.
matplotlib is imported only when a page is written (it is the optional `plots` extra).
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable


def readable_console(console: Console | None = None, width: int = 120) -> Console:
    """`console`, or a new one; outside a terminal (logs, CI, a pipe) rich assumes 80 columns, which folds our
    wide tables into unreadable cells, so there it is widened to `width`."""
    console = console or Console()
    return console if console.is_terminal or console.width >= width else Console(width=width)


@dataclass
class Heading:
    text: str


@dataclass
class Text:
    text: str
    style: str = ""  # a rich style: "bold green", "bold red", ...


@dataclass
class Table:
    title: str
    columns: Sequence[str]
    rows: Sequence[Sequence[str]]
    note: str = ""
    text_columns: int = 1  # leading columns of words (left-aligned); the rest are figures


@dataclass
class Plot:
    title: str
    draw: Callable[[Any], None]  # draws on a matplotlib Axes
    xlabel: str = ""
    ylabel: str = ""


Part = Heading | Text | Table | Plot


@dataclass
class Report:
    title: str
    parts: list[Part] = field(default_factory=list)
    data: dict = field(default_factory=dict)

    def add(self, *parts: Part) -> Report:
        self.parts.extend(parts)
        return self

    # ---------------------------------------------------------------- terminal

    def print(self, console: Console | None = None) -> None:
        console = console or Console()
        console.rule(f"[bold]{escape(self.title)}")
        for part in self.parts:
            if isinstance(part, Heading):
                console.print(f"\n[bold underline]{escape(part.text)}")
            elif isinstance(part, Text):
                console.print(f"[{part.style}]{escape(part.text)}" if part.style else escape(part.text))
            elif isinstance(part, Table):
                console.print(_rich_table(part))

    # ---------------------------------------------------------------- files

    def write_json(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.data, indent=1, default=_plain))

    def write_html(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        body = [f"<h1>{html.escape(self.title)}</h1>"]
        for part in self.parts:
            if isinstance(part, Heading):
                body.append(f"<h2>{html.escape(part.text)}</h2>")
            elif isinstance(part, Text):
                cls = " class='bad'" if "red" in part.style else " class='good'" if "green" in part.style else ""
                body.append(f"<p{cls}>{html.escape(part.text)}</p>")
            elif isinstance(part, Table):
                body.append(_html_table(part))
            else:
                body.append(f"<figure><img alt='{html.escape(part.title)}' src='data:image/png;base64,"
                            f"{_plot_png(part)}'><figcaption>{html.escape(part.title)}</figcaption></figure>")
        path.write_text(PAGE.format(title=html.escape(self.title), body="\n".join(body)))


def _rich_table(part: Table) -> RichTable:
    table = RichTable(title=part.title, caption=part.note or None, title_justify="left")
    for i, column in enumerate(part.columns):
        table.add_column(column, justify="left" if i < part.text_columns else "right")
    for row in part.rows:
        table.add_row(*(escape(str(c)) for c in row))
    return table


def _html_table(part: Table) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in part.columns)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in part.rows)
    note = f"<p class='note'>{html.escape(part.note)}</p>" if part.note else ""
    return f"<h3>{html.escape(part.title)}</h3><table><tr>{head}</tr>{rows}</table>{note}"


def _plot_png(part: Plot) -> str:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("--html needs matplotlib: pip install 'kvtier[plots]'") from None
    fig = Figure(figsize=(7.5, 3.8), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    part.draw(ax)
    ax.set_title(part.title, fontsize=10)
    ax.set_xlabel(part.xlabel)
    ax.set_ylabel(part.ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return png_base64(fig)


def png_base64(fig: Any, **savefig: Any) -> str:
    """A matplotlib figure as a base64 PNG, for an <img> of a self-contained page (`savefig`: its options)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **savefig)
    return base64.b64encode(buffer.getvalue()).decode()


def _plain(value: Any) -> Any:
    """numpy scalars and arrays, paths and sets, as JSON."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1000px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; margin: .5em 0 1em; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
th {{ background: #f3f3f3; }}
.good {{ color: #176117; font-weight: bold; }} .bad {{ color: #a11; font-weight: bold; }}
.note {{ color: #666; font-size: 0.85em; }}
figure {{ margin: 1em 0; }} figcaption {{ color: #666; font-size: 0.85em; }}
</style></head>
<body>
{body}
</body></html>
"""


# ---------------------------------------------------------------- number formats shared by the reports

def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def fmt_seconds(s: float) -> str:
    if s == 0:
        return "0"
    if s < 1e-3:
        return f"{s * 1e6:,.0f} µs"
    if s < 1:
        return f"{s * 1e3:,.1f} ms"
    if s < 120:
        return f"{s:,.2f} s"
    if s < 7200:
        return f"{s / 60:,.1f} min"
    return f"{s / 3600:,.1f} h"


def fmt_share(x: float) -> str:
    return f"{x:.1%}"
