"""The batch arithmetic, checked and explained before any compute is spent.

data.train_batch_size is the GLOBAL batch per optimizer step. Each of the dp_size data-parallel
ranks (world / ulysses_sequence_parallel_size: an sp group shares every micro-batch) runs its share
as micro-batches of data.micro_batch_size_per_gpu samples, or packed to data.max_token_len_per_gpu.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sfttrain.config import Config, ConfigError
from sfttrain.data.pack import balanced_bins, budget_bins


@dataclass(frozen=True)
class BatchPlan:
    dp_size: int
    global_batch: int
    micro_batch: int
    token_budget: Optional[int]
    num_rows: int
    steps_per_epoch: int
    total_steps: int
    sp_size: int = 1  # ulysses_sequence_parallel_size
    total_epochs: int = 1
    total_training_steps: Optional[int] = None  # when set, the total over the epochs

    @property
    def samples_per_rank(self) -> int:
        return self.global_batch // self.dp_size

    @property
    def accum_steps(self) -> int:
        """Micro-batches per optimizer step without a token budget (with one: decided per step)."""
        return self.samples_per_rank // self.micro_batch

    def describe(self) -> str:
        if self.token_budget:
            micro = f"packed to <= {self.token_budget} tokens per micro-batch (count varies per step)"
        else:
            micro = (f"{self.micro_batch} samples/micro-batch x {self.accum_steps} accumulation steps "
                     f"= {self.samples_per_rank} samples per rank")
        return "\n".join([
            f"  data-parallel ranks : {self.dp_size}{sequence_parallel_note(self.dp_size, self.sp_size)}",
            f"  global batch        : {self.global_batch} samples per optimizer step (data.train_batch_size)",
            f"  per rank            : {micro}",
            f"  dataset             : {self.num_rows} rows -> {self.steps_per_epoch} steps per epoch "
            f"({self.num_rows - self.steps_per_epoch * self.global_batch} rows left over each epoch)",
            f"  total steps         : {self.total_steps} = {self.in_epochs(self.total_steps)} ({self.total_source()})",
        ])

    def in_epochs(self, steps: int) -> str:
        """Steps as epochs: "2 epochs", "1 epoch and 8 of the next one's 32 steps"."""
        full, rest = divmod(steps, self.steps_per_epoch)
        if not full:
            return f"{rest} of the first epoch's {self.steps_per_epoch} steps"
        epochs = f"{full} epoch{'s' if full != 1 else ''}"
        return f"{epochs} and {rest} of the next one's {self.steps_per_epoch} steps" if rest else epochs

    def total_source(self) -> str:
        """Which key set the total; where total_training_steps (which wins) ends elsewhere than the
        epochs, that is said, not left to be found in the metrics' epoch column."""
        epochs = f"trainer.total_epochs={self.total_epochs}"
        if self.total_training_steps is None:
            return epochs
        steps = f"trainer.total_training_steps={self.total_training_steps}"
        by_epochs = self.total_epochs * self.steps_per_epoch
        if self.total_steps == by_epochs:
            return f"{steps}; {epochs} agrees"
        what = "runs on past them" if self.total_steps > by_epochs else "stops before their end"
        return f"{steps} wins over {epochs}, {by_epochs} steps: training {what}"

    def split(self, lengths: list[int], costs: list[float]) -> list[list[list[int]]]:
        """Sample indices per rank per micro-batch; every rank gets as many (each is a round of collectives)."""
        if self.token_budget:
            ranks = balanced_bins(costs, self.dp_size)
            per_rank = [budget_bins([lengths[i] for i in r], self.token_budget) for r in ranks]
            n_micro = max(len(bins) for bins in per_rank)
            return [[[r[i] for i in b] for b in bins] + [[] for _ in range(n_micro - len(bins))]
                    for r, bins in zip(ranks, per_rank)]
        ranks = balanced_bins(costs, self.dp_size, per_bin=self.samples_per_rank)
        return [[[r[i] for i in b] for b in balanced_bins([costs[i] for i in r], self.accum_steps, self.micro_batch)]
                for r in ranks]


def sequence_parallel_note(dp_size: int, sp_size: int) -> str:
    """" (8 ranks = 4 data-parallel x 2 sequence-parallel)" under Ulysses; nothing without it."""
    return (f" ({dp_size * sp_size} ranks = {dp_size} data-parallel x {sp_size} sequence-parallel)"
            if sp_size > 1 else "")


def make_plan(cfg: Config, dp_size: int, num_rows: int) -> BatchPlan:
    d, t = cfg.data, cfg.trainer
    b, mb, sp = d.train_batch_size, d.micro_batch_size_per_gpu, cfg.ulysses_sequence_parallel_size
    if problem := batch_problem(b, mb, dp_size, d.max_token_len_per_gpu, sp_size=sp):
        raise ConfigError(problem)
    steps_per_epoch = num_rows // b
    if steps_per_epoch == 0:
        raise ConfigError(f"the training data has {num_rows} rows, fewer than data.train_batch_size={b}: "
                          "lower the batch size or add data")
    total = t.total_training_steps or steps_per_epoch * t.total_epochs
    return BatchPlan(dp_size, b, mb, d.max_token_len_per_gpu, num_rows, steps_per_epoch, total, sp, t.total_epochs,
                     t.total_training_steps)


def batch_problem(b: int, mb: int, dp_size: int, token_budget: Optional[int], sp_size: int = 1) -> Optional[str]:
    """What is wrong with global batch b (None if it splits), with the nearest valid sizes."""
    per_rank = b // dp_size
    other_fix = ""
    ranks = f"{dp_size} data-parallel ranks{sequence_parallel_note(dp_size, sp_size)}"
    if b % dp_size:
        problem = f"data.train_batch_size={b} is not divisible by the {ranks}"
    elif not token_budget and per_rank % mb:
        problem = (f"data.train_batch_size={b} gives {per_rank} samples per data-parallel rank over {ranks}, "
                   f"not divisible by data.micro_batch_size_per_gpu={mb}")
        other_fix = f", or a data.micro_batch_size_per_gpu that divides {per_rank}"
    else:
        return None
    step = dp_size if token_budget else dp_size * mb  # the batches that split are its multiples: the nearest two
    valid = " or ".join(str(v) for v in (b // step * step, (b // step + 1) * step) if v > 0)
    return f"{problem}; use data.train_batch_size={valid}{other_fix}"
