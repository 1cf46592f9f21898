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
    # output to a file: one plain line per log_freq steps with the step count and tqdm's rate and ETA, no bar
    plain = r"^step (\d+)/24 \| epoch .* \| [\d.]+(s/step|step/s), ETA (\d+:)?\d\d:\d\d$"
    assert [int(s[0]) for s in re.findall(plain, out, re.M)] == [12, 24]
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


def test_step_lines_print_numbers_as_people_read_them():
    from sfttrain.metrics import format_line

    line = format_line({"step": 3, "epoch": 0, "loss": 1.23456, "lr": 2e-05, "tokens_per_s": 10590.4,
                        "loss_tokens_per_s": 999.5, "step_time_s": 0.61234}, 24)
    assert line == ("step 3/24 | epoch 0 | loss 1.235 | lr 2e-05 | tokens_per_s 10,590 | loss_tokens_per_s 999.5 | "
                    "step_time_s 0.6123")


def test_progress_bar_stays_above_the_summary(monkeypatch, tmp_path):
    """On a terminal: tqdm's bar counts from the first step logged, and once it is full what the run
    prints after it (its checkpoint, its summary) comes below it, the bar not drawn again."""
    import io

    from sfttrain.config import Config
    from sfttrain.metrics import MetricsLogger

    class Terminal(io.StringIO):  # what the bar (stderr) and the lines (stdout) share
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.setattr(sys, "stdout", screen)
    logger = MetricsLogger(Config(), str(tmp_path), True, 3, 0)
    for step in (1, 2, 3):
        logger.log(step, {"loss": 1.0 / step, "step_time_s": 0.5})
    logger.info("done: 3 steps in 1 s")
    logger.close()
    text = screen.getvalue()
    assert re.search(r"train: +100%\|[^\n\r]*\| 3/3 \[", text), text
    assert "train:" not in text[text.index("done: 3 steps"):], text
    assert re.search(r"^step 3/3 \| loss 0.3333 \| step_time_s 0.5$", text, re.M), text  # no ETA: the bar has it


def test_a_cpu_run_is_plotted_without_an_empty_memory_panel(tmp_path):
    """A CPU run records no GPU memory: its picture is the three panels it has, titled with the run's
    name, not its absolute path."""
    from sfttrain.plot import figure, read_series

    run_dir = tmp_path / "runs" / "demo"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(
        f'{{"step": {s}, "loss": {2 / s}, "lr": 1e-05, "tokens_per_s": 9000.0, "loss_tokens_per_s": 4000.0}}\n'
        for s in (1, 2, 3)))
    fig = figure(read_series(str(run_dir / "metrics.jsonl")), str(run_dir))
    assert [ax.get_title() for ax in fig.axes] == ["loss", "learning rate", "throughput (tokens/s)"]
    assert all(not ax.texts for ax in fig.axes)  # no "not recorded" panel
    assert fig.get_suptitle() == "demo"
