"""`python -m sfttrain.plot RUN_DIR [--out FILE]`: a run's curves from its metrics.jsonl, as one PNG.

A panel each for loss, learning rate, throughput and peak GPU memory, those the run recorded (a CPU
run has no GPU memory). Writes RUN_DIR/metrics.png unless --out says otherwise; needs no display.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only: works on a login node or in a SLURM job without a display
import matplotlib.pyplot as plt  # noqa: E402

from sfttrain.errors import DataError  # noqa: E402

# panel title -> (metrics.jsonl key, label) for each curve it draws
PANELS = {
    "loss": [("loss", "train"), ("val/loss", "validation")],
    "learning rate": [("lr", "lr")],
    "throughput (tokens/s)": [("tokens_per_s", "real tokens"), ("loss_tokens_per_s", "supervised tokens")],
    "peak GPU memory (GiB)": [("mem_peak_alloc_gib", "allocated"), ("mem_peak_reserved_gib", "reserved")],
}


def read_series(path: str) -> dict[str, tuple[list[int], list[float]]]:
    """key -> (steps, values); a step logged twice (a run resumed after it) keeps its last value. Lines
    that do not read (cut short by a crash) are left out and said on stderr."""
    if not os.path.isfile(path):
        raise DataError(f"{path} does not exist: give the run folder (trainer.default_local_dir) of a run")
    by_key: dict[str, dict[int, float]] = {}
    unread = []
    with open(path, errors="replace") as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not (isinstance(record, dict) and isinstance(record.get("step"), int)):
                unread += [number] if line.strip() else []
                continue
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    by_key.setdefault(key, {})[record["step"]] = value
    if unread:
        print(f"sfttrain plot: {path}: line(s) {', '.join(map(str, unread[:5]))}{' ...' if len(unread) > 5 else ''} "
              "do not read as a JSON record (cut short by a crash or a full disk while the run wrote them): left out "
              "of the curves. The run's next start (a resume) moves them to metrics_rewound.jsonl", file=sys.stderr)
    if not by_key:
        raise DataError(f"{path} holds no step's record ({os.path.getsize(path)} bytes): the run logged no step yet, "
                        "or the file was lost in a crash before it reached the disk (a resume says so and starts it "
                        "again at the step it resumes from)")
    return {key: (sorted(values), [values[s] for s in sorted(values)]) for key, values in by_key.items()}


def figure(series: dict[str, tuple[list[int], list[float]]], run_dir: str):
    panels = {name: [(k, label) for k, label in curves if k in series] for name, curves in PANELS.items()}
    panels = {name: curves for name, curves in panels.items() if curves} or {"loss": []}
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 8), sharex=True, squeeze=False)
    for ax, (name, curves) in zip(axes[:, 0], panels.items()):
        for key, label in curves:
            steps, values = series[key]
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
        if len(curves) > 1:
            ax.legend()
        ax.set_title(name)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sfttrain.plot",
                                     description="A run's loss, learning rate, throughput and memory as one PNG.")
    parser.add_argument("run_dir", help="the run folder holding metrics.jsonl")
    parser.add_argument("--out", help="the PNG to write (default RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.run_dir, "metrics.png")
    try:
        series = read_series(os.path.join(args.run_dir, "metrics.jsonl"))
    except DataError as e:
        print(f"sfttrain plot: {e}", file=sys.stderr)
        return e.exit_code
    fig = figure(series, args.run_dir)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
