"""The FSDP2 chapter scripts, launched as users launch them, shard the model and still train and evaluate exactly.

tests/instrument.py records each rank's piece of every parameter and gradient (FSDP2 holds DTensors);
put back together in rank order along the first dimension (how fully_shard cuts them), they give:
  - a model whose every rank held only about 1/N of it;
  - a first step that used the gradient of one process on the whole global batch (the reduce-scatter
    averages, as DDP's all-reduce does);
  - final weights whose accuracy, computed by one process on the whole test set, is the one printed,
    over exactly the test set, although evaluation ran through the sharded model with repeats.
"""
import pytest
import torch
import torch.nn.functional as F
from conftest import EVAL_PAIRS, TEST_IMAGES, TORCHRUN
from test_lessons import basic_net, bert_correct, instrumented, one_process_correct, printed_correct

from common.mnist import BasicNet, load_mnist

WORLD_SIZE = 3  # 101 test images and 13 pairs divide by neither 2 nor 3: ranks get repeats


def assembled(ranks, key):
    """Each parameter in full: the ranks' pieces concatenated along dim 0, in rank order."""
    return [torch.cat(pieces) for pieces in zip(*(rank[key] for rank in ranks))]


@pytest.fixture(scope="module")
def mnist_fsdp(tiny_mnist, tmp_path_factory):
    stdout, ranks = instrumented(TORCHRUN + [f"--nproc_per_node={WORLD_SIZE}"], "sharded/mnist_fsdp.py",
                                 tmp_path_factory.mktemp("mnist-fsdp"), "--data-dir", tiny_mnist, "--epochs", "1",
                                 "--batch-size", "48", "--dist-timeout", "60")
    assert len(ranks) == WORLD_SIZE and f"global batch 48 = {WORLD_SIZE} x 16" in stdout
    return stdout, ranks


def test_each_rank_holds_a_third_of_the_model(mnist_fsdp):
    _, ranks = mnist_fsdp
    torch.manual_seed(0)  # what rank 0 (seed 0 + rank 0) builds, and DDP would broadcast
    assert all(torch.equal(a, b) for a, b in zip(assembled(ranks, "initial"), BasicNet().parameters()))
    full = assembled(ranks, "final")
    assert [p.shape for p in full] == [p.shape for p in basic_net(full).parameters()]
    for index, rank in enumerate(ranks):  # rank r holds chunk r of each parameter's rows, nothing more
        assert [piece.shape for piece in rank["final"]] == [p.chunk(WORLD_SIZE)[index].shape for p in full]
        assert sum(piece.numel() for piece in rank["final"]) < 0.34 * sum(p.numel() for p in full)


def test_first_step_is_one_process_on_the_global_batch(mnist_fsdp, tiny_mnist):
    _, ranks = mnist_fsdp
    batch = [index for rank in ranks for index in rank["indices"][0][:16]]  # each rank's first batch
    train_set, _ = load_mnist(str(tiny_mnist))

    def gradients(indices):  # one process, no dropout, as in the instrumented training
        model = basic_net(assembled(ranks, "initial")).eval()
        F.nll_loss(model(train_set.images[indices]), train_set.labels[indices]).backward()
        return [p.grad for p in model.parameters()]

    def close(a, b):
        return all(torch.allclose(x, y, rtol=1e-3, atol=1e-4) for x, y in zip(a, b, strict=True))
    assert close(assembled(ranks, "grads"), gradients(batch))
    assert not close(assembled(ranks, "grads"), gradients(batch[:16]))  # the check can fail: rank 0's batch alone


def test_accuracy_counts_what_one_process_counts(mnist_fsdp, tiny_mnist):
    stdout, ranks = mnist_fsdp
    assert stdout.count("test accuracy") == 1
    assert printed_correct(stdout, TEST_IMAGES, "images") == one_process_correct(assembled(ranks, "final"), tiny_mnist)


def test_bert_fsdp_accuracy(tiny_bert, nli_pairs, tmp_path):
    stdout, ranks = instrumented(TORCHRUN + ["--nproc_per_node=2"], "sharded/nli_fsdp.py", tmp_path, "--model", tiny_bert,
                                 "--dataset", nli_pairs, "--max-steps", "4", "--batch-size", "12", "--dist-timeout", "60",
                                 timeout=300)
    assert "global batch 12 = 2 x 6" in stdout and stdout.count("eval accuracy") == 1
    full = assembled(ranks, "final")
    assert sum(piece.numel() for piece in ranks[1]["final"]) < 0.6 * sum(p.numel() for p in full)
    assert printed_correct(stdout, EVAL_PAIRS, "pairs") == bert_correct(tiny_bert, nli_pairs, full)


def test_the_block_policy_finds_the_blocks_of_bert_llama_and_gpt2():
    from transformers import AutoModelForCausalLM, BertConfig, BertForSequenceClassification, GPT2Config, LlamaConfig

    from common.fsdp import transformer_blocks
    tiny = {"hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32, "vocab_size": 64}
    with torch.device("meta"):
        bert = BertForSequenceClassification(BertConfig(num_hidden_layers=2, **tiny))
        llama = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=3, **tiny))
        gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=64))
    assert [len(transformer_blocks(model)) for model in (bert, llama, gpt2)] == [2, 3, 4]
    with pytest.raises(ValueError, match="Linear has no list of blocks under any of the names"):
        transformer_blocks(torch.nn.Linear(2, 2))


def test_a_tied_head_cannot_be_sharded_apart_and_nothing_is_sharded():
    """Bad input loses nothing: the refusal comes before any fully_shard call (none needs a process group)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from common.fsdp import fully_shard_blocks
    with torch.device("meta"):
        gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="ties its output head to its input embedding.*use --wrap blocks"):
        fully_shard_blocks(gpt2, wrap="blocks+embeddings")
    assert type(gpt2.transformer.h[0]).__name__ == "GPT2Block"  # not an FSDP class
