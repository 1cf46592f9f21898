"""The words of a save that failed: what failed, what is left of it, and what to do. `saver` is the
sfttrain.checkpoint.Checkpointer whose save failed."""

from __future__ import annotations

import os
import shutil
from typing import Optional

from sfttrain.checkpoint_folder import complete_checkpoints, size_text, tree_bytes
from sfttrain.faults import (SIZE_LIMIT_FIX, disk_full, fault, folder_gone, over_size_limit, peer_lost, resumes_from,
                             what_next)

NOT_STARTED = "so it was not started"  # how the message of a save refused for lack of space ends


def stuck_message(saver, step: int, seconds: float, rate: float) -> str:
    last = saver.committed
    return (f"the checkpoint of step {step} was not saved: its write has not finished "
            f"{seconds:.0f} s after it began (the longest a write may take here: "
            f"{saver.stuck_after_s:.0f} s, the larger of trainer.nccl_timeout={saver.cfg.trainer.nccl_timeout} and a "
            f"rank's share of the checkpoint at {rate / 1e6:.0f} MB/s): it is stuck, e.g. on a network filesystem "
            f"that stopped answering or in a checkpoint writer process that was stopped. Nothing of it was committed; "
            f"the last good checkpoint is {last or 'none'}. Check that {saver.run_dir} answers (ls, df). "
            f"{resumes_from(last)}. A write that is only slow needs a larger trainer.nccl_timeout")


def not_saved(saver, step: int, errors: list[Optional[str]], limited: Optional[str], left: bool,
               renamed: bool) -> str:
    """What failed, what is left, and what to do (`limited`: a file at the file size limit; `left`: the
    partial folder could not be removed; `renamed`: the commit failed after its rename, whose fsync
    a failing disk refused)."""
    if gone := folder_gone(saver.run_dir):  # and its checkpoints and free space with it
        return f"the checkpoint of step {step} was not saved: {gone}"
    own = [(s, path) for s, path in complete_checkpoints(saver.run_dir, saver.run_id) if not (renamed and s == step)]
    last = own[-1][1] if own else None
    why, fix = _why_not_saved(saver, errors, limited, last)
    if renamed:
        final = os.path.join(saver.run_dir, f"global_step_{step}")
        return (f"the checkpoint of step {step} may not be saved: {why}, in its commit, once its files were on the "
                f"disk and its folder renamed to {final}: whether the rename reached the disk is not known. The last "
                f"good checkpoint before it is {last or 'none'}. {fix}. The same command then resumes from {final} "
                f"where it is there (whole), else from {last or 'nothing: it starts afresh'}")
    partial = (f"its partial folder .global_step_{step}.tmp is left, and the next start deletes it" if left
               else "its partial folder was removed")
    return (f"the checkpoint of step {step} was not saved: {why}. Nothing of it was committed ({partial}); "
            f"the last good checkpoint is {last or 'none'}. {fix}. {what_next(saver.cfg.trainer)}")


def _why_not_saved(saver, errors: list[Optional[str]], limited: Optional[str],
                   last: Optional[str]) -> tuple[str, str]:
    """(the failure in words, what to do)."""
    failed = [(rank, text) for rank, text in enumerate(errors) if text is not None]
    # a rank that lost a peer inside a collective reports only that: the cause is the peer's error
    causes = [(rank, text) for rank, text in failed if not peer_lost(text)] or failed
    full = [(rank, text) for rank, text in causes if disk_full(text)]
    rank, text = (full or causes)[0]
    if limited or over_size_limit(text):  # the disk may have room: a file met the limit (EFBIG)
        return (f"the file size limit (ulimit -f) was reached ({f'{limited}: ' if limited else ''}{text}, on rank "
                f"{rank})"), SIZE_LIMIT_FIX
    found = fault(text, saver.run_dir)
    if found is not None and not (full and found.in_run_folder):  # not the run folder's disk filling
        return f"{found.cause}, on rank {rank}", found.fix  # read-only, denied, open files, another disk full
    why = (f"the disk is full ({text}, on rank {rank})" if full
           else f"{text} (rank {rank}{f' and {len(failed) - 1} other ranks' if len(failed) > 1 else ''})")
    if not (full or NOT_STARTED in text):
        return why, "Fix what the error names"
    size = saver.last_bytes or (tree_bytes(last) if last else None)
    keep = saver.cfg.trainer.max_ckpt_to_keep
    space = f"{saver.run_dir} has {size_text(shutil.disk_usage(saver.run_dir).free)} free" + \
        (f"; a checkpoint takes {size_text(size)}" if size else "") + \
        (f" (max_ckpt_to_keep={keep} needs room for {keep + 1}: the oldest is deleted after the next commit)"
         if keep and size else "")
    return why, (f"{space}. Free space (or set trainer.default_local_dir on a larger disk, or lower "
                 "trainer.max_ckpt_to_keep)")

