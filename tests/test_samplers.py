"""DistributedEvalSampler covers every index exactly once; DistributedSampler pads, which is why it exists."""
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from common.samplers import DistributedEvalSampler, ResumableDistributedSampler


def indices_over_ranks(sampler_class, size, world_size, **kwargs):
    dataset = range(size)
    per_rank = []
    for rank in range(world_size):
        sampler = sampler_class(dataset, num_replicas=world_size, rank=rank, **kwargs)
        sampler.set_epoch(kwargs.get("seed", 0) + 3)
        indices = list(sampler)
        assert len(indices) == len(sampler)
        per_rank.append(indices)
    return per_rank


@pytest.mark.parametrize("size", [0, 1, 2, 7, 10, 101, 1000, 10000])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 8, 16])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_index_exactly_once(size, world_size, shuffle):
    per_rank = indices_over_ranks(DistributedEvalSampler, size, world_size, shuffle=shuffle, seed=5)
    together = [i for indices in per_rank for i in indices]
    assert sorted(together) == list(range(size))
    assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1


def test_distributed_sampler_pads_10000_over_7_ranks_to_10003():
    per_rank = indices_over_ranks(DistributedSampler, 10000, 7, shuffle=False)
    together = [i for indices in per_rank for i in indices]
    assert len(together) == 10003
    assert len(set(together)) == 10000
    assert sum(map(len, indices_over_ranks(DistributedEvalSampler, 10000, 7))) == 10000


def test_shuffle_is_deterministic_and_changes_with_epoch():
    dataset = range(100)
    a = DistributedEvalSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=1)
    b = DistributedEvalSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=1)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert set(a) != set(first)  # a new share of a new global shuffle, not the same share reordered
    assert sorted(first) != first  # shuffled within the share too
    assert list(DistributedEvalSampler(dataset, num_replicas=2, rank=1)) == list(range(1, 100, 2))


def test_rank_outside_world_is_rejected():
    with pytest.raises(ValueError, match="outside"):
        DistributedEvalSampler(range(10), num_replicas=2, rank=2)


def test_unshuffled_eval_keeps_dataset_order_within_a_rank():
    sampler = DistributedEvalSampler(torch.arange(10), num_replicas=3, rank=0)
    assert list(sampler) == [0, 3, 6, 9]


def resumed_indices(dataset, batch_size, world_size, rank, epoch, samples_done=0):
    """The indices a new sampler (as in a restarted process) gives rank `rank` from the global cursor on."""
    sampler = ResumableDistributedSampler(dataset, batch_size, num_replicas=world_size, rank=rank, seed=7)
    sampler.set_epoch(epoch, samples_done)
    indices = list(sampler)
    assert len(indices) == len(sampler)
    return indices


@pytest.mark.parametrize("world_size", [2, 3])
def test_resumed_epoch_continues_the_same_shuffle(world_size):
    """At every cut point of several epochs, the indices before the cut plus those after resuming there
    are exactly the uninterrupted epoch's, on every rank."""
    dataset, batch_size = range(23), 4  # 12 or 8 indices per rank: a last batch that is not full

    def torch_epoch(rank, epoch):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=7)
        sampler.set_epoch(epoch)
        return list(sampler)

    for rank in range(world_size):
        for epoch in range(3):
            whole = resumed_indices(dataset, batch_size, world_size, rank, epoch)
            assert whole == torch_epoch(rank, epoch)  # uninterrupted, it is DistributedSampler
            for cut in range(-(-len(whole) // batch_size) + 1):
                after = resumed_indices(dataset, batch_size, world_size, rank, epoch, cut * batch_size * world_size)
                assert whole[:cut * batch_size] + after == whole
        assert resumed_indices(dataset, batch_size, world_size, rank, 0) != resumed_indices(dataset, batch_size, world_size, rank, 1)


def trained_across_a_change(size, before, after, cut, per_rank_cursor=False):
    """Indices trained on in epoch 1 with a global batch of 12: `cut` global batches at `before` ranks,
    the rest at `after` ranks. per_rank_cursor: the negative control, each rank skipping its own share
    as the ranks before counted it (c / before) instead of c / after."""
    dataset, global_batch = range(size), 12
    done = cut * global_batch
    first = [index for rank in range(before)
             for index in resumed_indices(dataset, global_batch // before, before, rank, 1)[:done // before]]
    cursor = done // before * after if per_rank_cursor else done
    return first + [index for rank in range(after)
                    for index in resumed_indices(dataset, global_batch // after, after, rank, 1, cursor)]


@pytest.mark.parametrize("before, after", [(2, 3), (3, 2), (4, 1), (1, 4)])
def test_an_epoch_resumed_at_another_world_size_trains_on_every_sample_once(before, after):
    """The global order is one shuffle at every world size, and the cursor counts samples of all ranks:
    cut at any global batch and resumed at another world size, the epoch holds every index once."""
    for cut in range(5):
        assert sorted(trained_across_a_change(48, before, after, cut)) == list(range(48))
    padded = trained_across_a_change(46, before, after, 2)  # 46 over 3 or 4 ranks: the last batch padded
    assert set(padded) == set(range(46)) and len(padded) == -(-46 // after) * after  # repeats: the padding only


@pytest.mark.parametrize("before, after", [(2, 3), (3, 2)])
def test_a_cursor_counted_per_rank_loses_or_repeats_samples_at_another_world_size(before, after):
    """Negative control: the same cut with each rank skipping the share the ranks before had done."""
    trained = trained_across_a_change(48, before, after, 2)
    broken = trained_across_a_change(48, before, after, 2, per_rank_cursor=True)
    assert sorted(trained) == list(range(48)) and sorted(broken) != list(range(48))
    assert len(broken) != 48 if after < before else len(set(broken)) < 48  # repeated, or lost
