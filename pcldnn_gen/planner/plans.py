"""The planner's output, the contract with the templates: one frozen, keyword-only dataclass per
kernel family, one named field per decision. Templates read these fields and nothing else
decides; numbers stay numbers (codegen formats C literals)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pcldnn_runtime.families import Engine, Kind, kind_named

from .tiles import RegisterTile, RowCover


@dataclass(frozen=True, kw_only=True)
class TileTiming:
    """One candidate register tile as the tuner measured it."""
    width: int
    vectors: int
    predicted_efficiency: float     # the model's figure for this tile
    ms: float                       # median kernel time at the tuning minibatch


@dataclass(frozen=True, kw_only=True)
class Measured:
    """Why a plan's tile is what it is when the tuning database chose it (`pcldnn-gen tune`):
    the model's first choice and every candidate's measured time, best first."""
    model: tuple[int, int]          # (width, vectors) the model ranked first
    batch: int
    threads: int
    peak_gflops: float              # the FMA peak measured in the same tuning run
    flops: int                      # nominal FLOPs of one call at `batch`
    timings: tuple[TileTiming, ...]

    def percent_of_peak(self, t: TileTiming) -> float:
        return self.flops / (t.ms * 1e-3) / 1e9 / self.peak_gflops


@dataclass(frozen=True, kw_only=True)
class Fusion:
    """Another layer's work this kernel does too (runtime/families/fusion.py): `statistics`, a
    convolution's forward computing its batchnorm reader's batch statistics; `residual`, a
    batchnorm's passes computing its add reader's sum with the add's other input and, where
    `activation`, the add's activation (forward) and its mask (backward)."""
    kind: str                       # "statistics" or "residual"
    layer: str                      # the other layer
    activation: str | None = None   # residual: the add's activation (one that fuses into an add: a ReLU)

    def describe(self) -> str:
        if self.kind == "statistics":
            return (f"computes the batch statistics of {self.layer} (per-channel mean and variance of each block "
                    "of output rows, while it is in cache)")
        act = f", {'ReLU' if self.activation == 'relu' else self.activation} included" if self.activation else ""
        return (f"computes {self.layer} (the residual add{act}): "
                f"out = {self.activation or ''}(bn(x) + shortcut)")


@dataclass(frozen=True, kw_only=True)
class KernelPlan:
    """A memory-bound kernel (pooling, elementwise, loss) and the fields every plan has."""
    layer: str
    pass_name: str
    kind: str                       # <layer type>_<pass>, e.g. conv_fwd, fc_bwd_weights, maxpool_bwd_data
    template: str                   # the template file that renders it
    isa: str
    vector_floats: int
    reason: str                     # the balance figures behind the choice, for the C header and `inspect`
    tile: RegisterTile | None = None
    tile_widths: tuple[int, ...] = ()   # widths of the tile functions emitted, widest first
    remainders: tuple[int, ...] = ()    # the narrower ones among them, for the header
    predicted_efficiency: float = 0.0   # register-level model, averaged over full, remainder and border tiles
    l1_working_set: int = 0         # bytes of the operand a tile streams per reduction chunk
    l2_bytes_per_flop: float = 0.0  # bytes brought into L1 per FLOP
    scratch_floats: int = 0         # scratch the runtime passes in (conv bwd_data: transposed weights)
    rejected: tuple[RegisterTile, ...] = ()  # the next-best candidates, for `inspect`
    measured: Measured | None = None    # set when the tuning database chose the tile
    # (input, output) activations stored as bf16 (families.bf16_outputs): read and written as such
    activations: tuple[bool, bool] = (False, False)
    # (input, output) gradients dx, dy stored as bf16 (families.bf16_gradients): backward passes only
    gradients: tuple[bool, bool] = (False, False)
    fusion: Fusion | None = None    # another layer's work this kernel does too (families.fusion)

    def reduction_chunk(self) -> str:
        """The reduction chunk with its unit, for the header; empty when the kernel has none."""
        return ""

    def blocks_summary(self) -> str:
        """The blocks line of the header for a kernel without a register tile ("" for none)."""
        return ""

    @property
    def kernel_kind(self) -> Kind:
        """The typed kind (families.Kind) behind `kind`, the name builds record."""
        kind = kind_named(self.kind)
        assert kind is not None, self.kind
        return kind

    @property
    def engine(self) -> Engine:
        """What computes its dot products: fp32 FMAs, vdpbf16ps or AMX tiles."""
        return self.kernel_kind.engine

    @property
    def candidate_tiles(self) -> tuple[RegisterTile, ...]:
        """The model's ranking, its choice first: the tiles the tuner may time instead."""
        return () if self.tile is None else (self.tile, *self.rejected)

    def blocks(self) -> dict[str, Any]:
        """The family's own scalar decisions (the tables stay in the C)."""
        base = {f.name for f in fields(KernelPlan)}
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in base and isinstance(getattr(self, f.name), (int, float, bool))}

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {k: getattr(self, k) for k in (
            "layer", "pass_name", "kind", "template", "isa", "vector_floats", "l1_working_set", "scratch_floats",
            "reason")}
        d["reduction_chunk"] = self.reduction_chunk()
        d["blocks"] = self.blocks()
        d["tile_widths"] = list(self.tile_widths)
        d["remainders"] = list(self.remainders)
        d["tile"] = None if self.tile is None else {
            "width": self.tile.width, "vectors": self.tile.vectors, "registers": self.tile.registers,
            "loads_per_fma": round(self.tile.loads_per_fma, 4), "efficiency": round(self.tile.efficiency, 4)}
        d["predicted_efficiency"] = round(self.predicted_efficiency, 4)
        d["l2_bytes_per_flop"] = round(self.l2_bytes_per_flop, 5)
        if self.fusion is not None:
            d["fusion"] = {"kind": self.fusion.kind, "layer": self.fusion.layer, "activation": self.fusion.activation}
        if self.measured is not None:
            d["tuned"] = {"model_tile": list(self.measured.model), "batch": self.measured.batch,
                          "threads": self.measured.threads,
                          "ms": {f"{t.width}x{t.vectors}": round(t.ms, 4) for t in self.measured.timings}}
        return d


@dataclass(frozen=True, kw_only=True)
class DropoutPlan(KernelPlan):
    keep_threshold: int             # an element is kept when its 32-bit hash is at least this
    scale: float                    # 1 / (1 - rate): the expected activation is unchanged
    hash_step: int                  # the counter stride of the hash; the runtime shifts seeds by multiples of it


@dataclass(frozen=True, kw_only=True)
class ConvFwdPlan(KernelPlan):
    ifm_chunk: int                  # input-channel blocks per reduction chunk (the L1 weight slice)
    rows: int                       # output rows that share one chunk's weight slice in L1
    ow_lo: int                      # first output column whose window needs no left padding
    ow_hi: int                      # one past the last column whose window needs no right padding
    cover: RowCover                 # how a row of output columns is tiled
    prefetch_inputs: bool           # 1x1: inputs streamed, the next tile's prefetched into L2
    images_inner: bool              # loop over oc-vector groups outside the images (weights beyond L2)
    plane_as_row: bool = False      # planned and generated with the H x W plane as one row (conv.plane_as_row)

    def reduction_chunk(self) -> str:
        return f"{self.ifm_chunk} input-channel blocks"


@dataclass(frozen=True, kw_only=True)
class AmxConvPlan(KernelPlan):
    chunk: int                      # 32-channel source blocks per reduction chunk (A rows and B tiles in L1)
    band: int                       # pixel blocks per band: the chunk's input rows reused across oc blocks
    store_delay: int                # steps into the next item before the previous item's tiles are stored
    direct: bool = False            # A tiles read straight from the bf16 source, 16 channels a step (no copy)
    result_blocks_inner: bool = False  # a pixel block runs every result block in turn (its A rows in L1)

    def reduction_chunk(self) -> str:
        return "every 16-channel source block" if self.direct else f"{self.chunk} x 32 source channels"

    def blocks_summary(self) -> str:
        if self.direct:
            return ("AMX tiles: 32 result pixels x 16 result channels per work item (2 C tiles, 2 A of 16 pixels x "
                    "16 source channels read in place, 1 B; the other 2 C tiles drain the previous item), "
                    "reduction over every 16-channel source block, a unit's result blocks in turn")
        return (f"AMX tiles: 32 result pixels x 16 result channels per work item (2 C tiles, "
                f"2 A, 1 B; the other 2 C tiles drain the previous item), reduction chunk "
                f"{self.reduction_chunk()}, bands of {self.band} pixel blocks")


@dataclass(frozen=True, kw_only=True)
class AmxConvBwdWeightsPlan(KernelPlan):
    pixel_blocks: int               # (image, 32-pixel block) units one residency of an item's accumulators reduces
    copy_units: int = 0             # units whose dy and x copies are made together, in L2 (0: the minibatch's, first)

    def blocks_summary(self) -> str:
        return (f"AMX tiles: 4 C tiles (2 output x 2 input channel blocks, one tap) per work item, "
                f"2 A (16 output channels x 32 flat pixels of dy), 2 B (32 pixels x 16 input channels of x); "
                f"{'copies per span of' if self.copy_units else 'groups of'} {self.pixel_blocks} pixel blocks")


@dataclass(frozen=True, kw_only=True)
class AmxPackedConvPlan(KernelPlan):
    """A first layer's packed few-channel input on tiles: forward, kernel rows read in place from
    a padded bf16 copy of the image where its weight tiles stay in L1, else (and backward-weights)
    im2col rows of KP values a pixel."""
    reduction: int                  # values a pixel's reduction runs over: in place KH x (KW x C padded to 32), else KP
    pixel_blocks: int               # backward-weights: (image, 32-pixel block) units a residency of the accumulators reduces
    in_place: bool = False          # forward: A tiles read from a padded copy of the image (else im2col rows)
    pieces: int = 1                 # backward-data: 16-pixel pieces of a dy row whose C tiles accumulate together
    column_group: int = 1           # backward-data: 16-value blocks of a run each piece's C tiles hold at once

    def blocks_summary(self) -> str:
        if self.pass_name == "fwd":
            a = "16 pixels of an output row x 32 values of a kernel row, read in place" if self.in_place else \
                "16 pixels x 32 window values of their im2col rows"
            return (f"AMX tiles: 32 output pixels x 32 output channels per work item (4 C tiles, 2 A of {a}, 2 B), "
                    f"reduction {self.reduction} values")
        if self.pass_name == "bwd_data":
            return (f"AMX tiles: per dx row, {self.pieces} piece(s) of 16 dy pixels x {self.column_group} block(s) of 16 "
                    f"values of their kernel-row runs ({self.pieces * self.column_group} C tiles; A: 16 pixels x 32 "
                    f"channels of dy, read in place), reduction {self.reduction} channels x the kernel rows reaching "
                    "the row")
        return (f"AMX tiles: 32 output channels x 32 window values per work item (4 C tiles, 2 A of 16 output "
                f"channels x 32 pixels of dy, 2 B of 32 pixels x 16 window values), groups of {self.pixel_blocks} "
                f"pixel blocks")


@dataclass(frozen=True, kw_only=True)
class PackedConvBf16Plan(KernelPlan):
    """A first layer's packed few-channel input on vdpbf16ps register tiles. Forward: a kernel
    row's KW x C window values, contiguous in a padded bf16 copy of the image, taken in pairs
    (tile: output pixels of one row x output-channel vectors). Backward-weights: pairs of
    neighbouring output pixels (tile: consecutive values of a kernel row's window x
    output-channel vectors), over bands of output rows whose pair copies stay in L2."""
    pairs: int = 0                  # forward: bf16 pairs a kernel row's window takes, ceil(KW x C / 2)
    band_rows: int = 0              # backward-weights: output rows of an image a band pairs at once

    def reduction_chunk(self) -> str:
        if self.pass_name == "fwd":
            return f"the whole window ({self.pairs} pairs of values a kernel row)"
        return f"bands of {self.band_rows} output rows of an image (pixel pairs)"


@dataclass(frozen=True, kw_only=True)
class FcTilePlan(KernelPlan):
    """fc forward and backward-data on bf16 weight tiles (AMX or vdpbf16ps): the same GEMM, result
    rows = images."""
    source_bytes: int               # a reduction chunk's bf16 source rows (the whole minibatch) fit this
    column_blocks: int              # 16-column result blocks of a work item (AMX: 2, one per B tile)
    max_chunk: int                  # vdpbf16ps: reduction values a chunk may hold, so a column group's weights of it
                                    # stay in L2 for every 8 images (0: no such bound, AMX)

    def reduction_chunk(self) -> str:
        reduced = "inputs" if self.pass_name == "fwd" else "output features"
        return f"{reduced} whose bf16 source rows fit {self.source_bytes // 1024} KiB at the call's minibatch"

    def blocks_summary(self) -> str:
        result, reduced = ("features", "inputs") if self.pass_name == "fwd" else ("inputs", "features")
        if self.engine is Engine.AMX:
            return (f"32 images x 32 {result} per work item (4 C tiles, 2 A of 16 images x 32 {reduced}, 2 B of 32 "
                    f"{reduced} x 16 {result}), reduction chunk: {self.reduction_chunk()}")
        return (f"8 images x {16 * self.column_blocks} {result} per work item (a register tile of 8 images x "
                f"{self.column_blocks} vectors, vdpbf16ps), reduction chunk: {self.reduction_chunk()}, at most "
                f"{self.max_chunk} values (a group's weights of it in L2)")


@dataclass(frozen=True, kw_only=True)
class FcTileBwdWeightsPlan(KernelPlan):
    dy_bytes: int                   # bytes of dy pair copies a chunk of output blocks may hold (in L2)
    column_blocks: int              # 16-feature blocks of dW a work item computes (AMX: 2, one per B tile)

    def blocks_summary(self) -> str:
        how = ("4 C tiles, 2 A of 16 inputs x 32 images, 2 B of 32 images x 16 features"
               if self.engine is Engine.AMX else f"4 register tiles of 8 inputs x {self.column_blocks} vectors in turn, "
               "vdpbf16ps")
        return (f"32 inputs x {16 * self.column_blocks} features of dW per work item ({how}), streamed into dW; output "
                f"blocks in chunks whose dy pairs fit {self.dy_bytes // 1024} KiB")


@dataclass(frozen=True, kw_only=True)
class BwdDataPhase:
    """Input columns r + q*SW, q in [0, q_count), of one stride phase r: all receive gradient
    from kernel columns kw_first, kw_first + SW, ..., from output column q + d, d starting at
    d_first and dropping by one per kernel column. Columns q in [q_lo, q_hi) need no bounds."""
    r: int
    q_count: int
    kw_first: int
    d_first: int
    q_lo: int
    q_hi: int
    cover: RowCover | None = None   # the general kernel's tiling of the phase; None in the few-channel one


@dataclass(frozen=True, kw_only=True)
class ConvBwdDataPlan(KernelPlan):
    ofm_chunk: int                  # output-channel blocks per reduction chunk (the L1 weight slice)
    rows: int                       # input rows that reuse one chunk's weight slice from L1
    few_channels: bool              # fewer input channels than a vector: vectors run over output channels
    images_inner: bool              # loop over ic-vector groups outside the images (weights beyond L2)
    phases: tuple[BwdDataPhase, ...]
    rem_vectors: int = 0            # ic vectors of the last, narrower group (0: none)
    plane_as_row: bool = False      # planned and generated with the H x W plane as one row (conv.plane_as_row)

    @property
    def vector_counts(self) -> tuple[int, ...]:
        """ic-vector counts of the tiles emitted: the full group, then the last if narrower."""
        assert self.tile is not None
        return (self.tile.vectors, *((self.rem_vectors,) if self.rem_vectors else ()))

    def reduction_chunk(self) -> str:
        return f"{self.ofm_chunk} output-channel blocks x {self.rows} input rows"


@dataclass(frozen=True, kw_only=True)
class ConvBwdWeightsPlan(KernelPlan):
    block_rows: int                 # output rows per pixel block
    block_cols: int                 # output columns per pixel block
    lanes: int                      # input-channel lanes with data (the rest are padding)
    rem_vectors: int                # oc vectors of the last, narrower group (0: none)
    kw_taps: int                    # kernel columns per tile (> 1 only with fewer channels than a vector)
    rem_taps: int                   # kernel columns of the last, narrower tap group (0: none)
    oh_range: tuple[tuple[int, int], ...]   # per kernel row: output rows [lo, hi) that read inside the input
    ow_range: tuple[tuple[int, int], ...]   # per kernel column: the same for output columns
    prefetch_block: bool = False    # 1x1: the next pixel block's inputs and gradients prefetched into L2
    band_images: int = 1            # whole images a pixel block spans (block = the plane), on small planes

    @property
    def vector_counts(self) -> tuple[int, ...]:
        """oc-vector counts of the tiles emitted: the full group, then the last if narrower."""
        assert self.tile is not None
        return (self.tile.vectors, *((self.rem_vectors,) if self.rem_vectors else ()))

    @property
    def tap_counts(self) -> tuple[int, ...]:
        """Kernel-column counts of the tiles emitted: the full tap group, then the last if narrower."""
        return (self.kw_taps, *((self.rem_taps,) if self.rem_taps else ()))

    @property
    def tile_variants(self) -> tuple[tuple[int, int, bool, bool], ...]:
        """(taps, vectors, in the last oc group, in the last tap group) of every tile the
        kernel calls, the narrowest first: the order of its dispatch."""
        return tuple((kt, nv, nv != self.vector_counts[0], kt != self.kw_taps)
                     for nv in reversed(self.vector_counts) for kt in reversed(self.tap_counts))

    def reduction_chunk(self) -> str:
        return f"{self.block_rows} output rows"


@dataclass(frozen=True, kw_only=True)
class FcFwdPlan(KernelPlan):
    k_chunk: int                    # K elements per chunk (the group's weight panel in L2)
    rem_vectors: int                # output vectors of the last group of the whole layer (0: none)

    @property
    def vector_counts(self) -> tuple[int, ...]:
        """Every output-vector count up to the tile's, widest first: the output slice
        [ocb_lo, ocb_hi) is a run-time argument (a model-parallel rank's share), so any
        narrower last group can occur."""
        assert self.tile is not None
        return tuple(range(self.tile.vectors, 0, -1))

    def reduction_chunk(self) -> str:
        return f"{self.k_chunk} K elements"


@dataclass(frozen=True, kw_only=True)
class FcBwdDataPlan(KernelPlan):
    ofm_chunk: int                  # output-feature blocks per reduction chunk
    k_block: int                    # input features per transposed panel (a multiple of the tile's)
    rem_vectors: int                # input-feature vectors of the layer's last k tile (0: all whole)

    @property
    def vector_counts(self) -> tuple[int, ...]:
        """The tile's vector count and the narrower last tile's, if any (K is fixed: no slice)."""
        assert self.tile is not None
        return (self.tile.vectors, *((self.rem_vectors,) if self.rem_vectors else ()))

    def reduction_chunk(self) -> str:
        return f"{self.ofm_chunk} output-feature blocks"


@dataclass(frozen=True, kw_only=True)
class FcBwdWeightsPlan(KernelPlan):
    k_chunk: int                    # K elements packed per chunk (panels in L2)
    rem_features: int               # features of the last, narrower panel (0: none)
    rem_vectors: int                # output vectors of the last group (0: none)

    @property
    def vector_counts(self) -> tuple[int, ...]:
        """Every output-vector count up to the tile's, widest first (the output slice is a
        run-time argument, as in FcFwdPlan); the panel widths are `tile_widths`."""
        assert self.tile is not None
        return tuple(range(self.tile.vectors, 0, -1))

    def reduction_chunk(self) -> str:
        return f"{self.k_chunk} K elements"


__all__ = [
    "BwdDataPhase",
    "ConvBwdDataPlan",
    "ConvBwdWeightsPlan",
    "ConvFwdPlan",
    "DropoutPlan",
    "FcBwdDataPlan",
    "FcBwdWeightsPlan",
    "FcFwdPlan",
    "KernelPlan",
    "Measured",
    "RowCover",
    "TileTiming",
]
