"""Seeing a run: the plain progress lines of a run whose output is not a terminal, the checkpoint
line, no MFU on CPU (no peak to compare with), and `python -m sfttrain.plot` on its metrics."""

import re
import subprocess
import sys

from PIL import Image

from tests.conftest import REPO, read_metrics


def test_short_run_is_logged_and_plotted(demo_run):
    """conftest's demo_run: 24 steps, validation, a checkpoint and a log line every 12 steps."""
    run_dir, out = demo_run
    # output to a file: one plain line per log_freq steps with the step count and an ETA, no bar
    assert [int(s) for s in re.findall(r"^step (\d+)/24 \| epoch .* s/step, ETA \d+:\d\d:\d\d$", out, re.M)] == [12, 24]
    assert "train:" not in out and "\r" not in out  # no tqdm bar
    assert re.search(r"^checkpoint global_step_12 committed: .* training stalled \d+\.\d+ s", out, re.M), out[-3000:]
    records = read_metrics(run_dir)
    assert all("mfu" not in r for r in records)  # CPU: no peak to compare with
    assert sum("val/loss" in r for r in records) == 2
    # the run's last lines: what it trained, as metrics.jsonl has it, and the commands that go on from it
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [r["val/loss"] for r in records if "val/loss" in r][-1]
    summary = out[out.index("\ndone: "):].splitlines()[1:]
    assert summary[0].startswith("done: 24 steps in ") and summary[0].endswith(
        f"; loss {losses[0][1]:.4g} (step 1) -> {losses[-1][1]:.4g} (step 24); val/loss {val:.4g}"), summary
    final = run_dir / "global_step_24"
    assert summary[1:] == [f"  final checkpoint : {final}",
                           f"  export           : python -m sfttrain.export {final} <hf_folder> [--dtype bf16]",
                           f"  plot             : python -m sfttrain.plot {run_dir}"], summary

    png = run_dir / "metrics.png"
    done = subprocess.run([sys.executable, *summary[3].split(": ", 1)[1].split()[1:]], cwd=REPO, capture_output=True,
                          text=True)  # the plot command as the summary gives it
    assert done.returncode == 0, done.stderr
    with Image.open(png) as image:
        image.verify()  # a complete, valid PNG
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1200, 800)
        assert len(image.getcolors(1 << 20)) > 10  # curves drawn, not a blank canvas


def test_plot_names_a_folder_without_metrics(tmp_path):
    done = subprocess.run([sys.executable, "-m", "sfttrain.plot", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True)
    assert done.returncode == 3 and "metrics.jsonl does not exist" in done.stderr and "Traceback" not in done.stderr
