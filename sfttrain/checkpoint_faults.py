"""The one message of a checkpoint that was not saved: what failed on which rank, what is left of it,
the last good checkpoint and what to do. Worded once, on rank 0, from every rank's error in one line
(sfttrain.checkpoint_state.one_line); sfttrain.checkpoint raises it on every rank."""

from __future__ import annotations

import os
import shutil
from typing import Optional

from sfttrain.checkpoint_folder import complete_checkpoints, size_text, tree_bytes
from sfttrain.config import TrainerConfig
from sfttrain.faults import (SIZE_LIMIT_FIX, disk_full, fault, folder_gone, over_size_limit, peer_lost, resumes_from,
                             what_next)

NOT_STARTED = "so it was not started"  # how NotEnoughSpace's message ends
# a write is taken for stuck only past trainer.nccl_timeout and past its rank's share of the checkpoint
# at this rate: a large checkpoint on slow storage (one GPU's 8B model and AdamW state, 96 GB, on a
# 50 MB/s NFS: 32 minutes) is slow, not stuck
SLOWEST_WRITE_BYTES_PER_S = 20e6


def stuck_text(step: int, seconds: float, limit_s: float, nccl_timeout: int, committed: Optional[str],
               run_dir: str) -> str:
    return (f"the checkpoint of step {step} was not saved: its write has not finished {seconds:.0f} s after it began "
            f"(the longest a write may take here: {limit_s:.0f} s, the larger of trainer.nccl_timeout={nccl_timeout} "
            f"and a rank's share of the checkpoint at {SLOWEST_WRITE_BYTES_PER_S / 1e6:.0f} MB/s): it is stuck, e.g. "
            "on a network filesystem that stopped answering or in a checkpoint writer process that was stopped. "
            f"Nothing of it was committed; the last good checkpoint is {committed or 'none'}. Check that {run_dir} "
            f"answers (ls, df). {resumes_from(committed)}. A write that is only slow needs a larger "
            "trainer.nccl_timeout")


def not_saved(t: TrainerConfig, run_id: str, step: int, errors: list[Optional[str]], limited: Optional[str],
              left: bool, renamed: bool, last_bytes: Optional[int]) -> str:
    """What failed, what is left, and what to do (`limited`: a file of the save at the file size limit;
    `left`: its partial folder could not be removed, on a disk turned read-only, say; `renamed`: the commit
    failed after its rename, whose fsync a failing disk refused: the folder is whole, its name may not last)."""
    run_dir, keep = t.default_local_dir, t.max_ckpt_to_keep
    if gone := folder_gone(run_dir):  # and its checkpoints and free space with it
        return f"the checkpoint of step {step} was not saved: {gone}"
    own = [(s, path) for s, path in complete_checkpoints(run_dir, run_id) if not (renamed and s == step)]
    last = own[-1][1] if own else None
    why, fix = _why_not_saved(run_dir, errors, limited, last_bytes or (tree_bytes(last) if last else None), keep)
    if renamed:
        final = os.path.join(run_dir, f"global_step_{step}")
        return (f"the checkpoint of step {step} may not be saved: {why}, in its commit, once its files were on the "
                f"disk and its folder renamed to {final}: whether the rename reached the disk is not known. The last "
                f"good checkpoint before it is {last or 'none'}. {fix}. The same command then resumes from {final} where it "
                f"is there (whole), else from {last or 'nothing: it starts afresh'}")
    partial = (f"its partial folder .global_step_{step}.tmp is left, and the next start deletes it" if left
               else "its partial folder was removed")
    return (f"the checkpoint of step {step} was not saved: {why}. Nothing of it was committed ({partial}); "
            f"the last good checkpoint is {last or 'none'}. {fix}. {what_next(t)}")


def _why_not_saved(run_dir: str, errors: list[Optional[str]], limited: Optional[str], size: Optional[int],
                   keep: Optional[int]) -> tuple[str, str]:
    """(the failure in words, what to do): the file size limit, a full disk and how much space there
    is, another fault of a filesystem (sfttrain.faults), or any other error."""
    failed = [(rank, text) for rank, text in enumerate(errors) if text is not None]
    # a rank that lost a peer inside a collective reports only that: the cause is the peer's error
    causes = [(rank, text) for rank, text in failed if not peer_lost(text)] or failed
    full = [(rank, text) for rank, text in causes if disk_full(text)]
    rank, text = (full or causes)[0]
    if limited or over_size_limit(text):  # the disk may have room: a file met the limit (EFBIG)
        return (f"the file size limit (ulimit -f) was reached ({f'{limited}: ' if limited else ''}{text}, on rank "
                f"{rank})"), SIZE_LIMIT_FIX
    found = fault(text, run_dir)
    if found is not None and not (full and found.in_run_folder):  # not the run folder's disk filling
        return f"{found.cause}, on rank {rank}", found.fix  # read-only, denied, open files, another disk full
    why = (f"the disk is full ({text}, on rank {rank})" if full
           else f"{text} (rank {rank}{f' and {len(failed) - 1} other ranks' if len(failed) > 1 else ''})")
    if not (full or NOT_STARTED in text):
        return why, "Fix what the error names"
    space = f"{run_dir} has {size_text(shutil.disk_usage(run_dir).free)} free" + \
        (f"; a checkpoint takes {size_text(size)}" if size else "") + \
        (f" (max_ckpt_to_keep={keep} needs room for {keep + 1}: the oldest is deleted after the next commit)"
         if keep and size else "")
    return why, (f"{space}. Free space (or set trainer.default_local_dir on a larger disk, or lower "
                 "trainer.max_ckpt_to_keep)")

