"""What the README claims of each DDP, Accelerate and Lightning script, checked on the scripts as users launch them.

tests/instrument.py runs a script unchanged under torchrun, accelerate launch or python and records, per rank:
the weights before the first optimizer step and the gradients it used, the weights at the end, and
the indices each DistributedSampler handed out per epoch. From those:
  - every rank ends with the same weights (DDP keeps the replicas identical);
  - the first step used the gradient of one process on the whole global batch (DDP averages);
  - each epoch deals every rank a new share of the shuffle (set_epoch), and the shares are disjoint;
  - the printed training loss is the mean over every rank's steps, not rank 0's;
  - the printed accuracy has the correct count of one process evaluating the final weights on the
    whole evaluation set, not only the right number of images.
All runs use --precision fp32, so that the single-process reference computes the same numbers.
"""
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import ACCELERATE, EVAL_PAIRS, PYTHON, ROOT, TEST_IMAGES, TORCHRUN, TORCHRUN_FRESH, assert_ran, run_as_user

from common.mnist import BasicNet, load_mnist

CH4 = ROOT / "src" / "ch4"
INSTRUMENT = ROOT / "tests" / "instrument.py"
CPU_CONFIG = CH4 / "accelerate_configs" / "cpu_2_processes.yaml"
MNIST_RUNS = {  # name: launcher, world size, global batch, script (torchrun itself: ranks as fresh interpreters)
    "torchrun 2": (TORCHRUN_FRESH + ["--nproc_per_node=2"], 2, 64, "mnist_3_ddp.py"),
    "torchrun 3": (TORCHRUN_FRESH + ["--nproc_per_node=3"], 3, 48, "mnist_3_ddp.py"),
    "accelerate 2": (ACCELERATE + ["--config_file", CPU_CONFIG], 2, 64, "mnist_4_accelerate.py"),
    "accelerate 3": (ACCELERATE + ["--multi_gpu", "--num_processes", "3", "--num_machines", "1", "--mixed_precision",
                                   "no", "--dynamo_backend", "no"], 3, 48, "mnist_4_accelerate.py"),
    "lightning torchrun 2": (TORCHRUN + ["--nproc_per_node=2"], 2, 64, "mnist_5_lightning.py"),
}


def instrumented(launcher, script, out_dir, *flags, timeout=240):
    result = run_as_user(*launcher, INSTRUMENT, out_dir, CH4 / script, *flags, "--precision", "fp32", timeout=timeout)
    assert_ran(result)
    return result.stdout, [torch.load(path, weights_only=False) for path in sorted(out_dir.glob("rank*.pt"))]


def printed_correct(stdout: str, total: int, unit: str) -> int:
    """The correct count behind 'accuracy P% over N images': P has two decimals, so it is unique for N < 10 000."""
    percent = float(re.search(rf"accuracy ([\d.]+)% over {total} {unit}", stdout).group(1))
    return round(percent * total / 100)


def printed_and_recorded_losses(stdout: str, ranks: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each printed epoch loss (4 decimals); the mean over the ranks of each rank's mean over that epoch's
    recorded steps (what it should be); rank 0's mean alone (what a rank-local print would show)."""
    printed = torch.tensor([float(x) for x in re.findall(r"epoch \d+: mean training loss ([\d.]+)", stdout)])
    per_epoch = len(ranks[0]["losses"]) // len(printed)
    epochs = torch.stack([torch.tensor(rank["losses"]).reshape(len(printed), per_epoch).mean(dim=1) for rank in ranks])
    return printed, epochs.mean(dim=0), epochs[0]


@pytest.fixture(scope="module")
def mnist_runs(tiny_mnist, tmp_path_factory):
    runs = {}
    for name, (launcher, world_size, batch, script) in MNIST_RUNS.items():
        out_dir = tmp_path_factory.mktemp(name.replace(" ", "-"))
        runs[name] = instrumented(launcher, script, out_dir, "--data-dir", tiny_mnist, "--epochs", "2",
                                  "--batch-size", batch, "--dist-timeout", "60")
    return runs


def basic_net(params) -> BasicNet:
    model = BasicNet()
    with torch.no_grad():
        for param, value in zip(model.parameters(), params):
            param.copy_(value)
    return model


@pytest.mark.parametrize("name", list(MNIST_RUNS))
def test_every_rank_ends_with_the_same_weights(mnist_runs, name):
    stdout, ranks = mnist_runs[name]
    assert len(ranks) == MNIST_RUNS[name][1]
    assert f"{len(ranks)} processes on cpu" in stdout and f"global batch {MNIST_RUNS[name][2]} = " in stdout
    for other in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0]["final"], other["final"]))


def one_process_correct(params, tiny_mnist) -> int:
    """Correct predictions of these weights on the whole test set, in one process."""
    _, test_set = load_mnist(str(tiny_mnist))
    model = basic_net(params).eval()
    with torch.no_grad():
        return (model(test_set.images).argmax(dim=1) == test_set.labels).sum().item()


@pytest.mark.parametrize("name", list(MNIST_RUNS))
def test_accuracy_counts_what_one_process_counts(mnist_runs, tiny_mnist, name):
    stdout, ranks = mnist_runs[name]
    assert stdout.count("test accuracy") == 1  # rank 0 prints, the others do not
    assert printed_correct(stdout, TEST_IMAGES, "images") == one_process_correct(ranks[0]["final"], tiny_mnist)


@pytest.mark.parametrize("name", ["torchrun 2", "torchrun 3"])
def test_first_step_is_one_process_on_the_global_batch(mnist_runs, tiny_mnist, name):
    _, ranks = mnist_runs[name]
    per_rank = MNIST_RUNS[name][2] // len(ranks)
    batch = [index for rank in ranks for index in rank["indices"][0][:per_rank]]  # each rank's first batch
    train_set, _ = load_mnist(str(tiny_mnist))

    def gradients(indices):  # one process, no dropout, as in the instrumented training
        model = basic_net(ranks[0]["initial"]).eval()
        F.nll_loss(model(train_set.images[indices]), train_set.labels[indices]).backward()
        return [p.grad for p in model.parameters()]

    def close(a, b):  # fp32 sums in another order (channels_last, all-reduce): differences near 1e-5
        return all(torch.allclose(x, y, rtol=1e-3, atol=1e-4) for x, y in zip(a, b))
    assert all(close(rank["grads"], gradients(batch)) for rank in ranks)
    assert not close(ranks[0]["grads"], gradients(batch[:per_rank]))  # the check can fail: rank 0's batch alone


@pytest.mark.parametrize("name", list(MNIST_RUNS))
def test_the_printed_loss_is_the_mean_over_ranks(mnist_runs, name):
    printed, over_ranks, rank_0 = printed_and_recorded_losses(*mnist_runs[name])
    torch.testing.assert_close(printed, over_ranks, atol=6e-5, rtol=0)
    assert (printed - rank_0).abs().max() > 5e-4  # the check can fail: rank 0's own mean is not what is printed


@pytest.mark.parametrize("name", ["torchrun 2", "torchrun 3", "lightning torchrun 2"])  # Lightning calls set_epoch
def test_each_epoch_deals_new_disjoint_shares(mnist_runs, name):
    _, ranks = mnist_runs[name]
    for epoch in (0, 1):
        shares = [set(rank["indices"][epoch]) for rank in ranks]
        assert sum(map(len, shares)) == len(set().union(*shares))  # disjoint
    for rank in ranks:
        assert rank["indices"][0] != rank["indices"][1]  # set_epoch: a new shuffle
        assert set(rank["indices"][0]) != set(rank["indices"][1])  # not the same share reordered


def test_lightning_trains_what_step_3_trains(mnist_runs):
    """Same seed, samplers and batches, fp32, 2 epochs: Lightning's loop ends bitwise where step 3's ends."""
    lightning, ddp = mnist_runs["lightning torchrun 2"][1][0], mnist_runs["torchrun 2"][1][0]
    assert all(torch.equal(a, b) for a, b in zip(lightning["final"], ddp["final"]))
    assert not all(torch.equal(a, b) for a, b in zip(lightning["final"], lightning["initial"]))  # it trained


def test_lightning_starts_its_own_processes(tiny_mnist, tmp_path):
    """python --devices 2: Lightning starts the second process itself (uninstrumented: the first, rank 0,
    records), and the accuracy the two print together is that of rank 0's final weights on every image."""
    stdout, ranks = instrumented([PYTHON], "mnist_5_lightning.py", tmp_path, "--data-dir", tiny_mnist,
                                 "--devices", "2", "--dist-timeout", "60")
    assert "2 processes on cpu" in stdout and stdout.count("test accuracy") == 1
    assert printed_correct(stdout, TEST_IMAGES, "images") == one_process_correct(ranks[0]["final"], tiny_mnist)


def test_lightning_defaults_count_a_test_image_twice(tiny_mnist, tmp_path):
    """The negative control: the same script as most users write it, with Lightning's default
    use_distributed_sampler=True and plain loaders, scores 102 images of the 101 on 2 ranks."""
    script = (CH4 / "mnist_5_lightning.py").read_text()
    for line in ("use_distributed_sampler=False", "test_sampler = DistributedEvalSampler(test_set, trainer.world_size, trainer.global_rank)"):
        assert line in script
    naive = tmp_path / "mnist_5_lightning_defaults.py"
    naive.write_text(script.replace("use_distributed_sampler=False", "use_distributed_sampler=True").replace(
        "test_sampler = DistributedEvalSampler(test_set, trainer.world_size, trainer.global_rank)", "test_sampler = None"))
    result = run_as_user(*TORCHRUN, "--nproc_per_node=2", naive, "--data-dir", tiny_mnist, "--precision", "fp32",
                         "--dist-timeout", "60")
    assert_ran(result, f"over {TEST_IMAGES + 1} images")


@pytest.mark.parametrize("launcher, script", [(TORCHRUN + ["--nproc_per_node=3"], "ddp.py"),
                                              (ACCELERATE + ["--config_file", CPU_CONFIG], "nli_accelerate.py")])
def test_bert_accuracy_and_replicas(tiny_bert, nli_pairs, tmp_path, launcher, script):
    stdout, ranks = instrumented(launcher, script, tmp_path, "--model", tiny_bert, "--dataset", nli_pairs,
                                 "--max-steps", "4", "--batch-size", "12", "--dist-timeout", "60", timeout=300)
    assert f"global batch 12 = {len(ranks)} x {12 // len(ranks)}" in stdout and stdout.count("eval accuracy") == 1
    for other in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0]["final"], other["final"]))
    assert printed_correct(stdout, EVAL_PAIRS, "pairs") == bert_correct(tiny_bert, nli_pairs, ranks[0]["final"])
    printed, over_ranks, _ = printed_and_recorded_losses(stdout, ranks)
    torch.testing.assert_close(printed, over_ranks, atol=6e-5, rtol=0)


def bert_logits(tiny_bert, nli_pairs, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """One process's logits and the labels, with these weights, on the whole held-out split."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from common.nli import load_pairs, nli_loader, tokenize_pairs
    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert, num_labels=3).eval()
    with torch.no_grad():
        for param, value in zip(model.parameters(), weights, strict=True):
            param.copy_(value)
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    _, eval_pairs = load_pairs(str(nli_pairs), "split", None, None)
    logits, labels = [], []
    with torch.no_grad():
        for batch in nli_loader(tokenize_pairs(eval_pairs, tokenizer, 128), tokenizer, 64, None):
            labels.append(batch.pop("labels"))
            logits.append(model(**batch).logits)
    return torch.cat(logits), torch.cat(labels)


def bert_correct(tiny_bert, nli_pairs, weights) -> int:
    """Correct predictions of one process, with these weights, on the whole held-out split."""
    logits, labels = bert_logits(tiny_bert, nli_pairs, weights)
    return (logits.argmax(dim=-1) == labels).sum().item()
