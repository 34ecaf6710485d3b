#!/usr/bin/env python3
"""PNG plots of TTFT, ITL and output throughput vs concurrency from sweep CSVs (perf/loadgen.py's or
perf/sweep_aiperf.sh's; same columns). Several CSVs are drawn on the same axes, labelled by --labels or by their
directory names, e.g. aiperf next to loadgen.

  python perf/plot_sweep.py perf/results/sweep_x/sweep.csv [other.csv ...] --out perf/results/sweep_x
"""
import argparse
import csv
import math
import pathlib

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers
import matplotlib.pyplot as plt  # noqa: E402

# (file name, y label, [(column, line label suffix, line style)])
PLOTS = [
    ("ttft.png", "TTFT (ms)", [("ttft_p50_ms", "p50", "-"), ("ttft_p90_ms", "p90", "--"), ("ttft_p99_ms", "p99", ":")]),
    ("itl.png", "ITL (ms)", [("itl_p50_ms", "p50", "-"), ("itl_p99_ms", "p99", ":")]),
    ("throughput.png", "output tokens/s", [("output_tok_per_s", "", "-")]),
]


def read(path: pathlib.Path) -> list[dict]:
    with open(path) as f:
        return sorted(csv.DictReader(f), key=lambda r: int(r["concurrency"]))


def value(row: dict, column: str) -> float:
    try:
        return float(row[column])
    except (KeyError, TypeError, ValueError):  # a column aiperf did not export, or an empty cell
        return math.nan


def plot(sweeps: dict[str, list[dict]], out: pathlib.Path, title: str) -> list[pathlib.Path]:
    written = []
    levels = sorted({int(r["concurrency"]) for rows in sweeps.values() for r in rows})
    for name, ylabel, lines in PLOTS:
        fig, ax = plt.subplots(figsize=(5, 3.5), dpi=80)  # small: these PNGs are committed
        for i, (label, rows) in enumerate(sweeps.items()):
            x = [int(r["concurrency"]) for r in rows]
            for column, suffix, style in lines:
                ax.plot(x, [value(r, column) for r in rows], style, marker="o", markersize=3, color=f"C{i}",
                        label=" ".join(s for s in (label, suffix) if s))
        ax.set_xscale("log", base=2)  # levels are roughly powers of two
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[1]:  # a single CSV's throughput line has no label
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="+", type=pathlib.Path)
    p.add_argument("--labels", default=None, help="comma-separated, one per CSV (default: their directory names)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="directory (default: the first CSV's)")
    p.add_argument("--title", default="")
    args = p.parse_args()
    labels = args.labels.split(",") if args.labels else [c.resolve().parent.name for c in args.csv]
    if len(args.csv) == 1 and not args.labels:
        labels = [""]
    out = args.out or args.csv[0].parent
    out.mkdir(parents=True, exist_ok=True)
    for path in plot({label: read(c) for label, c in zip(labels, args.csv)}, out, args.title):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
