"""One document, two renderings: report.md (plots linked as files) and a self-contained report.html (plots
embedded as base64 PNG, no external resource), from the same list of blocks:
  ("h", level, text) | ("p", text) | ("ul", [text, ...]) | ("table", DataFrame) | ("img", file_name, caption)
  | ("banner", text) (a caveat said once, set apart) | ("links", [(text, [(label, relative href), ...]), ...])
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

import pandas as pd

CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1180px;margin:24px auto;
padding:0 16px;color:#1b1b1b;background:#fff}h1{border-bottom:2px solid #3b6ea5;padding-bottom:4px}
h2{color:#3b6ea5;margin-top:32px}table{border-collapse:collapse;margin:8px 0 16px;font-size:13px}
th,td{border:1px solid #c8d3df;padding:3px 8px;text-align:right}th{background:#e8eef5}
td:first-child,th:first-child{text-align:left}tr:nth-child(even) td{background:#f6f8fa}
img{max-width:100%;border:1px solid #ddd;margin:6px 0}figcaption{font-size:12px;color:#555}
.banner{background:#fff4d6;border-left:4px solid #e0a800;padding:8px 12px;margin:12px 0}
li{margin:3px 0}code{background:#f0f0f0;padding:0 3px}"""


def fmt(x, spec: str = ".3f", suffix: str = "") -> str:
    """A number for a table cell; '-' when missing."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, str):
        return x
    return format(x, spec) + suffix


def pct(x, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}%"


def gib(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x / 2**30:.2f} GiB"


def _numeric(col: pd.Series) -> bool:
    """Right-align a column whose cells read as numbers ('1.017', '37,718', '98.3%', '0.06 s', '-')."""
    cells = [str(v) for v in col if str(v) not in ("-", "", "None")]
    return bool(cells) and all(c[:1].isdigit() or c[:2].lstrip("+-")[:1].isdigit() for c in cells)


def _md_cell(v) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: list[tuple]) -> str:
    out: list[str] = []
    for b in blocks:
        kind = b[0]
        if kind == "h":
            out.append("#" * b[1] + " " + b[2])
        elif kind == "p":
            out.append(b[1])
        elif kind == "ul":
            out.append("\n".join(f"- {item}" for item in b[1]))
        elif kind == "table":
            df: pd.DataFrame = b[1]
            lines = [
                "| " + " | ".join(_md_cell(c) for c in df.columns) + " |",
                "|" + "|".join("---:" if _numeric(df[c]) else "---" for c in df.columns) + "|",
            ]
            lines += ["| " + " | ".join(_md_cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
            out.append("\n".join(lines))
        elif kind == "img":
            out.append(f"![{b[2]}]({b[1]})")
        elif kind == "banner":
            out.append(f"> **Note:** {b[1]}")
        elif kind == "links":
            out.append(
                "\n".join(f"- {text}: " + ", ".join(f"[{label}]({href})" for label, href in ls) for text, ls in b[1])
            )
        out.append("")
    return "\n".join(out)


def to_html(blocks: list[tuple], title: str, img_dir: Path) -> str:
    body: list[str] = []
    for b in blocks:
        kind = b[0]
        if kind == "h":
            body.append(f"<h{b[1]}>{html.escape(b[2])}</h{b[1]}>")
        elif kind == "p":
            body.append(f"<p>{html.escape(b[1])}</p>")
        elif kind == "ul":
            body.append("<ul>" + "".join(f"<li>{html.escape(i)}</li>" for i in b[1]) + "</ul>")
        elif kind == "table":
            body.append(b[1].to_html(index=False, border=0, escape=True))
        elif kind == "banner":
            body.append(f'<div class="banner"><strong>Note:</strong> {html.escape(b[1])}</div>')
        elif kind == "links":
            body.append(
                "<ul>"
                + "".join(
                    f"<li>{html.escape(text)}: "
                    + ", ".join(f'<a href="{html.escape(href)}">{html.escape(label)}</a>' for label, href in ls)
                    + "</li>"
                    for text, ls in b[1]
                )
                + "</ul>"
            )
        elif kind == "img":
            data = base64.b64encode((img_dir / b[1]).read_bytes()).decode("ascii")
            body.append(
                f'<figure><img alt="{html.escape(b[2])}" src="data:image/png;base64,{data}">'
                f"<figcaption>{html.escape(b[2])}</figcaption></figure>"
            )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
