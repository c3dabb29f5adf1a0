"""Tree packing, the token-budget batcher and batch metrics (SPEC §6, §15.7, Appendix B.12/B.13)."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

from asyncgrpo_cli.rollout.types import TrainingSequence
from asyncgrpo_cli.train.batcher import TokenBudgetBatcher, batch_metrics
from asyncgrpo_cli.train.packing import (
    PackedRow,
    RowStats,
    attention_cost,
    count_forwarded_tokens,
    pack_row,
    packing_ratio,
)

P1, P2, P3, A1, A2, B1, B2 = 1, 2, 3, 10, 11, 20, 21


def seq(ids, *, trained_from=None, group=0, advantage=1.0, rid="", tops=None, cands=None) -> TrainingSequence:
    """A sample whose tokens from ``trained_from`` on are trained (default: all but the first)."""
    start = 1 if trained_from is None else trained_from
    mask = [1 if k >= start else 0 for k in range(len(ids))]
    lps = [-0.1 * (k + 1) if mask[k] else 0.0 for k in range(len(ids))]
    return TrainingSequence(
        input_ids=list(ids), trained_mask=mask, sampler_logprobs=lps, advantage=advantage, group_id=group,
        row_index=0, model_version=3, rollout_id=rid, sampler_top_ids=tops, sampler_top_logprobs=None
        if tops is None else [[-1.0] * len(t) for t in tops], sampling_mask=cands,
    )


# ---------------------------------------------------------------- SPEC §6.2 worked example


def test_spec_worked_example():
    r0 = seq([P1, P2, P3, A1, A2], trained_from=3, advantage=0.5, rid="r0")
    r1 = seq([P1, P2, P3, B1, B2], trained_from=3, advantage=-0.5, rid="r1")
    row = pack_row([r0, r1])
    assert row.input_ids.tolist() == [P1, P2, P3, A1, A2, P3, B1, B2]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]
    assert row.segment_ids.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert row.segment_parent.tolist() == [-1, 0, 0]
    assert row.segment_start.tolist() == [0, 2, 5]
    assert row.segment_length.tolist() == [2, 3, 3]
    assert [row.segment_key_indices(s) for s in range(3)] == [[0, 1], [0, 1, 2, 3, 4], [0, 1, 5, 6, 7]]
    # Step 5: a1, a2 predicted at 2, 3; b1, b2 at 5, 6.
    assert row.predict_index.tolist() == [2, 3, 5, 6]
    assert row.target_ids.tolist() == [A1, A2, B1, B2]
    assert row.sample_index.tolist() == [0, 0, 1, 1]
    assert row.advantages.tolist() == [0.5, 0.5, -0.5, -0.5]
    assert row.sampler_logprobs.tolist() == pytest.approx([-0.4, -0.5, -0.4, -0.5])
    assert row.sample_end_index.tolist() == [4, 7]
    assert row.dfs_enter.tolist() == list(range(8))
    assert row.dfs_leave.tolist() == [7, 7, 4, 4, 4, 7, 7, 7]
    assert row.trained_position_mask.tolist() == [False, False, False, True, True, False, True, True]
    assert row.num_tokens == 8 and row.sample_tokens == 10
    assert row.packing_ratio == pytest.approx(10 / 8)
    assert row.attention_cost == 1 + 2 + 3 + 4 + 5 + 3 + 4 + 5
    assert row.rollout_ids == ["r0", "r1"]
    assert row.sample_group_ids.tolist() == [0, 0] and row.sample_model_versions.tolist() == [3, 3]
    assert row.candidate_ids is None and tuple(row.sampler_top_ids.shape) == (4, 0)


def _check_row_semantics(samples, row: PackedRow) -> None:
    """Every trained token sees exactly its own history: the ancestors-or-self of its predicting index
    spell the sample's prefix, at positions 0..k-1."""
    ids = row.input_ids.tolist()
    pos = row.position_ids.tolist()
    leave = row.dfs_leave.tolist()
    triples = zip(row.predict_index.tolist(), row.target_ids.tolist(), row.sample_index.tolist())
    for n, (i, target, s) in enumerate(triples):
        keys = [j for j in range(i + 1) if i <= leave[j]]
        k = len(keys)
        assert [ids[j] for j in keys] == samples[s].input_ids[:k], (n, s)
        assert [pos[j] for j in keys] == list(range(k))
        assert samples[s].input_ids[k] == target
    for s, end in enumerate(row.sample_end_index.tolist()):
        keys = [j for j in range(end + 1) if end <= leave[j]]
        assert [ids[j] for j in keys] == samples[s].input_ids
    # every sample's trained tokens appear once, in order
    expected = [(s, t) for s, x in enumerate(samples) for k, t in enumerate(x.input_ids) if x.trained_mask[k]]
    assert list(zip(row.sample_index.tolist(), row.target_ids.tolist())) == expected


def _trie_forwarded(samples) -> int:
    """Brute force: Σ over plain-trie nodes of max(1, distinct next tokens)."""
    children: dict[tuple, set] = {}
    for s in samples:
        ids = tuple(s.input_ids)
        for k in range(len(ids)):
            nxt = children.setdefault(ids[: k + 1], set())
            if k + 1 < len(ids):
                nxt.add(ids[k + 1])
    return sum(max(1, len(v)) for v in children.values())


# ---------------------------------------------------------------- special cases


def test_identical_samples_share_everything_but_keep_their_own_terms():
    a = seq([5, 6, 7, 8], advantage=1.0)
    b = seq([5, 6, 7, 8], advantage=-2.0)
    row = pack_row([a, b])
    assert row.input_ids.tolist() == [5, 6, 7, 8]
    assert row.predict_index.tolist() == [0, 1, 2, 0, 1, 2]
    assert row.sample_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert row.advantages.tolist() == [1.0] * 3 + [-2.0] * 3
    assert row.sample_end_index.tolist() == [3, 3]
    assert row.packing_ratio == 2.0
    assert row.trained_position_mask.sum().item() == 3
    _check_row_semantics([a, b], row)


@pytest.mark.parametrize("order", [0, 1])
def test_prefix_of_another_costs_nothing_and_keeps_predictions(order):
    short = seq([1, 2, 3], rid="short")
    long = seq([1, 2, 3, 4, 5], rid="long")
    samples = [short, long] if order == 0 else [long, short]
    row = pack_row(samples)
    assert row.input_ids.tolist() == [1, 2, 3, 4, 5]
    assert row.num_segments == 1
    si = samples.index(short)
    assert row.sample_end_index.tolist()[si] == 2
    short_preds = [i for i, s in zip(row.predict_index.tolist(), row.sample_index.tolist()) if s == si]
    assert short_preds == [0, 1]
    _check_row_semantics(samples, row)


def test_sample_ending_at_a_branch_point():
    # the short sample ends at p3 where two continuations branch: it rides along with one copy of p3
    samples = [seq([1, 2, 3]), seq([1, 2, 3, 4]), seq([1, 2, 3, 5])]
    row = pack_row(samples)
    assert row.input_ids.tolist() == [1, 2, 3, 4, 3, 5]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 2, 3]
    assert row.num_tokens == _trie_forwarded(samples) == count_forwarded_tokens(s.input_ids for s in samples)
    _check_row_semantics(samples, row)


def test_branch_at_first_label_gives_separate_roots_and_no_sharing_ratio_one():
    samples = [seq([1, 2]), seq([1, 3]), seq([7, 8, 9])]
    row = pack_row(samples)
    assert row.input_ids.tolist() == [1, 2, 1, 3, 7, 8, 9]
    assert row.position_ids.tolist() == [0, 1, 0, 1, 0, 1, 2]
    assert row.segment_parent.tolist() == [-1, -1, -1]
    assert row.packing_ratio == 1.0
    _check_row_semantics(samples, row)


def test_single_token_samples():
    samples = [seq([4], trained_from=1), seq([4], trained_from=1), seq([4, 5])]
    row = pack_row(samples)
    assert row.input_ids.tolist() == [4, 5]
    assert row.num_trained_tokens == 1
    _check_row_semantics(samples, row)


def test_multi_group_row():
    g0 = [seq([1, 2, 3, 4, 10 + i, 20 + i], trained_from=4, group=0) for i in range(3)]
    g1 = [seq([1, 2, 5, 6, 7, 30 + i, 40 + i], trained_from=5, group=1) for i in range(2)]
    samples = g0 + g1
    row = pack_row(samples)
    # [1] is shared; 2 is copied per group (its label differs), 4 and 7 per completion
    assert row.num_tokens == _trie_forwarded(samples)
    assert row.num_tokens == 1 + (2 + 3 * 3) + (3 + 2 * 3)
    assert row.sample_group_ids.tolist() == [0, 0, 0, 1, 1]
    assert row.packing_ratio == pytest.approx((3 * 6 + 2 * 7) / row.num_tokens)
    _check_row_semantics(samples, row)


def test_top_ids_and_candidate_sets_are_padded():
    tops = [[], [3, 4, 5], [6]]
    cands = [None, [3, 4], None]
    s = seq([1, 3, 6], tops=tops, cands=cands)
    row = pack_row([s])
    assert row.sampler_top_ids.tolist() == [[3, 4, 5], [6, -1, -1]]
    lp = row.sampler_top_logprobs
    assert lp[0].tolist() == [-1.0, -1.0, -1.0] and lp[1, 0].item() == -1.0 and math.isinf(lp[1, 1].item())
    assert row.candidate_ids.tolist() == [[3, 4], [-1, -1]]


def test_bad_samples_are_rejected_with_the_field_named():
    with pytest.raises(ValueError, match=r"samples\[0\].input_ids is empty"):
        pack_row([TrainingSequence([], [], [], 0.0, 0, 0, 0)])
    with pytest.raises(ValueError, match=r"trained_mask\[0\]"):
        pack_row([TrainingSequence([1, 2], [1, 1], [0.0, 0.0], 0.0, 0, 0, 0)])
    bad = seq([1, 2, 3])
    bad.sampler_top_ids = [[], [1]]
    with pytest.raises(ValueError, match="sampler_top_ids"):
        pack_row([bad])
    # top ids and log-probs of one trained token that do not pair up: the sample and token are named
    ok = seq([1, 2, 3], tops=[[], [2, 5], [3, 6]])
    unpaired = seq([1, 4, 5, 6], tops=[[], [4, 7], [5, 8], [6, 9]])
    unpaired.sampler_top_logprobs[2] = [-1.0]
    with pytest.raises(ValueError, match=r"samples\[1\] token 2: sampler_top_ids has 2 ids but "
                                         r"sampler_top_logprobs 1 values; they must pair up"):
        pack_row([ok, unpaired])


def test_empty_row():
    row = PackedRow.empty()
    assert row.num_tokens == 0 and row.num_trained_tokens == 0 and row.num_samples == 0
    assert row.packing_ratio == 1.0 and row.attention_cost == 0


def _random_samples(rng: random.Random, n: int, vocab: int = 6) -> list[TrainingSequence]:
    """Samples with lots of accidental sharing (small vocabulary), duplicates and prefixes."""
    out = []
    for _ in range(n):
        if out and rng.random() < 0.3:
            base = rng.choice(out).input_ids
            cut = rng.randint(1, len(base))
            ids = base[:cut] + [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        else:
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
        out.append(seq(ids, trained_from=rng.randint(1, max(1, len(ids))), group=rng.randrange(3)))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_random_rows_are_exact_and_minimal(seed):
    rng = random.Random(seed)
    samples = _random_samples(rng, rng.randint(1, 12))
    row = pack_row(samples)
    _check_row_semantics(samples, row)
    assert row.num_tokens == _trie_forwarded(samples)
    assert count_forwarded_tokens(s.input_ids for s in samples) == row.num_tokens
    shuffled = samples[:]
    rng.shuffle(shuffled)
    assert pack_row(shuffled).num_tokens == row.num_tokens  # independent of order
    # segments tile the row in order and match segment_ids
    starts, lengths = row.segment_start.tolist(), row.segment_length.tolist()
    assert [a + b for a, b in zip(starts, lengths)][:-1] == starts[1:] and starts[0] == 0
    assert sum(lengths) == row.num_tokens
    for s in range(row.num_segments):
        assert row.segment_ids[starts[s] : starts[s] + lengths[s]].eq(s).all()
    _check_segments(row)


def _check_segments(row: PackedRow) -> None:
    """Brute force from the DFS intervals: a token starts a segment iff it is a root or its parent has
    another number of children than one; segment parents and key lists follow."""
    pos, leave = row.position_ids.tolist(), row.dfs_leave.tolist()
    n = len(pos)
    parent = [max((j for j in range(i) if i <= leave[j] and pos[j] == pos[i] - 1), default=-1) for i in range(n)]
    kids = [sum(1 for i in range(n) if parent[i] == j) for j in range(n)]
    starts = [i for i in range(n) if parent[i] < 0 or kids[parent[i]] != 1]
    assert row.segment_start.tolist() == starts
    seg = row.segment_ids.tolist()
    assert row.segment_parent.tolist() == [seg[parent[i]] if parent[i] >= 0 else -1 for i in starts]
    for s, first in enumerate(starts):
        last = first + row.segment_length[s].item() - 1
        assert row.segment_key_indices(s) == [j for j in range(last + 1) if last <= leave[j]]


# ---------------------------------------------------------------- batcher


def _group(g: int, rng: random.Random, *, n: int, prompt: int, completion: tuple[int, int], vocab=1000) -> list:
    p = [rng.randrange(vocab) for _ in range(prompt)]
    return [
        seq(p + [rng.randrange(vocab) for _ in range(rng.randint(*completion))], trained_from=prompt, group=g,
            rid=f"{g}-{i}")
        for i in range(n)
    ]


def _check_plans(plans, samples, batcher: TokenBudgetBatcher):
    seen = [id(s) for mb in plans for row in mb.rows for s in row]
    dropped = [id(s) for s in batcher.dropped]
    assert sorted(seen + dropped) == sorted(id(s) for s in samples)  # each exactly once
    assert len(set(seen)) == len(seen)
    position = {id(s): i for i, s in enumerate(samples)}
    for mb in plans:
        assert len(mb.rows) == len(mb.row_tokens) == batcher.num_processes
        assert mb.num_samples > 0
        for r, row in enumerate(mb.rows):
            assert mb.row_tokens[r] <= batcher.token_budget
            assert [position[id(s)] for s in row] == mb.row_sample_indices[r]
            packed = pack_row(row)
            assert packed.num_tokens == mb.row_tokens[r]
            assert packed.attention_cost == mb.row_costs[r]
            assert packed.sample_tokens == mb.row_sample_tokens[r]


def test_batcher_keeps_groups_together_and_balances():
    rng = random.Random(0)
    samples = [s for g in range(8) for s in _group(g, rng, n=4, prompt=50, completion=(20, 20))]
    b = TokenBudgetBatcher(token_budget=10_000, num_processes=4)
    plans = b.plan(samples)
    _check_plans(plans, samples, b)
    assert len(plans) == 1
    rows = plans[0].rows
    for g in range(8):
        assert sum(any(s.group_id == g for s in row) for row in rows) == 1  # one row per group
    assert [len(row) for row in rows] == [8, 8, 8, 8]  # two groups per row: equal cost
    m = batch_metrics([[pack_row(r) for r in rows]], token_budget=10_000)
    assert m["batch/row_imbalance"] == pytest.approx(1.0)


def test_batcher_spills_a_full_group_into_an_empty_row_then_closes():
    rng = random.Random(1)
    g = _group(0, rng, n=6, prompt=40, completion=(30, 30))
    # one sample is 70 tokens; a second one adds 31 (its completion plus a copy of the last prompt token)
    b = TokenBudgetBatcher(token_budget=101, num_processes=2)
    plans = b.plan(g)
    _check_plans(plans, g, b)
    assert [len(r) for r in plans[0].rows] == [2, 2]  # the third sample spilled into the empty row
    assert [len(r) for r in plans[1].rows] == [2, 0]  # the fifth fits nowhere: micro-batch closed
    assert plans[0].row_tokens == [101, 101]


def _rule2_batcher(spill_len: int):
    b = TokenBudgetBatcher(token_budget=10, num_processes=2)
    assert b.add(seq(list(range(100, 106)), group=0)) is None  # row 0: 6 tokens, cost 21
    assert b.add(seq([1, 2, 3], group=1)) is None  # row 1 (least loaded): cost 6
    assert b.add(seq([4, 5, 6, 7, 8, 9], group=1)) is None  # row 1 again (rule 1): 9 tokens, cost 27
    return b, b.add(seq(list(range(200, 200 + spill_len)), group=1))  # row 1 is full: spill?


def test_batcher_rule2_spills_when_the_max_load_does_not_rise():
    b, closed = _rule2_batcher(3)  # row 0 would cost 21 + 6 = 27 <= 27: accepted
    assert closed is None
    mb = b.flush()
    assert [len(r) for r in mb.rows] == [2, 2] and mb.row_costs == [27, 27]


def test_batcher_rule2_closes_when_the_max_load_would_rise():
    b, closed = _rule2_batcher(4)  # row 0 would cost 21 + 10 = 31 > 27 although 10 tokens fit
    assert closed is not None and [len(r) for r in closed.rows] == [1, 2]
    last = b.flush()
    assert [len(r) for r in last.rows] == [1, 0]
    assert b.flush() is None


def test_batcher_drops_oversize_samples():
    b = TokenBudgetBatcher(token_budget=5, num_processes=2)
    samples = [seq([1, 2, 3]), seq(list(range(6))), seq([1, 2, 4])]
    plans = b.plan(samples)
    assert b.dropped_oversize_count == 1 and b.dropped == [samples[1]]
    _check_plans(plans, samples, b)
    rows = [[pack_row(r) for r in mb.rows] for mb in plans]
    m = batch_metrics(rows, token_budget=5, dropped_oversize_count=b.dropped_oversize_count)
    assert m["batch/dropped_oversize_count"] == 1.0 and m["batch/samples_per_step"] == 2


def test_batcher_rejects_bad_arguments():
    with pytest.raises(ValueError, match="token_budget"):
        TokenBudgetBatcher(token_budget=0, num_processes=1)
    with pytest.raises(ValueError, match="num_processes"):
        TokenBudgetBatcher(token_budget=10, num_processes=1.5)


@pytest.mark.parametrize("seed", range(12))
def test_batcher_random_invariants(seed):
    rng = random.Random(seed)
    procs = rng.randint(1, 4)
    budget = rng.randint(20, 120)
    samples = []
    for g in range(rng.randint(1, 10)):
        samples += _group(g, rng, n=rng.randint(1, 6), prompt=rng.randint(1, 40), completion=(1, 40), vocab=5)
    samples += _random_samples(rng, 10)  # lots of accidental cross-group sharing
    rng.shuffle(samples)
    b = TokenBudgetBatcher(token_budget=budget, num_processes=procs)
    plans = b.plan(samples)
    _check_plans(plans, samples, b)
    assert b.dropped_oversize_count == sum(len(s.input_ids) > budget for s in samples)


@pytest.mark.parametrize("seed", range(8))
def test_batcher_with_ample_budget_keeps_every_group_in_one_row_and_balances(seed):
    rng = random.Random(seed)
    procs = rng.randint(1, 5)
    samples, group_cost = [], {}
    for g in range(rng.randint(1, 12)):
        prompt = [g * 10_000 + rng.randrange(1000) for _ in range(rng.randint(1, 30))]
        grp = [seq(prompt + [g * 10_000 + rng.randrange(1000) for _ in range(rng.randint(1, 30))], group=g)
               for _ in range(rng.randint(1, 5))]
        group_cost[g] = pack_row(grp).attention_cost
        samples += grp
    b = TokenBudgetBatcher(token_budget=100_000, num_processes=procs)
    plans = b.plan(samples)
    _check_plans(plans, samples, b)
    assert len(plans) == 1
    rows = plans[0].rows
    for g in group_cost:
        assert sum(any(s.group_id == g for s in row) for row in rows) == 1
    costs = plans[0].row_costs
    # greedy least-loaded placement: the spread is at most one group's cost
    assert max(costs) - min(costs) <= max(group_cost.values())


def test_batcher_planning_speed():
    rng = random.Random(0)
    samples = []
    for g in range(64):
        prompt = [rng.randrange(150_000) for _ in range(200)]
        for i in range(8):
            samples.append(seq(prompt + [rng.randrange(150_000) for _ in range(rng.randint(600, 1000))],
                               trained_from=200, group=g))
    b = TokenBudgetBatcher(token_budget=8192, num_processes=4)
    t0 = time.perf_counter()
    plans = b.plan(samples)
    elapsed = time.perf_counter() - t0
    assert sum(mb.num_samples for mb in plans) == 512
    assert elapsed < 1.0, f"planning 512 samples took {elapsed * 1e3:.0f} ms (target well under 100 ms)"


# ---------------------------------------------------------------- metrics


def test_batch_metrics_on_the_worked_example():
    r0 = seq([P1, P2, P3, A1, A2], trained_from=3, group=7)
    r1 = seq([P1, P2, P3, B1, B2], trained_from=3, group=7)
    r2 = seq([4, 5, 6], group=8)
    mb1 = [pack_row([r0, r1]), pack_row([r2])]
    mb2 = [pack_row([r2]), PackedRow.empty()]
    m = batch_metrics([mb1, mb2], token_budget=10, dropped_oversize_count=2)
    assert m["batch/forwarded_tokens_per_step"] == 8 + 3 + 3
    assert m["batch/trained_tokens_per_step"] == 4 + 2 + 2
    assert m["batch/samples_per_step"] == 4
    assert m["batch/groups_per_step"] == 2
    assert m["batch/microbatches_per_step"] == 2
    assert m["batch/masked_token_frac"] == pytest.approx(1 - 8 / 14)
    assert m["batch/samples_per_row"] == pytest.approx(4 / 4)
    assert m["batch/row_tokens_mean"] == pytest.approx(14 / 4)
    assert m["batch/row_tokens_max"] == 8
    assert m["batch/row_fill_frac"] == pytest.approx(14 / 4 / 10)
    c_tree, c_small = 27, 6
    expected_imb = (c_tree / ((c_tree + c_small) / 2) + c_small / (c_small / 2)) / 2
    assert m["batch/row_imbalance"] == pytest.approx(expected_imb)
    assert m["batch/packing_ratio"] == pytest.approx((10 + 3 + 3) / 14)
    assert m["batch/pad_frac"] == pytest.approx((5 + 3) / (16 + 6))
    assert m["batch/dropped_oversize_count"] == 2
    assert packing_ratio(mb1 + mb2) == pytest.approx(16 / 14)
    # RowStats and PackedRow give the same numbers
    m2 = batch_metrics([[r.stats() for r in mb1], [r.stats() for r in mb2]], token_budget=10, dropped_oversize_count=2)
    assert m2 == m


def test_batch_metrics_empty_step_and_attention_cost_helper():
    m = batch_metrics([], token_budget=8)
    assert m["batch/packing_ratio"] == 1.0 and m["batch/row_imbalance"] == 1.0 and m["batch/pad_frac"] == 0.0
    assert attention_cost([0, 1, 2, 1]) == 1 + 2 + 3 + 2 == attention_cost(torch.tensor([0, 1, 2, 1]))
    assert isinstance(RowStats(), RowStats)
    with pytest.raises(ValueError, match="token_budget"):
        batch_metrics([], token_budget=0)


def test_an_oversize_streak_is_counted_until_a_sample_fits_and_names_the_fix():
    """Issue 25: a budget no sample fits dropped everything silently for minutes; the trainer now stops once
    `OVERSIZE_STREAK_LIMIT` samples in a row were dropped, with this message."""
    from asyncgrpo_cli.train.batcher import oversize_stop_message

    b = TokenBudgetBatcher(token_budget=4, num_processes=1)
    for _ in range(3):
        assert b.add(seq([1, 2, 3, 4, 5, 6], trained_from=3)) is None
    assert b.oversize_streak == 3 and b.dropped_oversize_count == 3
    b.add(seq([1, 2, 3], trained_from=1))
    assert b.oversize_streak == 0 and b.dropped_oversize_count == 3
    text = oversize_stop_message(32, 49, 256)
    assert text.startswith("packing.token_budget=32: the last 256 samples were all longer") and "at least 49" in text


def test_batcher_max_groups_closes_a_micro_batch_at_the_group_bound():
    """Issue #41: with max_groups, a new group closes a micro-batch that holds that many groups, well inside the
    token budget; a group already in it still joins it; every sample is placed exactly once."""
    rng = random.Random(7)
    samples = [s for g in range(10) for s in _group(g, rng, n=4, prompt=20, completion=(5, 9))]
    unbounded = TokenBudgetBatcher(token_budget=100_000, num_processes=2).plan(samples)
    assert len(unbounded) == 1
    b = TokenBudgetBatcher(token_budget=100_000, num_processes=2, max_groups=3)
    plans = b.plan(samples)
    _check_plans(plans, samples, b)
    groups = [sorted({s.group_id for row in p.rows for s in row}) for p in plans]
    assert groups == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert [p.num_samples for p in plans] == [12, 12, 12, 4]
    with pytest.raises(ValueError, match="max_groups"):
        TokenBudgetBatcher(token_budget=10, num_processes=1, max_groups=0)
