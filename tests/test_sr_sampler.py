"""ShardSampler: sharding, per-epoch reshuffle, and exact mid-epoch resume."""

import pytest
import torch

from hpdl.sr.sampler import ShardSampler


def shards(n, replicas, epoch=0, seed=0, **kw):
    out = []
    for rank in range(replicas):
        s = ShardSampler(n, rank=rank, num_replicas=replicas, seed=seed, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("n,replicas", [(10, 1), (10, 2), (10, 3), (7, 4), (3, 5)])
def test_shards_are_equal_sized_and_cover_the_epoch(n, replicas):
    parts = shards(n, replicas)
    assert len({len(p) for p in parts}) == 1  # nobody waits for a missing batch
    assert len(parts[0]) == len(ShardSampler(n, rank=0, num_replicas=replicas))
    flat = [i for p in parts for i in p]
    assert set(flat) == set(range(n)) and len(flat) == -(-n // replicas) * replicas
    dropped = shards(n, replicas, drop_last=True)
    assert all(len(p) == n // replicas for p in dropped)
    assert len({i for p in dropped for i in p}) == n // replicas * replicas


def test_reshuffles_per_epoch_deterministically():
    a, b = shards(50, 2, epoch=0), shards(50, 2, epoch=1)
    assert a != b and a == shards(50, 2, epoch=0)
    assert shards(50, 2, seed=1) != a
    assert shards(5, 1, shuffle=False) == [[0, 1, 2, 3, 4]]


def test_state_round_trip_resumes_exactly():
    full = shards(23, 3, epoch=4)
    for rank in range(3):
        s = ShardSampler(23, rank=rank, num_replicas=3)
        s.set_epoch(4)
        it = iter(s)
        head = [next(it) for _ in range(3)]
        state = s.state_dict()
        assert state["epoch"] == 4 and state["position"] == 9
        resumed = ShardSampler(23, rank=rank, num_replicas=3)
        resumed.load_state_dict(state)
        resumed.set_epoch(state["epoch"])  # the same epoch keeps the position
        assert len(resumed) == len(full[rank]) - 3
        assert head + list(resumed) == full[rank]
        resumed.set_epoch(5)  # the next epoch starts from the beginning
        assert list(resumed) == shards(23, 3, epoch=5)[rank]


def test_consumed_overrides_prefetched_count_and_end_of_epoch_rolls_over():
    s = ShardSampler(20, rank=1, num_replicas=2)
    list(s)  # a DataLoader may have drawn everything already
    assert s.state_dict() == {**s.state_dict(), "epoch": 1, "position": 0}
    assert s.state_dict(consumed=4)["position"] == 8
    with pytest.raises(ValueError, match="consumed=11 outside"):
        s.state_dict(consumed=11)


def test_resume_with_a_different_number_of_ranks_sees_each_sample_once():
    before = shards(30, 2, epoch=2)
    done = [p[:5] for p in before]  # each of 2 ranks trained on 5 samples
    state = ShardSampler(30, rank=0, num_replicas=2, seed=0)
    state.set_epoch(2)
    st = state.state_dict(consumed=5)
    rest = []
    for rank in range(3):
        s = ShardSampler(30, rank=rank, num_replicas=3)
        s.load_state_dict(st)
        rest += list(s)
    seen = done[0] + done[1] + rest
    # every sample once, plus one repeat padding the remaining 20 to a multiple of 3
    assert set(seen) == set(range(30)) and len(seen) == 10 + 21


def test_load_state_rejects_another_dataset():
    st = ShardSampler(10, rank=0, num_replicas=1, seed=3).state_dict()
    with pytest.raises(ValueError, match="num_samples=10 but this sampler has 12"):
        ShardSampler(12, rank=0, num_replicas=1, seed=3).load_state_dict(st)
    with pytest.raises(ValueError, match="seed=3"):
        ShardSampler(10, rank=0, num_replicas=1, seed=4).load_state_dict(st)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        ShardSampler(10, rank=2, num_replicas=2)


def test_works_as_a_dataloader_sampler():
    data = torch.arange(12)
    s = ShardSampler(data, rank=1, num_replicas=2, seed=7)
    loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=s)
    got = torch.cat(list(loader)).tolist()
    assert got == shards(12, 2, seed=7)[1]
