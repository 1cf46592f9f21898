"""Token-sum cross-entropy, normalised by the step's global loss-token count. `CausalLMLoss` wraps the
unmodified Hugging Face model (under FSDP, the root module) and computes the loss from the decoder's
hidden states chunk by chunk, so the [tokens, vocab] logits are never held whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Union

import torch
from torch import nn

from sfttrain.attention import call_kwargs
from sfttrain.config import ConfigError
from sfttrain.errors import GPU_INSTALL
from sfttrain.data.pack import IGNORE_INDEX, MicroBatch
from sfttrain.moe import RouterBalance

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

# a Hugging Face causal LM, LoRA's PeftModel around one (which forwards the model's attributes)
CausalLM = Union["PreTrainedModel", "PeftModel"]


@dataclass(frozen=True)
class OutputHead:
    """The model's own scaling of its raw logits: Granite divides, Cohere multiplies, Gemma 2/3 soft-cap."""
    scale: float = 1.0
    softcap: float | None = None

    def apply(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
        """The logits, and d logits / d raw (elementwise; a float where it is constant)."""
        logits = raw * self.scale if self.scale != 1.0 else raw
        if self.softcap is None:
            return logits, self.scale
        capped = torch.tanh(logits / self.softcap)
        return capped * self.softcap, (1.0 - capped * capped) * self.scale


# the families whose head tests/test_loss.py checks against the model's own loss; others are refused
# rather than trained on a loss that may silently differ (a dropped bias or logit scaling)
HEAD_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "gemma", "gemma2",
                 "gemma3_text", "phi", "phi3", "granite", "cohere", "olmo", "olmo2", "starcoder2", "smollm3")


def output_head(config) -> OutputHead:
    family = config.model_type
    if family not in HEAD_FAMILIES:
        raise ConfigError(f"model type {family!r}: sfttrain's loss is checked against the model's own loss only for "
                          f"{', '.join(HEAD_FAMILIES)}; training {family!r} could silently use another loss than "
                          "the model's (its head may scale, cap or bias the logits). Use a supported family")
    scale = getattr(config, "logit_scale", None) or 1.0  # Cohere multiplies
    scale /= getattr(config, "logits_scaling", None) or 1.0  # Granite divides
    return OutputHead(scale=float(scale), softcap=getattr(config, "final_logit_softcapping", None))


class CausalLMLoss(nn.Module):
    def __init__(self, model: CausalLM, fused: bool, compiled_max_seqlen: int | None = None,
                 chunk_loss: ChunkLoss | None = None, chunk_tokens: int = 1024, attention: str | None = None):
        """fused: Liger's fused linear cross-entropy. compiled_max_seqlen: the attention's max sample
        length, fixed so that the compiled decoder does not recompile per value. attention: the backend
        of sfttrain.attention (None: "auto" on each call's device)."""
        super().__init__()
        self.model = model  # the Hugging Face causal LM, unmodified
        self.fused = fused
        self.chunk_tokens = chunk_tokens
        self.call_kwargs = call_kwargs(attention) if attention else {}
        if compiled_max_seqlen:
            self.call_kwargs.update(max_length_q=compiled_max_seqlen, max_length_k=compiled_max_seqlen)
        # set by sfttrain.parallel where no FSDP casts the parameters
        self.autocast_dtype: torch.dtype | None = None
        self.chunk_loss = chunk_loss or chunk_loss_and_grad
        self.head = output_head(model.config)
        self.router = RouterBalance.of(model.config)
        has_bias = getattr(model.get_output_embeddings(), "bias", None) is not None
        if fused and (self.head != OutputHead() or has_bias):
            raise ConfigError(f"model.use_liger=true: Liger's fused loss does not reproduce the "
                              f"{model.config.model_type} head ({self.head}, lm_head bias {has_bias}); "
                              "set model.use_liger=false")

    def forward(self, batch: MicroBatch) -> torch.Tensor:
        """Sum of the token losses of the micro-batch (fp32 scalar)."""
        inputs = {**batch.model_inputs(), **self.call_kwargs}
        device_type = batch.input_ids.device.type
        with torch.autocast(device_type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            out = self.model.get_decoder()(**inputs, use_cache=False, output_router_logits=self.router is not None)
        if self.router is not None and torch.is_grad_enabled():  # training: validation reports the loss alone
            self.router.record(out.router_logits, batch)
        hidden = out.last_hidden_state
        hidden = hidden.view(-1, hidden.shape[-1])
        head = self.model.get_output_embeddings()
        weight, bias = head.weight, getattr(head, "bias", None)
        labels = batch.labels.view(-1)
        rows = batch.loss_rows
        assert rows is not None  # set by MicroBatch.__post_init__
        if rows.numel():
            # only positions with a target need logits; the others get a zero gradient
            hidden, labels = hidden.index_select(0, rows), labels.index_select(0, rows)
        compute_dtype = self.autocast_dtype or weight.dtype
        if self.fused:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            # accum_dtype fp32: the weight gradient sums over all chunks; bf16 would round it
            return liger_fused_linear_cross_entropy(hidden.to(compute_dtype), weight.to(compute_dtype), labels,
                                                    ignore_index=IGNORE_INDEX, reduction="sum",
                                                    accum_dtype=torch.float32)
        with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        return LinearCrossEntropy.apply(hidden, weight, bias, labels, self.head, compute_dtype, self.chunk_loss,
                                        with_grad, self.chunk_tokens)


def chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, with_grad: bool):
    """Summed cross-entropy of logits [C, V] and, if with_grad, softmax - onehot (zero on ignored rows) in
    the logits' dtype; softmax in fp32. Not in place: compiled, it is one kernel without an fp32 [C, V]."""
    logits32 = logits.float()
    lse = torch.logsumexp(logits32, dim=-1)
    valid = labels != IGNORE_INDEX
    target = labels.clamp(min=0)
    picked = logits32.gather(1, target[:, None]).squeeze(1)
    loss = torch.where(valid, lse - picked, 0.0).sum()
    if not with_grad:
        return loss, None
    onehot = torch.arange(logits.shape[1], device=logits.device)[None, :] == target[:, None]
    grad = (torch.exp(logits32 - lse[:, None]) - onehot.float()) * valid[:, None]
    return loss, grad.to(logits.dtype)


def liger_chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, with_grad: bool):
    """chunk_loss_and_grad by Liger's Triton kernel, the gradient written over the logits (one
    [C, V] buffer, not two). Launched directly: Liger's wrapper syncs per chunk and sums in bf16."""
    rows, vocab = logits.shape
    losses = torch.zeros(rows, dtype=torch.float32, device=logits.device)  # ignored rows stay 0
    _liger_kernel()[(rows,)](X_ptr=logits, X_stride=logits.stride(0), Y_ptr=labels, Y_stride=labels.stride(0),
                             loss_ptr=losses, loss_stride=1, n_cols=vocab, HAS_GRADIENTS=with_grad,
                             BLOCK_SIZE=min(32768, 1 << (vocab - 1).bit_length()), **_LIGER_FIXED_ARGS)
    return losses.sum(), logits if with_grad else None


# the arguments of liger_cross_entropy_kernel (liger-kernel 0.8) that plain summed cross-entropy fixes
_LIGER_FIXED_ARGS = dict(
    weight_ptr=None, z_loss_ptr=None, token_accuracy_ptr=None, token_accuracy_stride=0, predicted_tokens_ptr=None,
    predicted_tokens_stride=0, n_non_ignore=1, sum_non_ignore_weight=1, weight_sum=0.0, ignore_index=IGNORE_INDEX,
    lse_square_scale=0.0, label_smoothing=0.0, reduction="sum", softcap=None, RETURN_Z_LOSS=False,
    RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=False, HAS_WEIGHT=False, HAS_SOFTCAPPING=False,
    num_warps=32)  # what Liger itself launches on Hopper


def _liger_kernel():
    from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel

    return liger_cross_entropy_kernel


def liger_unavailable_reason(device_type: str) -> str | None:
    """Why Liger's cross-entropy kernel cannot run here (None: it can)."""
    if device_type != "cuda":
        return f"it is a Triton kernel for CUDA (device {device_type!r})"
    try:
        kernel = _liger_kernel()
    except ImportError:
        return f"liger-kernel is not installed ({GPU_INSTALL} in the checkout)"
    expected = {*_LIGER_FIXED_ARGS, "X_ptr", "X_stride", "Y_ptr", "Y_stride", "loss_ptr", "loss_stride", "n_cols",
                "HAS_GRADIENTS", "BLOCK_SIZE"} - {"num_warps"}
    if set(kernel.arg_names) != expected:
        return "this liger-kernel's cross-entropy kernel has other arguments than the 0.8 series sfttrain calls"
    return None


ChunkLoss = Callable[[torch.Tensor, torch.Tensor, bool], tuple]


def chunk_loss_kernel(kernel: str, device_type: str) -> str:
    """model.loss_kernel resolved on `device_type`: liger or torch (liger refused where it cannot run)."""
    if kernel == "torch":
        return "torch"
    reason = liger_unavailable_reason(device_type)
    if reason is not None and kernel == "liger":
        raise ConfigError(f"model.loss_kernel=liger: Liger's cross-entropy kernel cannot run here: {reason}; "
                          "set model.loss_kernel=auto or torch")
    return "torch" if reason else "liger"


def select_chunk_loss(kernel: str, device_type: str, compile_torch: bool) -> tuple[ChunkLoss, str]:
    """The chunk kernel for model.loss_kernel and its name; torch's compiled on CUDA or with model.compile
    (eager it allocates fp32 [chunk, vocab] temporaries)."""
    if chunk_loss_kernel(kernel, device_type) == "liger":
        return liger_chunk_loss_and_grad, "liger"
    if compile_torch or device_type == "cuda":
        return torch.compile(chunk_loss_and_grad, dynamic=True), "torch (compiled)"
    return chunk_loss_and_grad, "torch"


class LinearCrossEntropy(torch.autograd.Function):
    """sum_t CE(head(hidden_t @ weight.T + bias), label_t) by chunks of rows, the gradients made in
    forward (each chunk's softmax - onehot multiplied back into d hidden and an fp32 d weight);
    backward only scales them. GEMMs in compute_dtype, gradients in the inputs' dtypes."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, head, compute_dtype, chunk_loss, with_grad, chunk_tokens):
        ctx.set_materialize_grads(False)
        # the GEMM dtype is chosen here, explicitly, not by an enclosing autocast
        with torch.autocast(hidden.device.type, enabled=False):
            h_all, w = hidden.to(compute_dtype), weight.to(compute_dtype)
            b = bias.to(compute_dtype) if bias is not None else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.empty_like(hidden) if with_grad else None
            # a frozen lm_head (LoRA) needs no gradient GEMM nor its fp32 buffer
            weight_grad = with_grad and ctx.needs_input_grad[1]
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if weight_grad else None
            bias_grad = with_grad and b is not None and ctx.needs_input_grad[2]
            grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias_grad else None
            for start in range(0, h_all.shape[0], chunk_tokens):
                h, y = h_all[start:start + chunk_tokens], labels[start:start + chunk_tokens]
                logits, slope = head.apply(h @ w.t() if b is None else torch.addmm(b, h, w.t()))
                loss, grad_logits = chunk_loss(logits, y, with_grad)
                total += loss
                if with_grad:
                    if not isinstance(slope, float) or slope != 1.0:
                        grad_logits = grad_logits * slope  # through the head's scaling / soft-cap
                    grad_hidden[start:start + h.shape[0]] = grad_logits @ w
                    if weight_grad:
                        _add_matmul(grad_weight, grad_logits.t(), h)
                    if bias_grad:
                        grad_bias += grad_logits.sum(0, dtype=torch.float32)
                # freed before the next chunk allocates: else two chunks' logits are alive at once
                del logits, grad_logits
        if with_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if weight_grad else None,
                                  grad_bias.to(bias.dtype) if bias_grad else None)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if grad_total is None:
            return (None,) * 9
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        grad_weight, grad_bias = (None if g is None else g * grad_total for g in (grad_weight, grad_bias))
        return grad_hidden * grad_total, grad_weight, grad_bias, *(None,) * 6


def _add_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc fp32 and a, b possibly bf16, without rounding a @ b to bf16."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:  # cuBLAS: bf16 inputs, fp32 accumulator and output, in place
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a.float() @ b.float())


def step_objective(lm: CausalLMLoss, loss_sum: torch.Tensor, batch, grad_ranks: int) -> torch.Tensor:
    """The micro-batch's share of the step's objective: sum / (loss tokens of the WHOLE step), x grad_ranks
    (all ranks: sp ranks each hold a share) to undo FSDP's average, so that the update does not depend on how
    the step is split into ranks, slices and micro-batches; plus the router's loss over the real tokens of
    the whole step (batch: the StepBatch; sfttrain.moe)."""
    objective = loss_sum * (grad_ranks / max(batch.num_loss_tokens, 1))
    if lm.router is None:
        return objective
    return objective + lm.router.take() * (lm.router.coef * grad_ranks / max(sum(batch.sample_lengths), 1))

