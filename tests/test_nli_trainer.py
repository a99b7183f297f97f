"""The Trainer rung (src/ch4/nli_trainer.py) evaluates exactly as ddp.py does, with DDP or with a DeepSpeed config.

Both scripts run at 3 processes on the 13 held-out pairs, which 3 does not divide: ddp.py gives each
pair to one rank (DistributedEvalSampler); the Trainer pads the ranks' last batches to as many
(Accelerate's even_batches) and drops the padding when it gathers (gather_for_metrics). With --lr 0
both evaluate the weights they start from, rank 0's (DDP broadcasts them), so both must print the
count one process gets with those weights. The negative control gathers with the padding kept.
"""
import pytest
import torch
from conftest import EVAL_PAIRS, ROOT, TORCHRUN, assert_ran, run_as_user
from test_lessons import bert_correct, bert_logits, printed_correct

CH4 = ROOT / "src" / "ch4"
CRASH = ROOT / "tests" / "crash.py"


def run(script, tiny_bert, nli_pairs, *flags, crash=None, processes=3):
    wrapper = [CRASH, crash] if crash else []
    return run_as_user(*TORCHRUN, f"--nproc_per_node={processes}", *wrapper, CH4 / script, "--model", tiny_bert,
                       "--dataset", nli_pairs, "--batch-size", "12", "--precision", "fp32", "--dist-timeout", "60",
                       *flags, timeout=240)


def rank0_initial_weights(tiny_bert):
    from transformers import AutoModelForSequenceClassification
    torch.manual_seed(0)  # what rank 0 (seed 0 + rank 0) builds, and DDP broadcasts
    return [p.detach() for p in AutoModelForSequenceClassification.from_pretrained(tiny_bert, num_labels=3).parameters()]


@pytest.fixture(scope="module")
def untrained_counts(tiny_bert, nli_pairs):
    counts = {}
    for script, trained in (("ddp.py", "epoch 0: mean training loss 1."),
                            ("nli_trainer.py", "2 steps, rank 0's mean training loss 1.")):  # near ln 3, not 3 x that
        result = run(script, tiny_bert, nli_pairs, "--lr", "0", "--max-steps", "2")
        assert_ran(result, "3 processes on cpu, fp32, global batch 12 = 3 x 4", trained, f"over {EVAL_PAIRS} pairs")
        counts[script] = printed_correct(result.stdout, EVAL_PAIRS, "pairs")
    return counts


def smallest_margin(tiny_bert, nli_pairs) -> float:
    """The smallest gap between the two largest logits of a held-out pair, with rank 0's weights: the
    counts compared here come from other orders of the same float sums (other batches, ZeRO-3's gathered
    weights), which move a logit by about 1e-7, and agree only where no pair is that close to a tie."""
    top_two = bert_logits(tiny_bert, nli_pairs, rank0_initial_weights(tiny_bert))[0].topk(2).values
    return (top_two[:, 0] - top_two[:, 1]).min().item()


def test_the_trainer_counts_every_pair_once_as_ddp_py_does(untrained_counts, tiny_bert, nli_pairs):
    assert smallest_margin(tiny_bert, nli_pairs) > 1e-4, "a held-out pair is near a tie: draw the tiny BERT otherwise"
    expected = bert_correct(tiny_bert, nli_pairs, rank0_initial_weights(tiny_bert))
    assert untrained_counts == {"ddp.py": expected, "nli_trainer.py": expected}


def test_gathered_with_its_padding_the_count_is_wrong(tiny_bert, nli_pairs):
    result = run("nli_trainer.py", tiny_bert, nli_pairs, "--lr", "0", "--max-steps", "2", crash="keep-eval-padding")
    assert_ran(result, "eval accuracy")
    assert f"over {EVAL_PAIRS} pairs" not in result.stdout  # seen: over 192, each rank's batch padded to 64 rows


def test_a_zero_3_config_trains_by_deepspeeds_engine_and_counts_the_same(untrained_counts, tiny_bert, nli_pairs):
    pytest.importorskip("deepspeed", reason="DeepSpeed is the [deepspeed] extra: pip install -e '.[deepspeed]'")
    result = run("nli_trainer.py", tiny_bert, nli_pairs, "--lr", "0", "--max-steps", "2",
                 "--deepspeed", CH4 / "deepspeed_configs" / "zero3.json")
    assert_ran(result, "trained by DeepSpeed's engine, ZeRO stage 3", f"over {EVAL_PAIRS} pairs")
    assert printed_correct(result.stdout, EVAL_PAIRS, "pairs") == untrained_counts["ddp.py"]
