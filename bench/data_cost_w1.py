"""CPU time sfttrain spends building one W1 step (render 64 rows with the chat template, pack),
Python that holds the GIL: the reason `data.num_workers > 0` builds steps in worker processes.

    python3 -m bench.data_cost_w1 --data train.jsonl [--steps 10]
"""

import argparse
import time

from bench.w1_data import MAX_LENGTH, load_rows, load_tokenizer
from sfttrain.data.pack import pack
from sfttrain.data.render import Renderer

STEP = 64  # W1's sequences per optimizer step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="assets/data/gsm8k/train.jsonl")
    p.add_argument("--tokenizer", default="assets/tokenizers/qwen2.5-instruct")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    renderer = Renderer(load_tokenizer(args.tokenizer), max_length=MAX_LENGTH, truncation="right")
    rows = load_rows(args.data, args.steps * STEP)
    start = time.perf_counter()
    samples = [renderer.render(r["question"], r["answer"], i) for i, r in enumerate(rows)]
    rendered = time.perf_counter()
    for s in range(args.steps):
        pack(samples[s * STEP:(s + 1) * STEP], pad_to=128)
    packed = time.perf_counter()
    print(f"per {STEP}-row step: render {(rendered - start) / args.steps * 1e3:.1f} ms, "
          f"pack {(packed - rendered) / args.steps * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
