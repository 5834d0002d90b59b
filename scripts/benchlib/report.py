"""Result files: CSV rows, Markdown tables, a summary with its command and conditions; medians and quantiles."""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

from .conditions import Conditions


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format) with format like '{:.2f}'; missing/None values print '-'."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("-" if v is None or (isinstance(v, float) and v != v) else fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_summary(path: Path, title: str, cond: Conditions, body: str, command: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    command = command or " ".join([Path(sys.executable).name, *sys.argv])
    text = f"# {title}\n\nCommand: `{command}`\n\n{cond.markdown()}\n\n{body}\n"
    path.write_text(text)
    (path.with_suffix(".conditions.json")).write_text(json.dumps(cond.as_dict(), indent=2))


def median(values) -> float:
    values = [v for v in values if v is not None and v == v]
    return statistics.median(values) if values else float("nan")


def quantile(values, q: float) -> float:
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan")
    pos = q * (len(values) - 1)
    low = int(pos)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (pos - low)
