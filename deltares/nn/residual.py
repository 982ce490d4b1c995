"""The five residual modes as a static plan over a fixed-shape source buffer.

The model keeps its depth sources in one buffer of `n_slots` slots, each [B, T, D]. Its
sublayers are numbered j = 0 .. J-1 in depth order (J = 2L for L layers of attention and MLP;
a layer may have any number of sublayers, `layer_sublayers`):

- per-sublayer modes (`full_attnres`, `delta`): slot 0 holds the embedding e and
  slot j+1 the delta v_j of sublayer j, so sublayer j reads slots 0..j;
- block modes (`block_attnres`, `delta_block`): slot 0 holds e and slot n+1 the
  sum of the deltas of block n (`block_layers` whole layers), c_n, once the block is
  complete. Sublayer j of block n reads slots 0..n, plus the partial p_j (the block's
  deltas so far) in slot n+1 unless j opens the block (or `include_partial` is off); p_j is
  the stream minus the stream at the block's start (deltares.nn.depth), so it is read
  from the stream, never saved.

Every sublayer adds its delta into its `write` slot. Which slots each sublayer
reads is the table of docs/explanations/modes.md, fixed at trace time, so one scanned
layer body serves every depth.

A scan runs the layers in units of `unit_layers` consecutive layers (a repeating pattern of
layer kinds, scanned as one body; one layer by default): `n_units` whole units of `unit_size`
sublayers each, then, where the depth is not a whole number of units, one shorter unit of the
remaining layers (`tail_size` sublayers), run on its own. Unit u's sublayers are
j = unit_size * u + k, the remainder's included.

Two-phase grouped routing (docs/explanations/store-once.md) splits each sublayer's sources at
its group's start: the slots completed before the group (`prefix_read`), routed
for all the group's sublayers in one pass, and the few written inside the group
(`intra_read`), merged per sublayer. A group is `group_layers` consecutive units
(at most; a divisor of the block in the block modes, whose only intra source is then
the partial, and of the whole units in the per-sublayer modes); a remainder unit routes
one pass per sublayer.

The other depth-mixing families (deltares.nn.mixing) use the same table for their statistics: in
`hyper` and `mhc` the slots are the R parallel streams, every sublayer reading all of them; in
`denseformer` slot l holds layer l's output X_l (slot 0 the embedding), and the last sublayer of
each averaging layer reads the outputs its average weighs.

The store-once scan runs in segments (`ResidualPlan.segments`): consecutive units whose
routers read a static prefix of the buffer, the slots any of them reads. A scanned router
then reads the slots written so far (up to a segment's few), not all n_slots.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np

from deltares.nn.config import BLOCK_MODES, HYPER_MODES, MODES, REPLACEMENT_MODES, ROUTING_MODES


@dataclasses.dataclass(frozen=True)
class Segment:
    """Units [first, first + n_units) of the store-once scan, sublayers [first_sublayer,
    first_sublayer + n_sublayers): their routers read slots 0..n_read - 1; `write`: the one slot
    they all write (a block), else None. `tail`: the remainder unit (run on its own, not scanned).
    `block_start`: block modes, the forward pass saves each unit's block start h_block (its block
    may open before the segment, or inside a unit), else it is the saved stream of the unit that
    opened the block."""

    first: int
    n_units: int
    n_read: int
    write: int | None
    first_sublayer: int = 0
    n_sublayers: int = 0
    tail: bool = False
    block_start: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class ResidualPlan:
    mode: str
    n_layers: int
    n_slots: int
    read: np.ndarray  # [J, n_slots] bool: slots sublayer j routes over
    write: np.ndarray  # [J] int: slot that receives sublayer j's delta
    final_read: np.ndarray  # [n_slots] bool: slots of the Kimi modes' output routing
    group_layers: int = 1  # units per two-phase routing group (a divisor of the block in the block modes)
    scan_segments: int = 1  # at most this many segments of the store-once scan (`segments`)
    layer_sublayers: tuple = ()  # sublayers of each layer (default: 2 each)
    unit_layers: int = 1  # layers per scanned unit (a layer pattern's length)

    def __post_init__(self):
        if not self.layer_sublayers:
            object.__setattr__(self, "layer_sublayers", (2,) * self.n_layers)

    @property
    def n_sublayers(self) -> int:
        """J: the stack's sublayers."""
        return len(self.write)

    @property
    def layer_first(self) -> np.ndarray:
        """[L + 1] the first sublayer of each layer (and J)."""
        return np.r_[0, np.cumsum(self.layer_sublayers)].astype(np.int32)

    @property
    def unit_size(self) -> int:
        """Sublayers of one whole unit (`unit_layers` layers)."""
        return int(sum(self.layer_sublayers[: self.unit_layers]))

    @property
    def n_units(self) -> int:
        """Whole units: the scanned ones."""
        return self.n_layers // self.unit_layers

    @property
    def tail_size(self) -> int:
        """Sublayers of the remainder unit (0: none)."""
        return self.n_sublayers - self.n_units * self.unit_size

    def unit_sublayers(self, unit) -> int:
        """Sublayers of unit `unit` (the remainder's where it is `n_units`)."""
        return self.tail_size if isinstance(unit, (int, np.integer)) and unit == self.n_units else self.unit_size

    @property
    def n_sources(self) -> np.ndarray:
        """[J] number of sources each sublayer sees (0 in baseline)."""
        return self.read.sum(axis=1).astype(np.int32)

    @property
    def routed(self) -> np.ndarray:
        """[J] whether sublayer j routes: more than one source (softmax over one is constant)."""
        return self.n_sources > 1

    @property
    def opens_block(self) -> np.ndarray:
        """[J] block modes: sublayer j is its block's first (it starts a new partial)."""
        return np.r_[True, self.write[1:] != self.write[:-1]] & (self.mode in BLOCK_MODES)

    @property
    def closes_block(self) -> np.ndarray:
        """[J] block modes: sublayer j is its block's last (its write completes the block's slot)."""
        return np.r_[self.write[1:] != self.write[:-1], True] & (self.mode in BLOCK_MODES)

    @property
    def unit_first(self) -> np.ndarray:
        """[J] whether sublayer j is its unit's first."""
        first = np.zeros(self.n_sublayers, bool)
        first[:: self.unit_size] = True
        first[self.n_units * self.unit_size:] = False
        if self.tail_size:
            first[self.n_units * self.unit_size] = True
        return first

    @property
    def blocks_align(self) -> bool:
        """Block modes: every block opens at a unit's first sublayer (always, with one-layer units)."""
        return bool(np.all(self.unit_first[self.opens_block]))

    @property
    def block_start_unit(self) -> np.ndarray:
        """[units] the unit whose first sublayer opened the block of each unit's first sublayer (block
        modes with `blocks_align`; each unit its own otherwise)."""
        n = self.n_units + (self.tail_size > 0)
        if self.mode not in BLOCK_MODES:
            return np.arange(n, dtype=np.int32)
        first_sublayer = np.maximum.accumulate(np.where(self.opens_block, np.arange(self.n_sublayers), 0))
        return (first_sublayer[np.arange(n) * self.unit_size] // self.unit_size).astype(np.int32)

    @property
    def group_first(self) -> np.ndarray:
        """[J] the first sublayer of sublayer j's two-phase group (groups of `group_layers` whole
        units; the remainder unit is a group of its own)."""
        span = self.unit_size * self.group_layers
        first = (np.arange(self.n_sublayers) // span) * span
        first[self.n_units * self.unit_size:] = self.n_units * self.unit_size
        return first

    @property
    def prefix_read(self) -> np.ndarray:
        """[J, n_slots] the slots of `read` completed before sublayer j's group: every slot below
        the group's first write slot (block modes: the completed blocks and e)."""
        first_slot = self.write[self.group_first]
        return self.read & (np.arange(self.n_slots)[None, :] < first_slot[:, None])

    def group_prefix_read(self, first_unit: int, n: int) -> np.ndarray:
        """`prefix_read` of the sublayers of the group of n units from `first_unit`, up to the
        last slot any of them reads: [group's sublayers, slots before the group that phase one reads]."""
        P = self.unit_size
        rows = self.prefix_read[P * first_unit: min(P * (first_unit + n), self.n_sublayers)]
        return rows[:, : int(rows.any(axis=0).nonzero()[0].max()) + 1]

    @property
    def intra_read(self) -> np.ndarray:
        """[J, n_slots] the slots of `read` written inside sublayer j's group (block modes: the
        partial, where read; per-sublayer modes: the deltas of j's earlier group-mates)."""
        return self.read & ~self.prefix_read

    @property
    def groups_tile_blocks(self) -> bool:
        """Whether two-phase groups can run: in the block modes no block may open inside a unit
        (blocks of whole units; the per-sublayer modes always can)."""
        return self.mode not in BLOCK_MODES or self.blocks_align

    @functools.cached_property
    def segments(self) -> tuple[Segment, ...]:
        """The store-once scan's segments: at most `scan_segments` runs of consecutive whole units of
        near-equal length (block modes whose blocks are whole units: whole blocks), each with the static
        number of slots its routers read (`Segment.n_read`; one segment: the whole buffer), then the
        remainder unit, a segment of its own. Per-sublayer modes: a router of the segment reads up to
        2 x (its layers) - 1 slots beyond its own sources; block modes with one block a segment:
        exactly its own."""
        P = self.unit_size
        tail = ()
        if self.tail_size:
            tail = (Segment(self.n_units, 1, self.n_slots, None, self.n_units * P, self.tail_size, True,
                            self.mode in BLOCK_MODES),)
        if not self.uses_sources:
            return (Segment(0, self.n_units, 1, None, 0, self.n_units * P),) + tuple(
                dataclasses.replace(t, n_read=1, block_start=False) for t in tail)
        unit = 1  # block modes: a block of whole units (its units write one slot and read the same ones)
        aligned = self.blocks_align
        if self.mode in BLOCK_MODES and aligned:
            unit = max(1, int((self.write[: self.n_units * P] == self.write[0]).sum()) // P)
        units = math.ceil(self.n_units / unit)
        k = max(1, min(self.scan_segments, units))
        out, first = [], 0
        for i in range(k):  # near-equal runs of whole units; a short last block stays last
            n = min((units // k + (i < units % k)) * unit, self.n_units - first)
            subs = slice(P * first, P * (first + n))
            n_read = int(np.nonzero(self.read[subs].any(axis=0))[0].max()) + 1 if k > 1 else self.n_slots
            writes = np.unique(self.write[subs])
            out.append(Segment(first, n, n_read, int(writes[0]) if len(writes) == 1 else None, P * first, P * n,
                               False, self.mode in BLOCK_MODES and not aligned))
            first += n
        return tuple(out) + tail

    @property
    def uses_sources(self) -> bool:
        """Whether the sublayers route over the source buffer (the four routing modes)."""
        return self.mode in ROUTING_MODES and self.mode != "baseline"

    @property
    def layer_last(self) -> np.ndarray:
        """[J] whether sublayer j is its layer's last."""
        last = np.zeros(self.n_sublayers, bool)
        last[self.layer_first[1:] - 1] = True
        return last

    @property
    def replaces_stream(self) -> bool:
        """Kimi modes: the routed value replaces the stream as the sublayer input."""
        return self.mode in REPLACEMENT_MODES


def row(table: np.ndarray, j, segment: Segment | None = None):
    """table[j] of a [J, ...] table of the plan for sublayer j: a NumPy value (known when tracing, so
    that XLA folds the selects and fixes the slots it decides) where j is an int or the table is the
    same at every sublayer of `segment`, else the table indexed by the traced j."""
    if isinstance(j, (int, np.integer)):
        return table[j]
    if segment is not None:
        rows = table[segment.first_sublayer: segment.first_sublayer + segment.n_sublayers]
        if (rows == rows[0]).all():
            return rows[0]
    return jnp.asarray(table)[j]


def n_blocks(n_layers: int, block_layers: int) -> int:
    return math.ceil(n_layers / block_layers)


def make_plan(mode: str, n_layers: int, block_layers: int = 1, include_partial: bool = True,
              group_layers: int = 1, scan_segments: int = 1, layer_sublayers=None,
              unit_layers: int = 1, streams: int = 4, dilation: int = 1, period: int = 1) -> ResidualPlan:
    """The source table of docs/explanations/modes.md for one mode and depth. `layer_sublayers`:
    the sublayers of each layer (default 2 each: attention, MLP); `unit_layers`: layers per scanned
    unit (module doc). Routing groups, in units: the largest divisor of the block's units (block
    modes: groups tile blocks, so a group's earlier sources are the completed blocks and its intra
    source the partial) or of the whole units (per-sublayer modes) up to `group_layers`; only a block
    mode's short last block may leave a shorter last group. `streams`: hyper and mhc's R;
    `dilation`, `period`: denseformer's (`deltares.nn.mixing.dwa_tables`)."""
    if mode not in MODES:
        raise ValueError(f"unknown residual mode {mode!r}; allowed: {', '.join(MODES)}")
    layer_sublayers = (2,) * n_layers if layer_sublayers is None else tuple(int(n) for n in layer_sublayers)
    if len(layer_sublayers) != n_layers or min(layer_sublayers) < 1:
        raise ValueError(f"layer_sublayers={layer_sublayers!r}: one count of at least 1 per layer ({n_layers})")
    layer_of = np.repeat(np.arange(n_layers), layer_sublayers)
    n_sub = len(layer_of)
    if mode in HYPER_MODES:
        n_slots = streams
        read = np.ones((n_sub, n_slots), bool)
        write = np.zeros(n_sub, np.int32)
    elif mode == "denseformer":
        from deltares.nn.mixing import dwa_tables  # noqa: PLC0415 - mixing imports the routing math, not plans

        n_slots = n_layers + 1
        valid, applies = dwa_tables(n_layers, dilation, period)
        last = np.r_[np.cumsum(layer_sublayers)] - 1
        read = np.zeros((n_sub, n_slots), bool)
        read[last] = valid & applies[:, None]
        write = (layer_of + 1).astype(np.int32)
    elif mode == "baseline":
        n_slots = 1
        read = np.zeros((n_sub, n_slots), bool)
        write = np.zeros(n_sub, np.int32)
    elif mode in BLOCK_MODES:
        n_slots = n_blocks(n_layers, block_layers) + 1
        read = np.zeros((n_sub, n_slots), bool)
        write = np.zeros(n_sub, np.int32)
        first_of_layer = np.r_[0, np.cumsum(layer_sublayers)]
        for j in range(n_sub):
            block = layer_of[j] // block_layers
            opens_block = j == first_of_layer[block * block_layers]
            read[j, : block + 1] = True
            if include_partial and not opens_block:
                read[j, block + 1] = True
            write[j] = block + 1
    else:
        n_slots = n_sub + 1
        read = np.tril(np.ones((n_sub, n_slots), bool))
        write = np.arange(1, n_sub + 1, dtype=np.int32)
    final_read = np.ones(n_slots, bool) if mode in REPLACEMENT_MODES else np.zeros(n_slots, bool)
    n_units = n_layers // unit_layers
    if mode in BLOCK_MODES:  # groups tile blocks (of whole units, where they are)
        span = block_layers // unit_layers if block_layers % unit_layers == 0 else 1
    else:
        span = n_units
    group = max(g for g in range(1, max(1, min(group_layers, span)) + 1) if span % g == 0)
    return ResidualPlan(mode, n_layers, n_slots, read, write, final_read, group, max(1, scan_segments),
                        layer_sublayers, unit_layers)


def plan_for(model_cfg) -> ResidualPlan:
    res = model_cfg.residual
    return make_plan(res.mode, model_cfg.n_layers, res.block_layers, res.include_partial, max(1, res.group_layers),
                     res.scan_segments, streams=res.streams, dilation=res.dilation, period=res.period)


def two_phase(model_cfg) -> bool:
    """Whether a `config.model` trains with two-phase grouped routing: a routed mode with
    `residual.group_layers` > 0, its layers unrolled (plain autodiff, any remat) or scanned under
    remat (the store-once depth pass); phase one runs in `residual.impl` (XLA or the fused K-query
    kernel), the merges in XLA."""
    res = model_cfg.residual
    return (res.mode != "baseline" and (not model_cfg.scan_layers or model_cfg.remat != "none")
            and res.group_layers > 0)


__all__ = ["ResidualPlan", "Segment", "make_plan", "plan_for", "two_phase"]
