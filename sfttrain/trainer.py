"""FSDPSFTTrainer: builds the pieces, then one obvious training loop."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sfttrain import checks, checkpoint, export, fp8, lora, moe, profiling, recompute
from sfttrain.attention import describe_backend
from sfttrain.checkpoint_folder import describe_retention, is_complete, read_state, remove_stale_tmp
from sfttrain.config import Config, logger_names, moot_settings
from sfttrain.data.loader import StepBatch, TrainData, describe_workers, step_batches, validation_batches
from sfttrain.data.files import CONVERTED_DIR
from sfttrain.data.pack import max_segment_length
from sfttrain.data.parquet import DataFileChanged
from sfttrain.data.prepare import LENGTHS_DIR, describe
from sfttrain.distributed import World, check_shared_run_dir, describe_auto_cpu, from_every_rank, ranks_of_this_launcher
from sfttrain.errors import NonFiniteLossError, StoppedBySignal
from sfttrain.faults import what_next
from sfttrain.flops import ModelShape
from sfttrain.loss import CausalLMLoss, select_chunk_loss, step_objective
from sfttrain.metrics import (MetricsLogger, StepEnd, describe_host_memory, describe_software,
                              host_memory_gib, memory_stats, start_wandb, throughput)
from sfttrain.model import decoder_layers, load_model, local_model_folder, stop_generation_at
from sfttrain.optim import build_optimizer, build_scheduler, clipped_step, describe_schedule, schedule_settings
from sfttrain.parallel import describe_compile, describe_sharding, gradient_sync, parallelize
from sfttrain.checkpoint_folder import Resume
from sfttrain.resolved import resolve
from sfttrain.resume import check_resume, find_resume, lock_run_folder
from sfttrain.runtime import Runtime


@dataclass
class QueuedStep:
    """A step whose update is queued on the device; its numbers reach the host later."""
    step: int
    batch: StepBatch
    lr: float
    data_wait: float
    end: StepEnd


class FSDPSFTTrainer:
    def __init__(self, cfg: Config, world: World, runtime: Runtime):
        self.cfg, self.world, self.runtime = cfg, world, runtime
        d, t = cfg.data, cfg.trainer
        self.run_dir = t.default_local_dir
        check_shared_run_dir(self.run_dir, world)  # every node writes its shards there
        self.folder_warnings = lock_run_folder(self.run_dir, runtime.locks)  # one run at a time in a run folder

        # every problem the checks and the row scan find, listed before the model is loaded
        folder, rows, self.plan, self.data_report = checks.start_run(cfg, world)
        self.tokenizer, renderer = rows.tokenizer, rows.renderer
        restored = remove_stale_tmp(self.run_dir, (CONVERTED_DIR, LENGTHS_DIR)) if world.is_main else []
        resume = find_resume(t, self.run_dir)
        base = lora.trained_identity(cfg.model, folder) if cfg.model.lora_rank > 0 else None
        self.state = checkpoint.TrainState(global_batch=d.train_batch_size, seed=t.seed, data=rows.fingerprint,
                                           schedule=schedule_settings(cfg.optim, self.plan.total_steps),
                                           run_id=resume.run_id, base=base)
        resume_from = resume.path
        resume_notes = restored + resume.notes + (check_resume(resume_from, cfg, self.state) if resume_from else [])
        wandb_run = None  # rank 0's, started before the model loads: a missing login stops the run here
        if world.is_main and "wandb" in logger_names(t):
            wandb_run = start_wandb(cfg, self.run_dir, read_state(resume_from)["wandb_id"] if resume_from else None)

        self.host_rss_before_model = host_memory_gib().get("host_rss_gib")
        self.build_model(renderer)
        self.data = TrainData(rows.source, renderer, self.plan, rows.stats, world.dp_rank, t.seed, d.shuffle,
                              self.model_shape.attention_coefficient, d.pad_to_multiple, world.row_slice)
        val = rows.val_samples
        self.val_batches = (validation_batches(val, d.micro_batch_size_per_gpu, d.max_token_len_per_gpu,
                                               d.pad_to_multiple, world.device, world.row_slice)
                            if val is not None else None)

        if resume_from:
            self.state = checkpoint.load(resume_from, self.lm.model, self.optimizer, self.scheduler, world, cfg,
                                         self.state)
        self.logger = MetricsLogger(cfg, self.run_dir, world.is_main, self.plan.total_steps,
                                    wandb_id=self.state.wandb_id, wandb_run=wandb_run)
        self.checkpointer = checkpoint.Checkpointer(self.run_dir, world, cfg, resume.run_id, self.logger.event,
                                                    self.lm.model, self.optimizer, self.tokenizer,
                                                    self.resolved.async_save_writer)
        self.last_end = StepEnd(world.device)  # where the next step's time starts
        # this rank's vote to stop (trainer.save_on_sigterm), a number in each step's all-reduce
        self.vote, self.voted, self.stopping = torch.zeros(1, device=world.device), False, False
        self.profiler = profiling.StepProfiler(t, self.run_dir, world.rank, world.device, self.logger.info)
        self._print_startup(resume, resume_notes)

    def build_model(self, renderer) -> None:
        """The model, sharded and compiled in its loss module, its optimizer and LR schedule."""
        cfg, world = self.cfg, self.world
        loaded = load_model(cfg.model, world.device)
        model = loaded.model
        self.answer_end = renderer.describe_end(stop_generation_at(model, renderer.end_token_id))
        self.model_shape = ModelShape.of(model)
        chunk_loss, loss_kernel = select_chunk_loss(cfg.model.loss_kernel, world.device.type, cfg.model.compile)
        self.resolved = resolve(cfg, world.device, loaded, loss_kernel)
        longest_segment = max_segment_length(cfg.data.max_length, cfg.data.pad_to_multiple, world.row_slice[1])
        self.lm = CausalLMLoss(model, fused=self.resolved.liger,
                               compiled_max_seqlen=longest_segment if cfg.model.compile else None,
                               chunk_loss=chunk_loss, chunk_tokens=cfg.model.loss_chunk_tokens,
                               attention=self.resolved.attention)
        self.layout = parallelize(self.lm, world, cfg, self.resolved)
        self.optimizer = build_optimizer(self.lm, cfg.optim)
        if hook := fp8.scale_precompute_hook(self.lm.model):
            self.optimizer.register_step_post_hook(hook)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.plan.total_steps)

    def _print_startup(self, resume: Resume, resume_notes: list[str]) -> None:
        cfg, shape = self.cfg, self.model_shape
        fsdp = cfg.model.fsdp_config
        loss = ("Liger's fused linear cross-entropy" if self.resolved.liger else f"chunked linear cross-entropy, "
                f"{cfg.model.loss_chunk_tokens}-token chunks, softmax kernel {self.resolved.loss_kernel}")
        loss += ", logits only at the positions with a target"
        threads = torch.get_num_threads()
        host = {**here, "before_model_gib": self.host_rss_before_model} if (here := host_memory_gib()) else {}
        lines = [
            "sfttrain",
            f"  world size          : {self.world.world_size} ({self.world.device.type}, {threads} CPU "
            f"thread{'s' if threads > 1 else ''} per rank), mesh {tuple(self.world.mesh.shape)} "
            f"{self.world.mesh.mesh_dim_names}",
            *describe_auto_cpu(cfg, self.world.device),
            *([describe_software(self.world.device)] if self.world.is_main else []),  # git asked once, not per rank
            self.plan.describe(),
            f"  model               : {cfg.model.partial_pretrain} ({shape.num_params / 1e6:.2f}M params, "
            f"{shape.trainable_params / 1e6:.2f}M trainable{shape.describe_active()}, {shape.num_layers} layers), "
            f"attention {describe_backend(self.resolved.attention)}",
            self.resolved.describe(cfg),
            *lora.describe(cfg.model),
            *moe.describe_lora(self.lm.model, cfg.model),
            f"  loss                : {loss}",
            f"  precision           : weights/optimizer {fsdp.model_dtype}, mixed precision {fsdp.mixed_precision}",
            f"  sharding            : {describe_sharding(self.world, cfg, self.layout)}",
            f"  compile             : {describe_compile(cfg, self.world, self.lm.model.config, self.resolved)}",
            recompute.describe(decoder_layers(self.lm.model), cfg.model, not self.resolved.recompute_attention),
            *fp8.describe(self.lm.model, cfg.model, self.resolved.fp8),
            *describe_schedule(cfg.optim, self.plan.total_steps),
            f"  run folder          : {self.run_dir}",
            *describe_retention(cfg.trainer.max_ckpt_to_keep),
            *moot_settings(cfg),
            *self.folder_warnings,
            *profiling.describe(cfg.trainer, self.run_dir, self.state.step, self.world.device),
            describe(self.data_report),
            self.answer_end,
            *describe_workers(cfg.data.num_workers, ranks_of_this_launcher()),
            resume.line(f"{resume.path or 'fresh start'} (step {self.state.step}, run id {self.state.run_id})"),
            *(f"    {note}" for note in resume_notes),
            f"  host memory         : {describe_host_memory(from_every_rank(host))}",
        ]
        if fsdp.model_dtype != "fp32" and cfg.model.lora_rank == 0:  # LoRA's adapters are fp32 anyway
            lines.append(f"  WARNING: model_dtype={fsdp.model_dtype} keeps master weights and AdamW state in "
                         f"{fsdp.model_dtype}: updates below ~1/256 of a weight are rounded away (at lr "
                         f"{cfg.optim.lr} most are). Use model_dtype=fp32 with mixed_precision=true.")
        self.logger.info("\n".join(lines))

    def train(self) -> None:
        t = self.cfg.trainer
        total = self.plan.total_steps
        batches = iter(step_batches(self.data, self.state.epoch, self.state.consumed_in_epoch,
                                    self.cfg.data.num_workers, pin_memory=self.world.device.type == "cuda"))
        self.lm.train()  # once here, not each step (host time with LoRA's many modules); validation restores it
        self.last_end = StepEnd(self.world.device)  # start-up is not step time
        started, first_step = time.perf_counter(), self.state.step
        queued = None  # the previous step: its update is queued on the device, its numbers not yet read
        with self.runtime.noting(t.save_on_sigterm):
            while self.state.step < total:
                self.runtime.enter(f"step {self.state.step + 1}")
                wait_start = time.perf_counter()
                self.profiler.before_step(self.state.step + 1)
                try:
                    batch = next(batches)
                except DataFileChanged as e:  # said with the last committed checkpoint
                    raise e.then_resume(what_next(t)) from None
                queued = self.step(batch, time.perf_counter() - wait_start, queued)
                profiled = self.profiler.after_step(self.state.step)  # the window's end writes its trace
                self.checkpointer.poll()  # commits a background save once every rank has written it
                step = self.state.step
                last = step == total
                # every rank read the same vote (finish); a lone rank's own note is the verdict, a step sooner
                self.stopping = self.stopping or (self.world.world_size == 1 and bool(self.runtime.received))
                validate = self.val_batches is not None and (last or (t.test_freq > 0 and step % t.test_freq == 0))
                pause = validate or profiled or self.saves(step, last)
                if pause:
                    self.finish(queued)  # checkpoints only of steps known to be finite
                    queued = None
                if validate and (loss := self.validate()) is not None:  # None: a stop was voted during it
                    self.logger.log(step, {"val/loss": loss})
                if self.saves(step, last):  # (a stop voted in finish or validation saves this step)
                    self.save()
                if self.stopping and not last:
                    self.stop()
                if pause:
                    self.last_end = StepEnd(self.world.device)  # not training time (logging and data waits are)
        self.checkpointer.close()
        if t.save_hf:
            self.export_hf()
        # the run's last lines: what it trained, where the result is, the commands that go on from it
        final = os.path.join(self.run_dir, f"global_step_{total}")
        exported = os.path.join(final, export.HF_EXPORT_DIR)
        self.logger.info(self.logger.summary(total - first_step, time.perf_counter() - started, self.run_dir,
                                             final if is_complete(final) else None,
                                             exported if os.path.isdir(exported) else None))
        self.logger.close()

    def step(self, batch: StepBatch, data_wait: float, previous: QueuedStep | None) -> QueuedStep:
        """Queues one optimizer step; the previous step's numbers are read after this one is queued, so
        the GPU never idles while the host logs."""
        loss_sum = self.forward_backward(batch)
        if previous is not None:
            self.finish(previous)
        return self.update(batch, loss_sum, data_wait)

    def forward_backward(self, batch: StepBatch) -> torch.Tensor:
        """Queues the step's forward and backward passes; returns the summed loss (on the device)."""
        loss_sum = torch.zeros((), device=self.world.device)
        for i, micro in enumerate(batch.micro_batches):
            gradient_sync(self.lm, last_micro_batch=i == len(batch.micro_batches) - 1)
            micro_loss = self.lm(micro.to(self.world.device))
            step_objective(self.lm, micro_loss, batch, self.world.world_size).backward()
            loss_sum += micro_loss.detach()
        return loss_sum

    def update(self, batch: StepBatch, loss_sum: torch.Tensor, data_wait: float) -> QueuedStep:
        """Queues the clipped update (skipped on the device if the loss or the norm is not finite)."""
        router = self.lm.router.step_stats(loss_sum.device) if self.lm.router else loss_sum.new_zeros(0)
        totals = torch.cat([loss_sum.reshape(1), self.stop_flag(), router])
        dist.all_reduce(totals)  # one all-reduce: the loss, the ranks' votes to stop, the router's statistics
        loss_sum = totals[0]
        lr = self.optimizer.param_groups[0]["lr"]
        # the optimizer's list, not the model's: walking LoRA's thousands of modules costs host time each step
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        max_norm = self.cfg.optim.clip_grad if self.cfg.optim.clip_grad > 0 else math.inf
        grad_norm, stepped = clipped_step(self.optimizer, params, max_norm, loss_sum)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.advance(batch)
        end = StepEnd(self.world.device, torch.cat([totals, grad_norm.float().reshape(1), stepped.float().reshape(1)]))
        return QueuedStep(self.state.step, batch, lr, data_wait, end)

    def finish(self, queued: QueuedStep) -> None:
        """Waits for a queued step's update, stops on a non-finite one, logs it."""
        total, stop_votes, *router, grad_norm, stepped = queued.end.read()
        batch = queued.batch
        loss = total / max(batch.num_loss_tokens, 1)
        if not stepped:
            self.checkpointer.wait()  # an earlier, finite step's save in flight commits first
            raise NonFiniteLossError(
                f"non-finite loss ({loss}) or grad norm ({grad_norm}) at step {queued.step} "
                f"(epoch {batch.epoch}); the update was NOT applied. Rows of this step: {batch.rows[:16]}... "
                f"Lower optim.lr, keep optim.clip_grad > 0, or check those rows. {what_next(self.cfg.trainer)}")
        self.stopping = self.stopping or stop_votes > 0
        metrics = {"loss": loss, "lr": queued.lr, "grad_norm": grad_norm,
                   **(self.lm.router.metrics(router, sum(batch.sample_lengths)) if self.lm.router else {})}
        seconds, self.last_end = queued.end.seconds_since(self.last_end), queued.end
        metrics.update(throughput(batch.sample_lengths, batch.num_loss_tokens, seconds, self.model_shape,
                                  self.world.world_size, self.world.device))
        metrics.update(epoch=batch.epoch, data_wait_s=queued.data_wait, **memory_stats(self.world.device))
        self.logger.log(queued.step, metrics)

    def saves(self, step: int, last: bool) -> bool:
        t = self.cfg.trainer
        return last or self.stopping or (t.save_freq > 0 and step % t.save_freq == 0)

    @torch.no_grad()
    def validate(self) -> float | None:
        """Token-weighted validation loss over all ranks; None where a SIGTERM stopped it. Stop votes are
        read one micro-batch late so the device never waits on the host."""
        self.runtime.enter(f"validation after step {self.state.step}")
        self.lm.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.world.device)
        votes, stopped = None, False
        assert self.val_batches is not None  # the loop validates only with validation data
        for micro in self.val_batches:
            totals[0] += self.lm(micro.to(self.world.device)).double()
            totals[1] += micro.num_loss_tokens
            if self.cfg.trainer.save_on_sigterm:
                if votes is not None and votes.item() > 0:
                    self.stopping = stopped = True
                    break
                votes = self.stop_flag().clone()
                dist.all_reduce(votes)
        self.lm.train()
        if stopped:
            return None
        dist.all_reduce(totals)
        return (totals[0] / totals[1].clamp(min=1)).item()

    def stop_flag(self) -> torch.Tensor:
        """1 once a signal was noted; the value travels with the kernel's launch: no wait on the device."""
        if self.runtime.received and not self.voted:
            self.vote.fill_(1.0)
            self.voted = True
        return self.vote

    def save(self) -> None:
        self.runtime.enter(f"the save of step {self.state.step}")
        final = self.state.step == self.plan.total_steps or self.stopping  # written and committed before going on
        self.checkpointer.save(self.state, wandb_id=self.logger.wandb_id, final=final)

    def stop(self) -> None:
        """Ends the run after a SIGTERM (sfttrain.runtime), once the step's checkpoint is committed."""
        self.checkpointer.wait()
        self.checkpointer.close()
        # whose signal the vote carried (a SIGTERM noted since, as torchrun ending the job sends, is not the cause)
        received = self.runtime.received[0] if self.runtime.received else None
        own = self.voted or (self.world.world_size == 1 and received)
        who = f"{received or 'SIGTERM'} received" if own else "another rank received SIGTERM"
        raise StoppedBySignal(
            f"{who}: training stopped after step {self.state.step} of {self.plan.total_steps}, whose checkpoint "
            f"{os.path.join(self.run_dir, f'global_step_{self.state.step}')} is committed. "
            f"{what_next(self.cfg.trainer)}")

    def export_hf(self) -> None:
        """trainer.save_hf: exports the final committed checkpoint (again, where its export had failed)."""
        final = os.path.join(self.run_dir, f"global_step_{self.plan.total_steps}")
        if not is_complete(final) or os.path.isdir(os.path.join(final, export.HF_EXPORT_DIR)):
            return
        self.runtime.enter(f"the Hugging Face export of {final}")
        base = local_model_folder(self.cfg.model) if self.cfg.model.lora_rank > 0 else None
        out = export.into_checkpoint(final, self.world.rank, self.world.world_size,
                                     self.cfg.model.trust_remote_code, base)
        self.logger.info(f"exported the final model to {out}")
