"""Quantities that must be reduced over ranks the right way for N processes to equal one (docs/reductions.md).

One gloo group of 3 processes (2 would hide non-associativity), float64, runs every check and
returns what rank 0 measured; the tests compare it with one process on the whole global batch, and
each planted wrong way with the same reference, which it must miss.
  - gradient clipping by the total norm: DDP, ZeRO stages 1-3 (common/lessons/zero.py), FSDP2, Accelerate,
    Lightning's gradient_clip_val; the wrong way clips each rank's shards by their own norm;
  - the token-mean loss of a tiny GPT-2 (common/lessons/token_loss.py) over 4 micro-batches of padded
    sequences of different lengths per rank; the wrong ways average means;
  - BatchNorm's statistics: per rank (plain BatchNorm under DDP) against the global batch's
    (common/lessons/batch_norm.py's all-reduced stand-in for SyncBatchNorm, whose kernels are CUDA-only),
    also on bf16 activations, under autocast and in a bf16 model.
In one process: fp16 loss scaling must unscale the gradients before they are clipped, every BERT
script clips there, and its --help says so.
"""
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from test_zero import small_model
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from common.cli import nli_parser
from common.lessons.batch_norm import AllRanksBatchNorm2d, BatchNormNet
from common.lessons.token_loss import WAYS, accumulate, token_loss_sum
from common.lessons.zero import STAGES, ZeRO
from common.spawn import run_in_process_group

ROOT = Path(__file__).resolve().parents[1]
BERT_SCRIPTS = ["nli_dp_minimal.py", "nli_ddp_minimal.py", "data_parallel.py", "nli_loss_in_forward.py", "ddp.py",
                "resume/ddp_resume.py", "sharded/nli_fsdp.py", "nli_accelerate.py"]
WORLD_SIZE = 3
PER_RANK = 4
MAX_NORM = 0.1  # well below the gradient's norm, so that clipping scales it
LR = 0.5


def global_batch():
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(WORLD_SIZE * PER_RANK, 7, generator=generator, dtype=torch.float64)
    return inputs, torch.randint(0, 3, (WORLD_SIZE * PER_RANK,), generator=generator)


def rank_batch(rank):
    inputs, labels = global_batch()
    return inputs[rank * PER_RANK:(rank + 1) * PER_RANK], labels[rank * PER_RANK:(rank + 1) * PER_RANK]


def clipping_model():
    torch.manual_seed(0)
    return small_model().double()


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def one_process_clipped():
    """The reference: one process, the whole global batch, torch's clip_grad_norm_, one SGD step."""
    model = clipping_model()
    F.cross_entropy(model(global_batch()[0]), global_batch()[1]).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    sgd(model.parameters()).step()
    return norm, [p.detach().clone() for p in model.parameters()]


def full(tensor):
    """A DTensor (FSDP2) in full on every rank; a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def clipped_step(rank, wrapper):
    """One step on this rank's slice: forward, backward, clip, SGD. Returns (norm, full parameters)."""
    model = clipping_model()
    inputs, labels = rank_batch(rank)
    if wrapper == "accelerate":
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=True)
        model, optimizer = accelerator.prepare(model, sgd(model.parameters()))
        accelerator.backward(F.cross_entropy(model(inputs), labels))
        norm = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
    else:
        if wrapper == "ddp":
            model = DDP(model)
        else:  # FSDP2: each Linear and LayerNorm its own group, then the root
            for layer in model:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer)
            fully_shard(model)
        optimizer = sgd(model.parameters())
        F.cross_entropy(model(inputs), labels).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    return norm, [full(p.detach()).clone() for p in model.parameters()]


def zero_clipped_steps(rank, shards_own_norm=False):
    """The same step under ZeRO stages 1-3: ([norm per stage], [full parameters per stage]).
    shards_own_norm plants the bug: each rank clips its shards by their own norm."""
    inputs, labels = rank_batch(rank)
    norms, params = [], []
    for stage in STAGES:
        zero = ZeRO(clipping_model(), stage, sgd)
        F.cross_entropy(zero(inputs), labels).backward()
        if shards_own_norm:
            norms.append(torch.nn.utils.clip_grad_norm_([unit.shard for unit in zero.units], MAX_NORM))
        else:
            norms.append(zero.clip_grad_norm_(MAX_NORM))
        zero.step()
        params.append(zero.full_parameters())
    return norms, params


def clipping(rank):
    results = {wrapper: clipped_step(rank, wrapper) for wrapper in ("ddp", "fsdp2", "accelerate")}
    results["zero"], results["zero_local_norm"] = zero_clipped_steps(rank), zero_clipped_steps(rank, shards_own_norm=True)
    fsdp_norm = results["fsdp2"][0]
    results["fsdp2_returns"] = {"type": type(fsdp_norm).__name__, "placements": str(fsdp_norm.placements),
                                "local": fsdp_norm.to_local().clone(), "full": fsdp_norm.full_tensor()}
    results["fsdp2"] = (fsdp_norm.full_tensor(), results["fsdp2"][1])
    return results


def lightning_clipped(rank):
    """The same step as a Lightning Trainer runs it with gradient_clip_val, in this process group (Lightning
    sees the variables torchrun would set and joins the group that exists). Returns the parameters."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = clipping_model()

        def training_step(self, batch, _):
            return F.cross_entropy(self.model(batch[0]), batch[1])

        def configure_optimizers(self):
            return sgd(self.parameters())

    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy="ddp", max_steps=1, gradient_clip_val=MAX_NORM,
                        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(*rank_batch(rank)), batch_size=PER_RANK))
    return [p.detach().clone() for p in module.model.parameters()]


MICRO_BATCHES, SEQUENCES, LONGEST = 4, 2, 14  # per rank, per micro-batch


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=LONGEST, n_embd=8, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: the same arithmetic
    return GPT2LMHeadModel(config).double()


def padded(sequences):
    """Right-padded input_ids and the attention mask that marks the real tokens."""
    longest = max(len(s) for s in sequences)
    return {"input_ids": torch.stack([F.pad(s, (0, longest - len(s))) for s in sequences]),
            "attention_mask": torch.stack([F.pad(torch.ones_like(s), (0, longest - len(s))) for s in sequences])}


def all_sequences():
    """WORLD_SIZE x MICRO_BATCHES x SEQUENCES token-id sequences of 2 to LONGEST tokens."""
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, LONGEST + 1, (WORLD_SIZE * MICRO_BATCHES * SEQUENCES,), generator=generator)
    return [torch.randint(1, 32, (int(n),), generator=generator) for n in lengths]


def micro_batches_of(rank):
    mine = all_sequences()[rank * MICRO_BATCHES * SEQUENCES:(rank + 1) * MICRO_BATCHES * SEQUENCES]
    return [padded(mine[i:i + SEQUENCES]) for i in range(0, len(mine), SEQUENCES)]


def one_process_token_mean_gradient():
    """The reference: one process, every sequence in one batch, the mean loss over every real token."""
    model = tiny_gpt2()
    loss_sum, count = token_loss_sum(model, **padded(all_sequences()))
    (loss_sum / count).backward()
    return [p.grad for p in model.parameters()]


def token_losses(rank):
    """The gradient each way of weighting the loss leaves on this rank, under DDP with accumulation."""
    gradients = {}
    for way in WAYS:
        model = DDP(tiny_gpt2())
        accumulate(model, micro_batches_of(rank), way)
        gradients[way] = [p.grad.clone() for p in model.parameters()]
    return gradients


def images_and_labels():
    generator = torch.Generator().manual_seed(5)
    return (torch.randn(WORLD_SIZE * PER_RANK, 1, 28, 28, generator=generator, dtype=torch.float64),
            torch.randint(0, 10, (WORLD_SIZE * PER_RANK,), generator=generator))


def batch_norm_net(norm=nn.BatchNorm2d):
    """Training mode (batch statistics) with dropout off, so that every process does the same arithmetic."""
    torch.manual_seed(0)
    model = BatchNormNet(norm).double().train()
    model.dropout1.eval(), model.dropout2.eval()
    return model


def normalized_step(model, images, labels):
    """Forward and backward: the output, the first norm's running statistics, the gradients."""
    output = model(images)
    F.nll_loss(output, labels).backward()
    norm = (model.module if isinstance(model, DDP) else model).conv1[1]
    return {"output": output.detach(), "running": torch.stack([norm.running_mean, norm.running_var]),
            "grads": [p.grad for p in model.parameters()]}


def one_process_batch_norm():
    return normalized_step(batch_norm_net(), *images_and_labels())


def batch_norms(rank, world_size):
    """Each rank's slice through plain BatchNorm and through the all-reduced one, under DDP; every rank's
    outputs and running statistics, gathered."""
    images, labels = images_and_labels()
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    results = {}
    for name, norm in (("per_rank", nn.BatchNorm2d), ("all_ranks", AllRanksBatchNorm2d)):
        result = normalized_step(DDP(batch_norm_net(norm)), images[mine], labels[mine])
        for key in ("output", "running"):
            every_rank = [torch.empty_like(result[key]) for _ in range(world_size)]
            dist.all_gather(every_rank, result[key])
            result[key] = every_rank
        results[name] = result
    with pytest.raises(ValueError, match="GPU"):  # torch 2.15: SyncBatchNorm's kernels are CUDA-only
        nn.SyncBatchNorm.convert_sync_batchnorm(batch_norm_net())(images[mine])
    return results


BF16_IMAGES = 41  # per rank, of 3 x 3 pixels: 369 values per channel, 1107 in all; bf16 counts them as 368 and 1104
BF16_SETTINGS = ("autocast", "bf16_model")  # an fp32 BatchNorm on bf16 activations under autocast; a model in bf16


def bf16_activations():
    """bf16 activations, as a convolution under autocast hands them on, with a mean (10) large beside their
    spread (1): an error of 0.3% in the mean moves the normalized output by 0.03."""
    generator = torch.Generator().manual_seed(11)
    return (torch.randn(WORLD_SIZE * BF16_IMAGES, 4, 3, 3, generator=generator) + 10).bfloat16()


def bf16_normalized(norm, images, setting):
    """One training forward of norm in a bf16 setting: the output and the running statistics."""
    norm = norm.train() if setting == "autocast" else norm.bfloat16().train()
    with torch.autocast("cpu", torch.bfloat16, enabled=setting == "autocast"):
        output = norm(images)
    return {"output": output.detach(), "running": torch.stack([norm.running_mean, norm.running_var])}


def one_process_bf16_batch_norm():
    """The reference: nn.BatchNorm2d on the global batch under autocast, statistics in fp32, output in bf16 (a
    BatchNorm in bf16 is no reference: on the CPU its output is off by up to 0.04 here)."""
    return bf16_normalized(nn.BatchNorm2d(4), bf16_activations(), "autocast")


def bf16_batch_norms(rank, world_size):
    """Each rank's slice through AllRanksBatchNorm2d in each bf16 setting; every rank's outputs and running
    statistics, gathered."""
    mine = slice(rank * BF16_IMAGES, (rank + 1) * BF16_IMAGES)
    results = {}
    for setting in BF16_SETTINGS:
        result = bf16_normalized(AllRanksBatchNorm2d(4), bf16_activations()[mine], setting)
        for key in ("output", "running"):
            every_rank = [torch.empty_like(result[key]) for _ in range(world_size)]
            dist.all_gather(every_rank, result[key])
            result[key] = every_rank
        results[setting] = result
    return results


def every_check(rank, world_size):
    """Every multi-process check in one group: starting processes is the slow part."""
    return {"clipping": clipping(rank), "token_loss": token_losses(rank), "batch_norm": batch_norms(rank, world_size),
            "batch_norm_bf16": bf16_batch_norms(rank, world_size),
            "lightning": lightning_clipped(rank)}  # last: the Trainer takes over the process's logging and warnings


@pytest.fixture(scope="module")
def measured():
    return run_in_process_group(every_check, WORLD_SIZE, timeout=180)


def assert_same(got, want):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2", "accelerate"])
def test_clipping_by_the_total_norm_equals_one_process(measured, wrapper):
    norm, params = measured["clipping"][wrapper]
    reference_norm, reference_params = one_process_clipped()
    assert reference_norm > 2 * MAX_NORM  # the clip did scale the gradient
    assert_same(norm, reference_norm)
    for got, want in zip(params, reference_params, strict=True):
        assert_same(got, want)


def test_lightning_gradient_clip_val_equals_one_process(measured):
    """gradient_clip_val clips after DDP's all-reduce, by the norm of the averaged gradient: one process's."""
    for got, want in zip(measured["lightning"], one_process_clipped()[1], strict=True):
        assert_same(got, want)


@pytest.mark.parametrize("stage", STAGES)
def test_zero_clip_grad_norm_equals_one_process(measured, stage):
    norms, params = measured["clipping"]["zero"]
    reference_norm, reference_params = one_process_clipped()
    assert_same(norms[stage - 1], reference_norm)
    for got, want in zip(params[stage - 1], reference_params, strict=True):
        assert_same(got, want)


def test_clipping_shards_by_their_own_norm_fails(measured):
    norms, params = measured["clipping"]["zero_local_norm"]
    reference_norm, reference_params = one_process_clipped()
    for stage in STAGES:
        assert norms[stage - 1] < 0.9 * reference_norm  # rank 0's shards hold only part of the norm
        assert not all(torch.allclose(a, b, rtol=1e-6) for a, b in zip(params[stage - 1], reference_params))


def test_fsdp2_clip_returns_a_replicated_dtensor(measured):
    """torch's clip_grad_norm_ over FSDP2's DTensor parameters already sums the shards' squares over the
    ranks: it returns the total norm as a DTensor replicated on every rank; full_tensor() makes it a tensor."""
    returned = measured["clipping"]["fsdp2_returns"]
    assert returned["type"] == "DTensor" and "Replicate" in returned["placements"]
    assert_same(returned["local"], one_process_clipped()[0])
    assert_same(returned["full"], one_process_clipped()[0])


def test_token_weighted_loss_equals_one_process_on_the_global_batch(measured):
    reference = one_process_token_mean_gradient()
    for got, want in zip(measured["token_loss"]["global_tokens"], reference, strict=True):
        assert_same(got, want)


@pytest.mark.parametrize("way", ["local_tokens", "micro_batch_means"])
def test_averaging_means_fails(measured, way):
    reference = one_process_token_mean_gradient()
    assert not all(torch.allclose(a, b, rtol=1e-3) for a, b in zip(measured["token_loss"][way], reference))


def test_batch_statistics_over_all_ranks_equal_one_process(measured):
    result, reference = measured["batch_norm"]["all_ranks"], one_process_batch_norm()
    assert_same(torch.cat(result["output"]), reference["output"])
    for running in result["running"]:
        assert_same(running, reference["running"])
    for got, want in zip(result["grads"], reference["grads"], strict=True):
        assert_same(got, want)


@pytest.mark.parametrize("setting", BF16_SETTINGS)
def test_batch_statistics_of_bf16_activations_equal_one_process(measured, setting):
    """Counted and summed in bf16, the statistics are off by about 0.3% (368 of 369 values, 8 significant bits
    per sum): they must be counted and all-reduced in fp32, as nn.BatchNorm2d computes them."""
    result, reference = measured["batch_norm_bf16"][setting], one_process_bf16_batch_norm()
    torch.testing.assert_close(torch.cat(result["output"]), reference["output"])  # also the dtype: bf16, rtol 1.6e-2
    for running in result["running"]:  # fp32 under autocast, bf16 in the bf16 model: that dtype's tolerance
        torch.testing.assert_close(running, reference["running"].to(running.dtype))


def test_per_rank_batch_norm_is_not_one_process(measured):
    result, reference = measured["batch_norm"]["per_rank"], one_process_batch_norm()
    assert not torch.allclose(torch.cat(result["output"]), reference["output"], rtol=1e-3)
    assert not torch.allclose(result["running"][0], result["running"][1], rtol=1e-3)  # the ranks' statistics drift apart


def scaled_clip(unscale_first: bool):
    """One process, fp16-style loss scaling on the CPU (GradScaler scales fp32 gradients as well): the
    norm clip_grad_norm_ measures and the parameters after the step."""
    model = clipping_model()
    optimizer = sgd(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    scaler.scale(F.cross_entropy(model(global_batch()[0]), global_batch()[1])).backward()
    if unscale_first:
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    scaler.step(optimizer)  # unscales here if unscale_ was not called
    return norm, [p.detach() for p in model.parameters()]


def test_the_scaler_unscales_before_the_clip():
    reference_norm, reference_params = one_process_clipped()
    norm, params = scaled_clip(unscale_first=True)
    assert_same(norm, reference_norm)
    for got, want in zip(params, reference_params, strict=True):
        assert_same(got, want)
    norm, params = scaled_clip(unscale_first=False)  # the wrong order: the scaled norm, 4096 times too large
    torch.testing.assert_close(norm, reference_norm * 2.0 ** 12)
    assert not all(torch.allclose(a, b, rtol=1e-3) for a, b in zip(params, reference_params))


@pytest.mark.parametrize("script", BERT_SCRIPTS)
def test_every_bert_script_clips_after_unscaling_and_says_so(script):
    """In the training loop: backward, unscale_ (fp16), clip, step, in this order."""
    source = (ROOT / "src" / "ch4" / script).read_text()
    order = [r"\.backward\(", r"scaler\.unscale_\(optimizer\)", r"clip_grad_norm_\(", r"optimizer(_step\(optimizer, scaler\)|\.step\(\))"]
    if "scaler" not in source:  # the fp32-only minimal scripts and Accelerate, whose clip unscales itself
        order.remove(r"scaler\.unscale_\(optimizer\)")
    positions = [re.search(pattern, source).start() for pattern in order]
    assert positions == sorted(positions)
    assert "nli_parser(__doc__" in source  # the flags below, in its --help


def test_the_bert_flags_say_that_they_clip():
    help_text = " ".join(nli_parser("").format_help().split())
    assert "--max-grad-norm" in help_text and "customarily clips at 1.0" in help_text
    assert nli_parser("").parse_args([]).max_grad_norm == 1.0


def test_the_code_in_the_docs_page_is_the_code():
    """Every line of docs/reductions.md's code blocks is a line of the sources it quotes, so it cannot drift."""
    sources = "\n".join((ROOT / path).read_text() for path in ("common/lessons/zero.py", "common/lessons/token_loss.py", "src/ch4/ddp.py"))
    lines = {line.strip() for line in sources.splitlines()}
    blocks = re.findall(r"```python[^\n]*\n(.*?)```", (ROOT / "docs" / "reductions.md").read_text(), re.S)
    quoted = [line.strip() for block in blocks for line in block.splitlines() if line.strip() not in ("", "...")]
    assert quoted and [line for line in quoted if line not in lines] == []
