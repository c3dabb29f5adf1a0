"""Tree packing of samples into rows (SPEC §6); the token-budget batcher and the batch metrics that use it
are in `asyncgrpo_cli.train.batcher` (which imports this module, never the other way round).

A **row** is what one process forwards in one micro-batch: the samples placed there by
`batcher.TokenBudgetBatcher`, laid out by :func:`pack_row` as a prefix trie in depth-first order.

Sharing rule (SPEC §6.2, "branching one token early"): a position predicts the token after it, so a
token may be forwarded once for several samples only if their paths up to it *and its successor* (its
label) agree. In terms of the plain token trie (one node per distinct prefix), a node ``u`` is forwarded
``max(1, |children(u)|)`` times: once per distinct next token, and a sample that *ends* at ``u`` (no label,
so it predicts nothing there) rides along with any copy. Hence

- identical samples cost nothing extra (same row positions, each keeps its own targets, advantage and
  sampler log-probs);
- a sample that is a prefix of another costs nothing extra either (it ends inside the other's path, and
  still gets its own predictions and an end marker, ``PackedRow.sample_end_index``);
- with nothing shared every sample is its own segment: ordinary padding-free packing, packing ratio 1.0.

Position ids are depths in the trie, so every token gets exactly the rotary position (and the exact set
of keys, see ``asyncgrpo_cli.train.tree_attention``) that it would get if its sample were forwarded alone.

Attention cost (used for balance and ``batch/row_imbalance``): the number of (query, key) pairs tree
attention computes, ``Σ_i (position_i + 1)`` over the row's forwarded tokens. Equivalently, summed over
segments, ``query_len × key_len_along_path`` minus the causal upper triangle of the segment's own block.
"""

from __future__ import annotations

import bisect
import logging
import math
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from asyncgrpo_cli.rollout.types import TrainingSequence

__all__ = [
    "PackedRow",
    "RowStats",
    "attention_cost",
    "count_forwarded_tokens",
    "pack_row",
    "packing_ratio",
]

logger = logging.getLogger(__name__)


def attention_cost(position_ids: Iterable[int]) -> int:
    """Attention cost of a row: ``Σ_i (position_i + 1)``, the number of attended (query, key) pairs.

    Args:
        position_ids: the row's position ids (depths in the trie), ints or a 1-D int tensor.
    """
    if isinstance(position_ids, torch.Tensor):
        return int(position_ids.sum().item()) + int(position_ids.numel())
    return sum(p + 1 for p in position_ids)


def _span_cost(start: int, end: int) -> int:
    """Cost of forwarding depths ``start .. end-1``: ``Σ_{k=start}^{end-1} (k + 1)``."""
    return (end * (end + 1) - start * (start + 1)) // 2


# --------------------------------------------------------------------------------------------------
# Prefix sharing between token lists (pack_row and the batcher)
# --------------------------------------------------------------------------------------------------


_W = 4  # bytes per token in a key
if array("I").itemsize != _W:  # pragma: no cover - every mainstream platform has a 4-byte unsigned int
    raise ImportError("asyncgrpo packing needs array('I') to hold 4-byte unsigned ints on this platform")


def _key(ids: Sequence[int]) -> bytes:
    """Fixed-width (4-byte) big-endian bytes of a token list: byte order matches token order, and a
    common prefix of ``c`` tokens is a common prefix of ``4c`` bytes."""
    try:
        a = array("I", ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must lie in [0, 2**32); got one outside ({exc})") from None
    if sys.byteorder == "little":
        a.byteswap()
    return a.tobytes()


def _lcp_tokens(a: bytes, b: bytes) -> int:
    """Longest common prefix of two token keys, in tokens (one C-speed pass via big-int XOR)."""
    n = min(len(a), len(b))
    x = int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")
    if x == 0:
        return n // _W
    return (n - 1 - (x.bit_length() - 1) // 8) // _W


def _deepest_share(keys: list[bytes], key: bytes) -> tuple[int, int, bool, int]:
    """How deep the sample with ``key`` can share with the samples of sorted ``keys``.

    The longest common prefix with a set of strings is reached at a sorted neighbour, and all strings
    with that prefix are contiguous around the insertion point, so two comparisons suffice.

    Returns:
        ``(pos, c, continues, j)``: insertion position of ``key``; ``c``, the longest common prefix in
        tokens; ``continues``, whether some sample with that prefix goes on past it (then the token at
        depth ``c - 1`` needs its own copy, branching one token early); ``j``, index in ``keys`` of a
        neighbour achieving ``c`` (``-1`` when ``c == 0``).
    """
    pos = bisect.bisect_left(keys, key)
    c, continues, best = 0, False, -1
    for j in (pos - 1, pos):
        if 0 <= j < len(keys):
            other_len = len(keys[j]) // _W
            lcp = _lcp_tokens(key, keys[j])
            if lcp > c:
                c, continues, best = lcp, other_len > lcp, j
            elif lcp == c and lcp > 0 and other_len > lcp:
                continues = True
    return pos, c, continues, best


class _RowCounter:
    """Forwarded tokens and attention cost of a growing row, updated per sample in ``O(log n + T)`` C time.

    Keeps the row's samples as sorted keys: the longest common prefix ``c`` of a new sample with the row
    is reached at a sorted neighbour. Inserting it then forwards depths ``c .. T-1``, plus one extra copy
    of the token at depth ``c - 1`` if some sample continues past that prefix (branch one token early).
    """

    __slots__ = ("keys", "tokens", "cost", "sample_tokens")

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.tokens = 0
        self.cost = 0
        self.sample_tokens = 0

    def delta(self, key: bytes) -> tuple[int, int]:
        """(new forwarded tokens, new attention cost) if the sample with ``key`` were added."""
        t = len(key) // _W
        _, c, extra, _ = _deepest_share(self.keys, key)
        if c >= t:
            return 0, 0
        start = c - 1 if (c > 0 and extra) else c
        return t - start, _span_cost(start, t)

    def add(self, key: bytes, delta: tuple[int, int]) -> None:
        bisect.insort(self.keys, key)
        self.tokens += delta[0]
        self.cost += delta[1]
        self.sample_tokens += len(key) // _W


def count_forwarded_tokens(token_lists: Iterable[Sequence[int]]) -> int:
    """Forwarded tokens of a row holding these samples after tree packing (equals
    ``pack_row(...).num_tokens``), computed without building the row."""
    row = _RowCounter()
    for ids in token_lists:
        key = _key(ids)
        row.add(key, row.delta(key))
    return row.tokens


# --------------------------------------------------------------------------------------------------
# Packed row
# --------------------------------------------------------------------------------------------------


@dataclass
class RowStats:
    """Plain-int summary of one row, enough for :func:`batch_metrics` (all counts in tokens).

    Attributes:
        num_tokens: forwarded (unique) tokens of the row.
        num_trained_tokens: trained tokens (loss terms), counted per sample.
        num_trained_positions: distinct row positions holding a trained token of at least one sample.
        num_samples: samples in the row.
        sample_tokens: sum of the samples' own token counts (before sharing).
        attention_cost: ``Σ (position + 1)`` over the row (see module docstring).
        group_ids: group id of each sample.
    """

    num_tokens: int = 0
    num_trained_tokens: int = 0
    num_trained_positions: int = 0
    num_samples: int = 0
    sample_tokens: int = 0
    attention_cost: int = 0
    group_ids: tuple[int, ...] = ()


@dataclass
class PackedRow:
    """One tree-packed row (SPEC §6.2). ``L`` forwarded tokens, ``S`` segments, ``N`` trained tokens
    (over all samples, so shared positions can appear several times), ``n`` samples, ``K`` sampler top ids
    per trained token, ``M`` candidate ids per trained token. All tensors are on the CPU when built.

    Row layout (depth-first over the trie; a segment is a maximal chain of single-child nodes, so it is a
    contiguous index range and segments are numbered in order of their first index):
        input_ids: ``[L]`` int64 token ids.
        position_ids: ``[L]`` int64 depth in the trie (= position of the token in each of its samples).
        segment_ids: ``[L]`` int64 segment of each token.
        dfs_enter: ``[L]`` int64 DFS entry time of each token (equal to its row index).
        dfs_leave: ``[L]`` int64 index of the last token of each token's subtree. Key ``j`` is an ancestor-or-
            self of query ``i`` iff ``dfs_enter[j] <= i <= dfs_leave[j]``.
        trained_position_mask: ``[L]`` bool, True where the token is a trained token of some sample.
        segment_start, segment_length: ``[S]`` int64 first row index and token count of each segment.
        segment_parent: ``[S]`` int64 parent segment, ``-1`` for a root segment.

    Trained tokens, ordered by sample then by position in the sample:
        predict_index: ``[N]`` int64 row index whose hidden state predicts the token (the row index of the
            preceding token of the same sample).
        target_ids: ``[N]`` int64 the trained token ids.
        sample_index: ``[N]`` int64 index of the sample (into the ``samples`` given to :func:`pack_row`).
        advantages: ``[N]`` float32 the sample's advantage.
        sampler_logprobs: ``[N]`` float32 sampler log-prob of the token (natural log).
        sampler_top_ids: ``[N, K]`` int64 sampler's top ids, ``-1`` = padding (``K`` may be 0).
        sampler_top_logprobs: ``[N, K]`` float32 their log-probs, ``-inf`` = padding.
        candidate_ids: ``[N, M]`` int64 candidate set of each token (SPEC §7), ``-1`` = padding, a row of
            padding = full vocabulary; ``None`` when no trained token has a candidate set.

    Per sample:
        sample_num_tokens: ``[n]`` int64 tokens of each sample alone.
        sample_end_index: ``[n]`` int64 row index of each sample's last token (its end marker).
        sample_group_ids, sample_model_versions: ``[n]`` int64 provenance.
        rollout_ids: ``n`` strings.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    dfs_enter: torch.Tensor
    dfs_leave: torch.Tensor
    trained_position_mask: torch.Tensor
    segment_start: torch.Tensor
    segment_length: torch.Tensor
    segment_parent: torch.Tensor
    predict_index: torch.Tensor
    target_ids: torch.Tensor
    sample_index: torch.Tensor
    advantages: torch.Tensor
    sampler_logprobs: torch.Tensor
    sampler_top_ids: torch.Tensor
    sampler_top_logprobs: torch.Tensor
    candidate_ids: torch.Tensor | None
    sample_num_tokens: torch.Tensor
    sample_end_index: torch.Tensor
    sample_group_ids: torch.Tensor
    sample_model_versions: torch.Tensor
    rollout_ids: list[str] = field(default_factory=list)

    @classmethod
    def empty(cls) -> PackedRow:
        """A row with no samples (a process idle in this micro-batch); ``L = N = n = 0``."""
        return pack_row([])

    @property
    def num_tokens(self) -> int:
        """Forwarded tokens ``L``."""
        return int(self.input_ids.numel())

    @property
    def num_trained_tokens(self) -> int:
        """Trained tokens ``N`` (loss terms), counted per sample."""
        return int(self.target_ids.numel())

    @property
    def num_samples(self) -> int:
        """Samples ``n`` in the row."""
        return int(self.sample_num_tokens.numel())

    @property
    def num_segments(self) -> int:
        """Segments ``S`` in the row."""
        return int(self.segment_start.numel())

    @property
    def sample_tokens(self) -> int:
        """Sum of the samples' own token counts, before sharing (tokens)."""
        return int(self.sample_num_tokens.sum().item())

    @property
    def attention_cost(self) -> int:
        """``Σ (position + 1)``: attended (query, key) pairs of the row (module docstring)."""
        return attention_cost(self.position_ids)

    @property
    def packing_ratio(self) -> float:
        """Sample tokens per forwarded token (Appendix B.13); 1.0 for an empty row."""
        return self.sample_tokens / self.num_tokens if self.num_tokens else 1.0

    def segment_key_indices(self, segment: int) -> list[int]:
        """Row indices of the keys/values along ``segment``'s trie path (ancestors first, then its own),
        as in SPEC §6.2 step 4. Raises IndexError for a segment outside ``[0, S)``."""
        if not 0 <= segment < self.num_segments:
            raise IndexError(f"segment={segment} is outside [0, {self.num_segments})")
        starts, lengths, parents = (t.tolist() for t in (self.segment_start, self.segment_length, self.segment_parent))
        chain = []
        s = segment
        while s >= 0:
            chain.append(s)
            s = parents[s]
        out: list[int] = []
        for s in reversed(chain):
            out.extend(range(starts[s], starts[s] + lengths[s]))
        return out

    def stats(self) -> RowStats:
        """Plain-int summary for :func:`batch_metrics`."""
        return RowStats(
            num_tokens=self.num_tokens,
            num_trained_tokens=self.num_trained_tokens,
            num_trained_positions=int(self.trained_position_mask.sum().item()),
            num_samples=self.num_samples,
            sample_tokens=self.sample_tokens,
            attention_cost=self.attention_cost,
            group_ids=tuple(self.sample_group_ids.tolist()),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedRow:
        """A copy with every tensor moved to ``device``."""
        kwargs = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            kwargs[name] = value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
        return PackedRow(**kwargs)


def _check_sample(i: int, s: TrainingSequence) -> None:
    n = len(s.input_ids)
    if n == 0:
        raise ValueError(f"samples[{i}].input_ids is empty; every sample needs at least one token")
    if s.trained_mask[0]:
        raise ValueError(
            f"samples[{i}].trained_mask[0] is {s.trained_mask[0]}; the first token of a sample has no "
            "preceding token to predict it, so it cannot be trained: set it to 0"
        )
    for name in ("sampler_top_ids", "sampler_top_logprobs", "sampling_mask"):
        value = getattr(s, name)
        if value is not None and len(value) != n:
            raise ValueError(
                f"samples[{i}].{name} has {len(value)} entries but input_ids has {n}; give one entry per "
                "token (empty/None for untrained tokens) or None"
            )


def pack_row(samples: Sequence[TrainingSequence]) -> PackedRow:
    """Tree-pack ``samples`` into one row (SPEC §6.2). See :class:`PackedRow` for the layout.

    Children are laid out in order of first appearance, except that a node's older continuation comes
    before branches added later, so the first sample's path comes first (as in the SPEC example).

    Cost: ``O(Σ T)`` in bulk list/tensor operations plus ``O(n log n)`` Python steps for ``n`` samples.
    Each sample is a new *chain* of nodes hung below the deepest node it can share (found at a sorted
    neighbour, as in the batcher's counter); the layout then works chain by chain.

    Raises:
        ValueError: a sample with no tokens, a trained first token, per-token lists whose length differs
            from ``input_ids``, or a trained token whose sampler top ids and log-probs differ in length.
    """
    tok: list[int] = []  # per node
    depth: list[int] = []
    parent_node: list[int] = []
    node_chain: list[int] = []
    chain_first: list[int] = []  # per chain: first node, length, branches (offset, chain)
    chain_len: list[int] = []
    chain_kids: list[list[tuple[int, int]]] = []
    roots: list[int] = []
    paths: list[list[int]] = []
    keys: list[bytes] = []  # sorted keys of the samples so far, and who owns them
    owners: list[int] = []

    for i, s in enumerate(samples):
        _check_sample(i, s)
        ids = s.input_ids
        t = len(ids)
        key = _key(ids)
        pos, c, extra, j = _deepest_share(keys, key)
        best = owners[j] if j >= 0 else -1
        if c >= t:  # ends inside an earlier sample's path (or duplicates it)
            path = paths[best][:t]
        else:
            if c == 0:
                shared, attach = 0, -1
            elif extra:  # branch one token early: a new copy of the token at depth c - 1
                shared = c - 1
                attach = paths[best][c - 2] if c >= 2 else -1
            else:  # continue from the leaf where an earlier sample ended
                shared, attach = c, paths[best][c - 1]
            first, n = len(tok), t - shared
            cid = len(chain_first)
            tok.extend(ids[shared:])
            depth.extend(range(shared, t))
            parent_node.append(attach)
            parent_node.extend(range(first, first + n - 1))
            node_chain.extend([cid] * n)
            chain_first.append(first)
            chain_len.append(n)
            chain_kids.append([])
            if attach < 0:
                roots.append(cid)
            else:
                pc = node_chain[attach]
                chain_kids[pc].append((attach - chain_first[pc], cid))
            path = paths[best][:shared] + list(range(first, first + n)) if shared else list(range(first, first + n))
        paths.append(path)
        keys.insert(pos, key)
        owners.insert(pos, i)

    # Layout chain by chain: a chain is contiguous in DFS order (its own continuation is each node's
    # first child); a node's branches follow, deepest attachment first.
    num_nodes, num_chains = len(tok), len(chain_first)
    size = chain_len[:]
    for cid in range(num_chains - 1, -1, -1):  # children have larger ids than their parent
        for _, kid in chain_kids[cid]:
            size[cid] += size[kid]
    kids_sorted = [sorted(k, key=lambda x: -x[0]) for k in chain_kids]
    start = [0] * num_chains
    cursor = 0
    for cid in roots:
        start[cid] = cursor
        cursor += size[cid]
    order = [0] * num_nodes
    index = [0] * num_nodes
    leave = [0] * num_nodes
    seg_flag = [False] * num_nodes
    for cid in roots:
        seg_flag[start[cid]] = True
    for cid in range(num_chains):
        s0, f, n = start[cid], chain_first[cid], chain_len[cid]
        order[s0 : s0 + n] = range(f, f + n)
        index[f : f + n] = range(s0, s0 + n)
        cur = s0 + n
        acc, prev = s0 + n - 1, n
        per_offset: dict[int, int] = {}
        for off, kid in kids_sorted[cid]:
            start[kid] = cur
            cur += size[kid]
            leave[s0 + off + 1 : s0 + prev] = [acc] * (prev - off - 1)
            acc += size[kid]
            prev = off + 1
            per_offset[off] = per_offset.get(off, 0) + 1
        leave[s0 : s0 + prev] = [acc] * prev
        for off, count in per_offset.items():
            if count + (off < n - 1) >= 2:  # a branch point: every child starts a segment
                if off < n - 1:
                    seg_flag[s0 + off + 1] = True
                for o, kid in kids_sorted[cid]:
                    if o == off:
                        seg_flag[start[kid]] = True

    # Host lists become tensors through numpy: ``np.array`` of a list of Python numbers is 2-3x faster than
    # ``torch.tensor`` of it, and this half of the function was most of pack_row's time (issue #43 item 3).
    i64 = torch.int64
    order_t = _int_tensor(order)
    index_t = _int_tensor(index)
    flags = torch.from_numpy(np.array(seg_flag, dtype=np.bool_))
    segment_ids = torch.cumsum(flags.to(i64), 0) - 1
    seg_start = flags.nonzero().flatten()
    seg_len = torch.diff(seg_start, append=torch.tensor([num_nodes], dtype=i64))
    # parent node of each segment's first token (-1 for a root), then that node's segment
    start_parent = _int_tensor(parent_node)[order_t[seg_start]] if num_nodes else seg_start
    seg_parent = torch.where(start_parent >= 0, segment_ids[index_t[start_parent.clamp(min=0)]], -1)
    seg_parent = seg_parent if num_nodes else seg_start

    # Trained tokens, vectorised over the concatenation of all samples.
    flat_ids: list[int] = []
    flat_mask: list[int] = []
    flat_lp: list[float] = []
    flat_path: list[int] = []
    for s, path in zip(samples, paths):
        flat_ids.extend(s.input_ids)
        flat_mask.extend(s.trained_mask)
        flat_lp.extend(s.sampler_logprobs)
        flat_path.extend(path)
    lengths = _int_tensor([len(s.input_ids) for s in samples])
    g = torch.from_numpy(np.array(flat_mask, dtype=np.bool_)).nonzero().flatten()  # never a sample's first token
    path_t = _int_tensor(flat_path)
    sample_of = torch.repeat_interleave(torch.arange(len(samples), dtype=i64), lengths)
    sample_index = sample_of[g]
    predict_index = index_t[path_t[g - 1]] if g.numel() else g
    trained_position_mask = torch.zeros(num_nodes, dtype=torch.bool)
    if g.numel():
        trained_position_mask[index_t[path_t[g]]] = True
    advantages = torch.from_numpy(np.array([float(s.advantage) for s in samples], dtype=np.float32))[sample_index]

    g_list = g.tolist()
    n_trained = len(g_list)
    top_ids_t = torch.full((n_trained, 0), -1, dtype=i64)
    top_lps_t = torch.full((n_trained, 0), -math.inf, dtype=torch.float32)
    candidate_ids = None
    if any(s.sampler_top_ids is not None for s in samples):
        tid: list = []
        tlp: list = []
        for i, s in enumerate(samples):
            tid.extend(s.sampler_top_ids if s.sampler_top_ids is not None else [None] * len(s.input_ids))
            tlp.extend(s.sampler_top_logprobs if s.sampler_top_logprobs is not None else [None] * len(s.input_ids))
        ti = [tid[x] or [] for x in g_list]
        tl = [tlp[x] or [] for x in g_list]
        ti_len, tl_len = _lengths(ti), _lengths(tl)
        unpaired = np.flatnonzero(ti_len != tl_len)
        if unpaired.size:
            k = int(unpaired[0])
            x = g_list[k]
            offsets = np.cumsum([0] + [len(s.input_ids) for s in samples]).tolist()
            i = bisect.bisect_right(offsets, x) - 1
            raise ValueError(
                f"samples[{i}] token {x - offsets[i]}: sampler_top_ids has {len(ti[k])} ids but "
                f"sampler_top_logprobs {len(tl[k])} values; they must pair up"
            )
        top_ids_t = _padded(ti, -1, np.int64, ti_len)
        top_lps_t = _padded(tl, -math.inf, np.float32, tl_len)
    if any(s.sampling_mask is not None for s in samples):
        cm: list = []
        for s in samples:
            cm.extend(s.sampling_mask if s.sampling_mask is not None else [None] * len(s.input_ids))
        cands = [cm[x] or [] for x in g_list]
        if any(cands):
            candidate_ids = _padded(cands, -1, np.int64)

    ids_t = _int_tensor(flat_ids)
    return PackedRow(
        input_ids=_int_tensor(tok)[order_t] if num_nodes else order_t,
        position_ids=_int_tensor(depth)[order_t] if num_nodes else order_t,
        segment_ids=segment_ids,
        dfs_enter=torch.arange(num_nodes, dtype=i64),
        dfs_leave=_int_tensor(leave),
        trained_position_mask=trained_position_mask,
        segment_start=seg_start,
        segment_length=seg_len,
        segment_parent=seg_parent,
        predict_index=predict_index,
        target_ids=ids_t[g],
        sample_index=sample_index,
        advantages=advantages,
        sampler_logprobs=torch.from_numpy(np.array(flat_lp, dtype=np.float32))[g],
        sampler_top_ids=top_ids_t,
        sampler_top_logprobs=top_lps_t,
        candidate_ids=candidate_ids,
        sample_num_tokens=lengths,
        sample_end_index=_int_tensor([index[p[-1]] for p in paths]),
        sample_group_ids=_int_tensor([s.group_id for s in samples]),
        sample_model_versions=_int_tensor([s.model_version for s in samples]),
        rollout_ids=[s.rollout_id for s in samples],
    )


def _int_tensor(values: list[int]) -> torch.Tensor:
    """``[len(values)]`` int64 tensor of a list of ints (through numpy: faster than ``torch.tensor``)."""
    return torch.from_numpy(np.array(values, dtype=np.int64).reshape(len(values)))


def _lengths(rows: list[list]) -> np.ndarray:
    """``[len(rows)]`` int64 array of each list's length."""
    return np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))


def _padded(rows: list[list], pad: float, dtype: type, lengths: np.ndarray | None = None) -> torch.Tensor:
    """``[len(rows), max len]`` tensor of ragged lists, right-padded with ``pad`` (``dtype``: a numpy dtype;
    ``lengths``: `_lengths` of ``rows`` when the caller has it)."""
    lengths = _lengths(rows) if lengths is None else lengths
    width = int(lengths.max()) if len(rows) else 0
    flat = np.array(list(chain.from_iterable(rows)), dtype=dtype)
    if flat.size == len(rows) * width:  # every list as long as the longest: no padding
        return torch.from_numpy(flat.reshape(len(rows), width))
    out = np.full((len(rows), width), pad, dtype=dtype)
    out[np.arange(width) < lengths[:, None]] = flat  # row-major: each row's values, then its padding
    return torch.from_numpy(out)


def packing_ratio(rows: Iterable[PackedRow | RowStats]) -> float:
    """Sample tokens per forwarded token over ``rows`` (Appendix B.13); 1.0 when nothing is forwarded."""
    sample_tokens = forwarded = 0
    for row in rows:
        st = row.stats() if isinstance(row, PackedRow) else row
        sample_tokens += st.sample_tokens
        forwarded += st.num_tokens
    return sample_tokens / forwarded if forwarded else 1.0
