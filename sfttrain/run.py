"""Entry point: torchrun --nproc_per_node=N -m sfttrain.run [recipe.yaml] key=value ...

Parse the config, start the ranks, build the trainer, train, shut down cleanly.
"""

from __future__ import annotations

import gc
import sys

from sfttrain.config import ConfigError, load_config
from sfttrain.distributed import init_world, shutdown
from sfttrain.trainer import FSDPSFTTrainer, NonFiniteLossError


def parse_args(argv: list[str]) -> tuple[str | None, list[str]]:
    yaml_path = argv[0] if argv and "=" not in argv[0] else None
    return yaml_path, argv[1:] if yaml_path else argv


def main(argv: list[str] | None = None) -> None:
    yaml_path, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(yaml_path, overrides)
        world = init_world(cfg)
    except ConfigError as e:
        sys.exit(f"sfttrain: config error: {e}")
    try:
        FSDPSFTTrainer(cfg, world).train()
    except (ConfigError, NonFiniteLossError) as e:
        # every rank raises the same error; rank 0 says it once
        if world.is_main:
            print(f"sfttrain: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    shutdown(world)
    # Python's final garbage collection of torch's and transformers' object graphs costs seconds
    # of CPU per rank at exit; everything is written and closed by now, so skip it.
    gc.freeze()


if __name__ == "__main__":
    main()
