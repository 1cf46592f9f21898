"""Packing properties on real tokenized GSM8K rows, and the balanced split of a step."""

import random
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from sfttrain.data.pack import IGNORE_INDEX, MicroBatch, balanced_bins, budget_bins, local_slice, pack
from sfttrain.data.render import RenderedSample, Renderer
from tests.conftest import ASSETS, REPO, rank_env


@pytest.fixture(scope="module")
def samples():
    import json

    tok = AutoTokenizer.from_pretrained(ASSETS / "tokenizers" / "qwen2.5-instruct")
    renderer = Renderer(tok, max_length=1024, truncation="error")
    rows = [json.loads(line) for line in open(ASSETS / "data" / "gsm8k" / "train.jsonl")][:6]
    return [renderer.render(r["question"], r["answer"], i) for i, r in enumerate(rows)]


def test_positions_restart_and_boundaries(samples):
    mb = pack(samples)
    lengths = [len(s.input_ids) for s in samples]
    assert mb.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert mb.max_seqlen == max(lengths)
    for s, start, end in zip(samples, mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist()):
        assert mb.position_ids[0, start:end].tolist() == list(range(end - start))
        assert mb.input_ids[0, start:end].tolist() == s.input_ids


def test_no_target_crosses_a_sample(samples):
    mb = pack(samples)
    ends = mb.cu_seqlens[1:].tolist()
    for end in ends:  # the last token of a sample predicts nothing (the next token is another sample's)
        assert mb.labels[0, end - 1] == IGNORE_INDEX
    # every target is the next token of the same sample, and only where that token is trained
    for s, start in zip(samples, mb.cu_seqlens[:-1].tolist()):
        for t in range(len(s.input_ids) - 1):
            want = s.input_ids[t + 1] if s.loss_mask[t + 1] else IGNORE_INDEX
            assert mb.labels[0, start + t] == want
    assert mb.num_loss_tokens == sum(sum(s.loss_mask[1:]) for s in samples)


def test_balanced_bins_is_a_partition_and_balanced():
    rng = random.Random(0)
    costs = [rng.randint(50, 1000) for _ in range(64)]
    bins = balanced_bins(costs, 4, per_bin=16)
    assert sorted(i for b in bins for i in b) == list(range(64))
    assert all(len(b) == 16 for b in bins)
    loads = [sum(costs[i] for i in b) for b in bins]
    naive = [sum(costs[i] for i in range(r * 16, (r + 1) * 16)) for r in range(4)]
    assert max(loads) - min(loads) <= max(naive) - min(naive)
    assert max(loads) / min(loads) < 1.05


def test_budget_bins_respect_the_budget():
    rng = random.Random(1)
    lengths = [rng.randint(10, 500) for _ in range(100)]
    bins = budget_bins(lengths, 1024)
    assert sorted(i for b in bins for i in b) == list(range(100))
    assert all(sum(lengths[i] for i in b) <= 1024 for b in bins)
    assert len(bins) <= -(-sum(lengths) // 1024) + 1  # first-fit-decreasing is near the lower bound


def test_empty_sample_list_gives_a_no_loss_micro_batch():
    mb = pack([])
    assert mb.num_loss_tokens == 0 and (mb.labels == IGNORE_INDEX).all()


def test_sample_without_prompt_trains_from_second_token():
    s = RenderedSample([5, 6, 7], [1, 1, 1], 0)
    assert pack([s]).labels[0].tolist() == [6, 7, IGNORE_INDEX]


def test_padding_is_one_extra_segment_without_targets(samples):
    plain, padded = pack(samples), pack(samples, pad_to=128)
    real = plain.input_ids.shape[1]
    assert padded.input_ids.shape[1] % 128 == 0 and 0 < padded.input_ids.shape[1] - real < 128
    assert padded.cu_seqlens.tolist() == plain.cu_seqlens.tolist() + [padded.input_ids.shape[1]]
    assert (padded.labels[0, real:] == IGNORE_INDEX).all()
    assert padded.position_ids[0, real:].tolist() == list(range(padded.input_ids.shape[1] - real))
    assert padded.num_loss_tokens == plain.num_loss_tokens
    assert pack(samples, pad_to=real).input_ids.shape[1] == real  # already a multiple: no pad segment
    # the attention's segments: the pad joins the last sample, and a row of one sample stays one
    # segment (what cuDNN's attention runs, sfttrain.attention)
    assert padded.attention_bounds().tolist() == plain.cu_seqlens.tolist()[:-1] + [padded.input_ids.shape[1]]
    one = pack(samples[:1], pad_to=1000)
    assert one.attention_bounds().tolist() == [0, one.input_ids.shape[1]] and len(one.cu_seqlens) == 3
    assert one.max_seqlen == one.input_ids.shape[1]


def test_padding_changes_no_loss_and_no_gradient():
    """A real model (stories260K) on a packed row with and without the pad segment."""
    from sfttrain.config import ModelConfig
    from sfttrain.loss import CausalLMLoss
    from sfttrain.model import load_model, materialise_model
    from tests.conftest import STORIES

    gen = random.Random(0)
    rows = []
    for i, n in enumerate([37, 90, 12]):
        rows.append(RenderedSample([gen.randrange(512) for _ in range(n)], [0] * 5 + [1] * (n - 5), i))
    cfg, cpu = ModelConfig(partial_pretrain=str(STORIES)), torch.device("cpu")
    model = load_model(cfg, cpu).model
    materialise_model(model, cfg, cpu, cpu, seed=0)
    lm = CausalLMLoss(model, fused=False)
    results = []
    for mb in (pack(rows), pack(rows, pad_to=64)):
        lm.zero_grad()
        loss = lm(mb)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in lm.parameters()]))
    assert pack(rows, pad_to=64).input_ids.shape[1] == 192  # 139 real tokens + a 53-token pad segment,
    # which joins the last sample's attention segment: it sees that sample, yet sends it no gradient
    # the pad segment changes the GEMM shapes, so the fp32 sums run in another blocking: equal to
    # rounding (~1e-7 of the loss; ~1e-6 of each gradient tensor's norm, whose small elements are
    # pure rounding noise and are not compared one by one), while a pad that leaked into the loss
    # or a gradient would show at O(1)
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=0)
    for g0, g1 in zip(results[0][1], results[1][1]):
        assert (g0 - g1).norm() <= 1e-5 * g1.norm()


@pytest.mark.parametrize("max_length, pad_to, slices", [(16, 128, 1), (300, 128, 1), (127, 128, 1), (128, 128, 1),
                                                      (300, 128, 3)])
def test_no_segment_exceeds_the_attention_bound(max_length, pad_to, slices):
    """The compiled model tells the attention kernel max_seqlen = max_segment_length(...) once, for
    every row: no attention segment of any packed row (a sample up to max_length, the last one with
    the pad, sequence parallelism's slices included) may be longer, or the kernel leaves part of the
    output unwritten. Each row's max_seqlen (what the eager model passes) is its longest segment."""
    from sfttrain.data.pack import local_slice, max_segment_length

    gen = random.Random(max_length)
    bound, longest = max_segment_length(max_length, pad_to, slices), 0
    for _ in range(200):
        lengths = [gen.randint(2, max_length) for _ in range(gen.randint(1, 5))]
        row = pack([RenderedSample(list(range(n)), [0] + [1] * (n - 1), i) for i, n in enumerate(lengths)], pad_to)
        mb = local_slice(row, 0, slices)
        bounds = mb.attention_bounds()
        segments = (bounds[1:] - bounds[:-1]).tolist()
        assert max(segments) == mb.max_seqlen <= bound and bounds[-1] == mb.input_ids.shape[1] * slices
        longest = max(longest, max(segments))
    assert longest > max_length  # a sample and its pad did reach past max_length


def test_local_slices_cover_the_row():
    """Ulysses' slices of a packed row for 2 sp ranks are contiguous, padded to equal length with untrained tokens,
    keep the true positions and the whole row's boundaries, and their loss tokens add up."""
    labels = torch.tensor([[5, IGNORE_INDEX, 7, 8, 9]])
    row = MicroBatch(torch.arange(5)[None], labels, torch.tensor([[0, 1, 2, 0, 1]]),
                     torch.tensor([0, 3, 5], dtype=torch.int32), 3, 4)
    parts = [local_slice(row, r, 2) for r in range(2)]
    assert [p.input_ids.tolist() for p in parts] == [[[0, 1, 2]], [[3, 4, 0]]]
    assert [p.position_ids.tolist() for p in parts] == [[[0, 1, 2]], [[0, 1, 0]]]
    assert parts[1].labels.tolist() == [[8, 9, IGNORE_INDEX]]
    assert all(p.cu_seqlens.tolist() == [0, 3, 5, 6] for p in parts)
    assert sum(p.num_loss_tokens for p in parts) == row.num_loss_tokens


def test_the_data_loader_does_not_import_attention():
    """DataLoader workers import the loader: it must not pull in sfttrain.attention (which registers
    with transformers at import) nor transformers' model code."""
    code = ("import sys, sfttrain.data.loader; "
            "print(sorted(m for m in sys.modules if m in ('sfttrain.attention', 'sfttrain.sequence_parallel', "
            "'transformers.modeling_utils')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env=rank_env())
    assert out.stdout.strip() == "[]"
