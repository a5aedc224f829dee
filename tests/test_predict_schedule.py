"""hpdl/profile/predict/schedule.py: a step's gradients through the engine's own scheduling and
fusion on a simulated clock, on schedules whose answers are known by hand."""

import dataclasses

import pytest

from hpdl.config import Settings
from hpdl.profile.predict.schedule import Gradient, StepShape, simulate_step

MiB = 1 << 20


def _cost(per_byte_s=1e-9, per_call_s=1e-4):
    return lambda nbytes: per_call_s + nbytes * per_byte_s


def test_gradients_made_early_in_a_long_backward_are_hidden_behind_it():
    # 8 gradients of 2 MiB (each at least the in-place threshold: one allreduce each, no
    # gathering past HPDL_GATHER_BYTES) made every 0.1 s; backward ends at 1.0 s; each
    # allreduce takes 0.1 ms + 2 ms: all are done long before backward ends.
    grads = tuple(Gradient(f"g{i}", 2 * MiB, 0.1 * (i + 1)) for i in range(8))
    result = simulate_step(StepShape(grads, backward_end_s=1.0, update_s=0.01), Settings(), _cost(), 0.0)
    assert result.exposed_s == 0 and result.step_s == pytest.approx(1.01)
    assert len(result.collectives) == 8 and all(c.nbytes == 2 * MiB for c in result.collectives)


def test_gradients_all_made_at_the_end_of_backward_are_all_exposed_and_fused():
    # 4 gradients of 256 KiB, all made as backward ends: one round, one fused allreduce of 1 MiB
    # (below the fusion threshold, each below the in-place threshold), after the negotiation.
    grads = tuple(Gradient(f"g{i}", 256 * 1024, 1.0) for i in range(4))
    result = simulate_step(StepShape(grads, backward_end_s=1.0), Settings(), _cost(), negotiation_s=0.001)
    (fused,) = result.collectives
    assert fused.nbytes == MiB and len(fused.names) == 4
    assert result.exposed_s == pytest.approx(0.001 + 1e-4 + MiB * 1e-9)
    assert result.step_s == pytest.approx(1.0 + result.exposed_s)


def test_one_large_gradient_made_last_is_what_the_optimizer_waits_for():
    small = tuple(Gradient(f"s{i}", 2 * MiB, 0.1 * (i + 1)) for i in range(4))
    large = Gradient("last", 64 * MiB, 1.0)
    result = simulate_step(StepShape(small + (large,), backward_end_s=1.0), Settings(), _cost(), 0.0)
    assert result.collectives[-1].names == ("last",)
    assert result.exposed_s == pytest.approx(1e-4 + 64 * MiB * 1e-9)


def test_the_fusion_threshold_and_the_inplace_threshold_are_the_engines():
    # Made together: under a 1 MiB fusion threshold, four 512 KiB gradients go in two fused pairs;
    # with the in-place threshold at 512 KiB each goes alone.
    grads = tuple(Gradient(f"g{i}", 512 * 1024, 1.0) for i in range(4))
    shape = StepShape(grads, backward_end_s=1.0)
    paired = simulate_step(shape, dataclasses.replace(Settings(), fusion_threshold=MiB), _cost(), 0.0)
    assert [len(c.names) for c in paired.collectives] == [2, 2]
    alone = simulate_step(shape, dataclasses.replace(Settings(), inplace_threshold=512 * 1024), _cost(), 0.0)
    assert [len(c.names) for c in alone.collectives] == [1, 1, 1, 1]


def test_small_gradients_are_gathered_into_a_round_worth_having():
    # 64 KiB gradients every 1 ms: the engine holds its rounds until HPDL_GATHER_BYTES (1 MiB)
    # are pending, or as many as the step's gradients still to come (so the last rounds halve
    # as backward ends: scheduling.py, Gathering): 16, 8, 4, 2, 1 and 1 gradients, not 32 rounds.
    grads = tuple(Gradient(f"g{i}", 64 * 1024, 0.001 * (i + 1)) for i in range(32))
    result = simulate_step(StepShape(grads, backward_end_s=0.5), Settings(), _cost(), 0.0)
    assert [len(c.names) for c in result.collectives] == [16, 8, 4, 2, 1, 1] and result.rounds == 6
    assert [round(c.start_s, 6) for c in result.collectives] == [0.016, 0.024, 0.028, 0.03, 0.031, 0.032]
    no_gathering = simulate_step(StepShape(grads, backward_end_s=0.5), dataclasses.replace(Settings(), gather_bytes=0),
                                 _cost(), 0.0)
    assert no_gathering.rounds == 32


def test_a_collective_that_blocks_the_engine_gathers_what_comes_meanwhile_into_the_next_round():
    # 2 MiB gradients (each at least the in-place threshold: a round of its own when the engine is
    # free) made every 10 ms, each allreduce taking 50 ms. In the background (gloo, NCCL, MPI
    # across nodes) every gradient is its own collective, queued on the backend; with MPI's
    # blocking calls within a node the engine's thread is in the first collective while the next
    # gradients come, and its next round takes them all at once, fused.
    grads = tuple(Gradient(f"g{i}", 2 * MiB, 0.01 * (i + 1)) for i in range(4))
    shape = StepShape(grads, backward_end_s=0.04)
    cost = _cost(per_byte_s=0.0, per_call_s=0.05)
    settings = dataclasses.replace(Settings(), inplace_threshold=64 * MiB)  # fused when agreed together
    background = simulate_step(shape, settings, cost, 0.0)
    blocking = simulate_step(shape, settings, cost, 0.0, collectives_block=True)
    assert [len(c.names) for c in background.collectives] == [1, 1, 1, 1]
    assert background.step_s == pytest.approx(0.01 + 4 * 0.05)
    assert [len(c.names) for c in blocking.collectives] == [1, 3]  # the three made during the first
    assert blocking.collectives[1].start_s == pytest.approx(0.06) and blocking.step_s == pytest.approx(0.11)


def test_the_engine_runs_one_round_at_a_time_each_after_its_negotiation():
    # Two gradients 1 ms apart, a negotiation of 5 ms: the second cannot have a round of its own
    # while the first round negotiates; it waits for the next, which negotiates after it.
    grads = (Gradient("a", 2 * MiB, 0.0), Gradient("b", 2 * MiB, 0.001))
    result = simulate_step(StepShape(grads, backward_end_s=0.001), Settings(), _cost(per_byte_s=0.0, per_call_s=0.0),
                           negotiation_s=0.005)
    starts = [c.start_s for c in result.collectives]
    assert starts == pytest.approx([0.005, 0.010])
