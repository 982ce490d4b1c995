"""The five residual modes as a static plan over a fixed-shape source buffer.

The model keeps its depth sources in one buffer of `n_slots` slots, each [B, T, D]:

- per-sublayer modes (`full_attnres`, `delta`): slot 0 holds the embedding e and
  slot j+1 the delta v_j of sublayer j, so sublayer j reads slots 0..j;
- block modes (`block_attnres`, `delta_block`): slot 0 holds e and slot n+1 the
  sum of the deltas of block n, c_n, once the block is complete. Sublayer j of
  block n reads slots 0..n, plus the partial p_j (the block's deltas so far) in
  slot n+1 unless j opens the block (or `include_partial` is off); p_j is the
  stream minus the stream at the block's start (deltares.nn.depth), so it is
  read from the stream, never saved.

Every sublayer adds its delta into its `write` slot. Which slots each sublayer
reads is the table of docs/explanations/modes.md, fixed at trace time, so one scanned
layer body serves every depth.

Two-phase grouped routing (docs/explanations/store-once.md) splits each sublayer's sources at
its group's start: the slots completed before the group (`prefix_read`), routed
for all the group's sublayers in one pass, and the few written inside the group
(`intra_read`), merged per sublayer. A group is `group_layers` consecutive layers
(at most; a divisor of the block in the block modes, whose only intra source is then
the partial, and of the depth in the per-sublayer modes).

The store-once scan runs in segments (`ResidualPlan.segments`): consecutive layers whose
routers read a static prefix of the buffer, the slots any of them reads. A scanned router
then reads the slots written so far (up to a segment's few), not all n_slots.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from deltares.nn.config import BLOCK_MODES, MODES, REPLACEMENT_MODES


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers [first, first + n_layers) of the store-once scan: their routers read slots
    0..n_read - 1 of the buffer; `write`: the one slot they all write (a block), else None."""

    first: int
    n_layers: int
    n_read: int
    write: int | None


@dataclasses.dataclass(frozen=True, eq=False)
class ResidualPlan:
    mode: str
    n_layers: int
    n_slots: int
    read: np.ndarray  # [2L, n_slots] bool: slots sublayer j routes over
    write: np.ndarray  # [2L] int: slot that receives sublayer j's delta
    final_read: np.ndarray  # [n_slots] bool: slots of the Kimi modes' output routing
    group_layers: int = 1  # layers per two-phase routing group (a divisor of the block in the block modes)
    scan_segments: int = 1  # at most this many segments of the store-once scan (`segments`)

    @property
    def n_sources(self) -> np.ndarray:
        """[2L] number of sources each sublayer sees (0 in baseline)."""
        return self.read.sum(axis=1).astype(np.int32)

    @property
    def routed(self) -> np.ndarray:
        """[2L] whether sublayer j routes: more than one source (softmax over one is constant)."""
        return self.n_sources > 1

    @property
    def opens_block(self) -> np.ndarray:
        """[2L] block modes: sublayer j is its block's first (it starts a new partial)."""
        return np.r_[True, self.write[1:] != self.write[:-1]] & (self.mode in BLOCK_MODES)

    @property
    def closes_block(self) -> np.ndarray:
        """[2L] block modes: sublayer j is its block's last (its write completes the block's slot)."""
        return np.r_[self.write[1:] != self.write[:-1], True] & (self.mode in BLOCK_MODES)

    @property
    def block_start_layer(self) -> np.ndarray:
        """[L] the first layer of each layer's block (block modes; each layer its own otherwise)."""
        if self.mode not in BLOCK_MODES:
            return np.arange(self.n_layers, dtype=np.int32)
        first_sublayer = np.maximum.accumulate(np.where(self.opens_block, np.arange(2 * self.n_layers), 0))
        return (first_sublayer[::2] // 2).astype(np.int32)

    @property
    def prefix_read(self) -> np.ndarray:
        """[2L, n_slots] the slots of `read` completed before sublayer j's group: every slot below
        the group's first write slot (block modes: the completed blocks and e)."""
        first_slot = self.write[(np.arange(2 * self.n_layers) // (2 * self.group_layers)) * 2 * self.group_layers]
        return self.read & (np.arange(self.n_slots)[None, :] < first_slot[:, None])

    def group_prefix_read(self, first_layer: int, n: int) -> np.ndarray:
        """`prefix_read` of the 2n sublayers of the group of n layers from `first_layer`, up to the
        last slot any of them reads: [2n, slots before the group that phase one reads]."""
        rows = self.prefix_read[2 * first_layer: 2 * (first_layer + n)]
        return rows[:, : int(rows.any(axis=0).nonzero()[0].max()) + 1]

    @property
    def intra_read(self) -> np.ndarray:
        """[2L, n_slots] the slots of `read` written inside sublayer j's group (block modes: the
        partial, where read; per-sublayer modes: the deltas of j's earlier group-mates)."""
        return self.read & ~self.prefix_read

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The store-once scan's segments: at most `scan_segments` runs of consecutive layers of
        near-equal length (block modes: whole blocks), each with the static number of slots its
        routers read (`Segment.n_read`; one segment: the whole buffer). Per-sublayer modes: a router of the segment reads up to
        2 x (its layers) - 1 slots beyond its own sources; block modes with one block a segment:
        exactly its own."""
        if not self.uses_sources:
            return (Segment(0, self.n_layers, 1, None),)
        unit = 1  # block modes: a block (its layers write one slot and read the same ones)
        if self.mode in BLOCK_MODES:
            unit = int((self.write == self.write[0]).sum()) // 2
        units = math.ceil(self.n_layers / unit)
        k = max(1, min(self.scan_segments, units))
        out, first = [], 0
        for i in range(k):  # near-equal runs of whole units; a short last block stays last
            n = min((units // k + (i < units % k)) * unit, self.n_layers - first)
            subs = slice(2 * first, 2 * (first + n))
            n_read = int(np.nonzero(self.read[subs].any(axis=0))[0].max()) + 1 if k > 1 else self.n_slots
            writes = np.unique(self.write[subs])
            out.append(Segment(first, n, n_read, int(writes[0]) if len(writes) == 1 else None))
            first += n
        return tuple(out)

    @property
    def uses_sources(self) -> bool:
        return self.mode != "baseline"

    @property
    def replaces_stream(self) -> bool:
        """Kimi modes: the routed value replaces the stream as the sublayer input."""
        return self.mode in REPLACEMENT_MODES


def row(table: np.ndarray, j, segment: Segment | None = None):
    """table[j] of a [2L, ...] table of the plan for sublayer j: a NumPy value (known when tracing, so
    that XLA folds the selects and fixes the slots it decides) where j is an int or the table is the
    same at every sublayer of `segment`, else the table indexed by the traced j."""
    if isinstance(j, (int, np.integer)):
        return table[j]
    if segment is not None:
        rows = table[2 * segment.first: 2 * (segment.first + segment.n_layers)]
        if (rows == rows[0]).all():
            return rows[0]
    return jnp.asarray(table)[j]


def n_blocks(n_layers: int, block_layers: int) -> int:
    return math.ceil(n_layers / block_layers)


def make_plan(mode: str, n_layers: int, block_layers: int = 1, include_partial: bool = True,
              group_layers: int = 1, scan_segments: int = 1) -> ResidualPlan:
    """The source table of docs/explanations/modes.md for one mode and depth. Routing groups: the largest
    divisor of `block_layers` (block modes: groups tile blocks, so a group's earlier sources are
    the completed blocks and its intra source the partial) or of `n_layers` (per-sublayer modes)
    up to `group_layers`; only a block mode's short last block may leave a shorter last group."""
    if mode not in MODES:
        raise ValueError(f"unknown residual mode {mode!r}; allowed: {', '.join(MODES)}")
    n_sub = 2 * n_layers
    if mode == "baseline":
        n_slots = 1
        read = np.zeros((n_sub, n_slots), bool)
        write = np.zeros(n_sub, np.int32)
    elif mode in BLOCK_MODES:
        n_slots = n_blocks(n_layers, block_layers) + 1
        read = np.zeros((n_sub, n_slots), bool)
        write = np.zeros(n_sub, np.int32)
        for j in range(n_sub):
            layer = j // 2
            block = layer // block_layers
            opens_block = j == 2 * block * block_layers
            read[j, : block + 1] = True
            if include_partial and not opens_block:
                read[j, block + 1] = True
            write[j] = block + 1
    else:
        n_slots = n_sub + 1
        read = np.tril(np.ones((n_sub, n_slots), bool))
        write = np.arange(1, n_sub + 1, dtype=np.int32)
    final_read = np.ones(n_slots, bool) if mode in REPLACEMENT_MODES else np.zeros(n_slots, bool)
    span = block_layers if mode in BLOCK_MODES else n_layers  # groups tile blocks, or the whole stack
    group = max(g for g in range(1, max(1, min(group_layers, span)) + 1) if span % g == 0)
    return ResidualPlan(mode, n_layers, n_slots, read, write, final_read, group, max(1, scan_segments))


def plan_for(model_cfg) -> ResidualPlan:
    res = model_cfg.residual
    return make_plan(res.mode, model_cfg.n_layers, res.block_layers, res.include_partial, max(1, res.group_layers),
                     res.scan_segments)


def two_phase(model_cfg) -> bool:
    """Whether a `config.model` trains with two-phase grouped routing: a routed mode with
    `residual.group_layers` > 0, its layers unrolled (plain autodiff, any remat) or scanned under
    remat (the store-once depth pass); phase one runs in `residual.impl` (XLA or the fused K-query
    kernel), the merges in XLA."""
    res = model_cfg.residual
    return (res.mode != "baseline" and (not model_cfg.scan_layers or model_cfg.remat != "none")
            and res.group_layers > 0)


__all__ = ["ResidualPlan", "Segment", "make_plan", "plan_for", "two_phase"]
