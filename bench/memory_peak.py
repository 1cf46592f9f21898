"""What is live at the peak of a profiled window, from the allocator snapshot trainer.profile_memory wrote.

    python -m bench.memory_peak RUN_DIR/profile/memory_steps_6_rank0.pickle

The peak allocated memory of the window and, grouped by the innermost frame outside torch, the
window's own allocations live at it (https://pytorch.org/memory_viz draws the same history).
"""

from __future__ import annotations

import argparse
import collections
import os
import pickle

GIB = 2**30


def describe_peak(events: list[dict], allocated_before: int, top: int = 10) -> list[str]:
    """The window's peak allocated memory and, by where they were made, its allocations live then."""
    peak, live = live_at_peak(events)
    size, blocks = collections.Counter(), collections.Counter()
    for event in live:
        site = allocation_site(event.get("frames", []))
        size[site] += event["size"]
        blocks[site] += 1
    return [f"peak allocated in the window {(allocated_before + peak) / GIB:.2f} GiB ({allocated_before / GIB:.2f} "
            f"GiB allocated before it); of the window's own allocations live at the peak, by where they were made:",
            *(f"  {n / GIB:8.2f} GiB in {blocks[site]:5d} blocks  {site}" for site, n in size.most_common(top))]


def live_at_peak(events: list[dict]) -> tuple[int, list[dict]]:
    """The most bytes allocated beyond the window's start (alloc and free_requested events, as
    memory_allocated counts them) and the window's allocations live then."""
    current, peak, peak_at, live = 0, 0, -1, {}
    for i, event in enumerate(events):
        current += {"alloc": 1, "free_requested": -1}.get(event["action"], 0) * event["size"]
        if current > peak:
            peak, peak_at = current, i
    for event in events[:peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    return peak, list(live.values())


def allocation_site(frames: list[dict]) -> str:
    """The innermost frame outside torch, as file:line function."""
    for frame in frames:
        if f"{os.sep}torch{os.sep}" not in frame["filename"]:
            return f"{frame['filename']}:{frame['line']} {frame['name']}"
    return "torch" if frames else "(no stack)"


def report(snapshot: dict) -> list[str]:
    """Per device: what was allocated when recording began is what is allocated at the snapshot
    (its segments) less what the recorded events added."""
    lines = []
    for device, events in enumerate(snapshot["device_traces"]):
        if events:
            net = sum({"alloc": 1, "free_requested": -1}.get(e["action"], 0) * e["size"] for e in events)
            now = sum(s["allocated_size"] for s in snapshot["segments"] if s["device"] == device)
            lines += [f"cuda:{device}", *describe_peak(events, now - net)]
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot", help="a memory_steps_*.pickle from <run folder>/profile/")
    with open(ap.parse_args(argv).snapshot, "rb") as f:
        print("\n".join(report(pickle.load(f))))


if __name__ == "__main__":
    main()
