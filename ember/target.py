"""The target: one frozen record of what the device and the code generator can do.

The backend makes it from the device (backends/triton.py, backends/cpp.py: `Backend.target()`),
the pipeline reads it once per graph, and every pass that depends on the target takes it:
`split_reductions(graph, target)`, `schedule(graph, ..., target=...)`, `launch_config(kernel,
target)`. No pass asks which backend it runs for: it reads what the target renders
(`online_softmax`, `column_partials`) and its heuristics.

`Heuristics` holds the size thresholds and launch tables as data. A sweep or a test changes
them with `dataclasses.replace`, or for a whole compile with the scoped setting `heuristics`
(`EMBER_HEURISTICS="split.max_second_split=8"`, `config.override(heuristics=...)`), which
the backends apply through `Target.tuned`; never by assigning a module attribute.

`Target.key()` is what a cached thing made for this target depends on (runtime/cache.py's
`content_key(..., target=...)`): everything but the device's display name and its measured
limits, which vary from run to run and only inform reports and the GEMM choice.

This module is a leaf: it imports nothing of ember's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass, field, fields, replace

# The CPU interpreter has no SMs. It is given an H100's count, the GPU the heuristics were tuned
# on, so that the tests on the CPU split, schedule and tile kernels as that GPU would.
INTERPRETER_SM_COUNT = 132


@dataclass(frozen=True)
class Tile:
    """A reduction's tile: XBLOCK outputs by RBLOCK elements a step, and the warps of a program.
    Written `XxRxW` in the `heuristics` setting (`launch.column_one_sum=64x8x4`)."""

    xblock: int
    rblock: int
    warps: int

    @classmethod
    def parse(cls, text: str) -> Tile:
        """`XxRxW`, each a power of two (Triton's blocks and warps are)."""
        parts = text.lower().split("x")
        if len(parts) != 3 or not all(p.strip().isdigit() and _power_of_two(int(p)) for p in parts):
            raise ValueError
        return cls(*(int(p) for p in parts))


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class SplitHeuristics:
    """When schedule/split.py splits a reduction into two stages, and into how many chunks."""

    # Split a reduction with fewer outputs than this ...
    max_outputs: int = 8192
    # ... and at least this many elements per output; each chunk keeps at least min_chunk.
    min_reduce: int = 4096
    min_chunk: int = 256
    # ... or at least this many for a column sum on a target with row programs (two chunks).
    min_column_reduce: int = 512
    # A length whose power-of-two factor gives at least 1/max_shortfall of the chunks wanted splits
    # by that factor (a plain reshape); else into overlapping chunks of the length wanted.
    max_shortfall: int = 4
    # About this many partial results in the first stage. More programs in flight, each walking
    # fewer rows, pay off where every program is a short kernel of its own (a GPU's).
    partials: int = 32768
    # Chunks of a column sum that a row kernel accumulates (kernel.KColumnPartial): a few row
    # blocks per program at least, and few enough rows that the programs fill the machine.
    min_column_chunk: int = 16
    max_column_chunk: int = 256
    # Columns one program of a GPU column sum covers (launch.column_* tiles are this wide).
    columns_per_program: int = 32
    # A column sum whose leading reduced dim is split whole, leaving at most one program per SM,
    # may split its next reduced dim into this many chunks too (1: never). Off by default: in
    # ResNet-50's training step the extra partials raised the backward's planned peak above
    # eager's, and the sibling merges given up to bring it down cost more than the split saved.
    max_second_split: int = 1


@dataclass(frozen=True)
class LaunchHeuristics:
    """Block sizes and warps of a Triton kernel, by its form (codegen/triton_launch.py: launch_config)."""

    # Pointwise: XBLOCK up to pointwise_block, a warp per 32 * pointwise_thread_elements of it (at
    # least pointwise_warps, at most pointwise_max_warps). Four elements a thread: on an H100, AdamW's
    # combo kernels over GPT-2's bf16 tensors (four loads and three stores an element) took 8% less time
    # than at eight (1024 x 4 warps), and copies, GELU and norms the same.
    pointwise_block: int = 1024
    pointwise_thread_elements: int = 4
    pointwise_warps: int = 2
    pointwise_max_warps: int = 8
    # Rows held whole: about row_program_elements per program, and enough programs for
    # row_programs_per_sm per SM; a warp per row_elements_per_warp (up to row_max_warps), and
    # row_all_warps from row_all_warps_from elements (a long softmax row).
    row_program_elements: int = 4096
    row_programs_per_sm: int = 2
    row_elements_per_warp: int = 512
    row_min_warps: int = 2
    row_max_warps: int = 16
    row_all_warps_from: int = 8192
    row_all_warps: int = 32
    # Rows too long to hold: one row per program, walked in chunks. An online softmax keeps two
    # accumulators per lane, so it walks smaller chunks.
    looped_row: Tile = Tile(1, 2048, 8)
    looped_online_softmax_rblock: int = 1024
    # Column sums (memory contiguous along the kept dim, so a tile is XBLOCK columns by RBLOCK rows).
    # One input and one sum, with enough columns for a program per SM at this width: many small
    # programs in flight.
    column_one_sum: Tile = Tile(64, 8, 4)
    # Few columns, or several sums of one input (batch norm's statistics): long steps down the rows.
    column_long_steps: Tile = Tile(32, 128, 8)
    few_columns: int = 16384
    # Several tile inputs with many columns: narrow_xblock columns when every input is narrower
    # than 4 bytes (a 128-byte row of bf16) and a program's chunk is under long_chunk rows.
    column_several_inputs: Tile = Tile(32, 32, 4)
    column_narrow_xblock: int = 64
    column_long_chunk: int = 1024
    # A short column sum (a split's second stage, at most short_columns elements, rows of at most
    # short_columns_tile) is held whole: one load and one reduce per sum.
    short_columns: int = 1 << 18
    short_columns_tile: int = 4096
    short_columns_xblock: int = 32
    short_columns_warps: int = 4
    # A row kernel that also sums columns (kernel.KColumnPartial): one program per chunk of rows,
    # walked column_partial_step_elements at a time in software-pipelined stages, a warp per
    # column_partial_elements_per_warp of a step.
    column_partial_step_elements: int = 4096
    column_partial_elements_per_warp: int = 1024
    column_partial_max_warps: int = 16
    column_partial_stages: int = 3
    # A row kernel accumulating column sums holds, per sum, a tile of the row's width in registers
    # besides the row itself: wider rows than this would spill (schedule/merge.py does not fuse
    # them, schedule/split.py sizes no chunks for them).
    column_partial_max_row: int = 4096
    # A looped floating sum over a row of more than RBLOCK * cascade_steps elements (or of a size
    # known only at run time) adds each lane's elements in blocks of cascade_steps steps, each from
    # zero, then the blocks: a lane adds cascade_steps + row / (RBLOCK * cascade_steps) terms in a
    # row, not row / RBLOCK, which keeps a long fp32 sum's error near eager's (decisions.md).
    cascade_steps: int = 64
    # A size known only at run time counts as this many outputs, or rows of a column sum, when
    # blocks are chosen: large, as a dynamic batch or sequence usually is.
    symbolic_outputs: int = 8192
    symbolic_rows: int = 1 << 20
    # A kernel of symbolic sizes runs with 32-bit index math while every extent it indexes is below
    # this, checked per call, else its 64-bit form (codegen/triton.py: narrow_guard). The margin
    # below 2**31 covers a last block's masked lanes.
    symbolic_int32_below: int = (1 << 31) - (1 << 24)


@dataclass(frozen=True)
class PadHeuristics:
    """Whether schedule/padding.py gives matrix products 16-byte aligned layouts, and from what size."""

    # The device's BLAS runs fast only on aligned extents (cuBLAS: an unaligned N falls back to a
    # kernel several times slower); the GPU targets turn it on.
    products: bool = False
    # Smaller products are launch-bound: not worth a layout change.
    min_elements: int = 1 << 16


@dataclass(frozen=True)
class CppHeuristics:
    """Loop shapes of the C++ code generator (codegen/cpp.py)."""

    # Work below which a kernel runs on one thread (thread start-up costs more than it saves).
    parallel_threshold: int = 32768
    # A floating sum over a row longer than cascade_min_row (or of a size known only at run time)
    # accumulates blocks of cascade_block elements, each from zero, and adds the blocks' sums
    # pairwise: each of an AVX-512 loop's 16 lanes adds 32 elements in a row. Shorter rows keep
    # their one loop, where blocks would cost speed and the error stays small (decisions.md).
    cascade_block: int = 512
    cascade_min_row: int = 4096
    # A row whose loads step by more than one element may be summed by a scalar loop (GCC keeps such
    # loops scalar on AVX2 CPUs): summed in blocks of this many elements from a row of more than this
    # many. A channel's variance over 512 rows of a channels-last tensor was 1.4e-5 off in one scalar loop
    # on an AVX2 EPYC, 1e-7 in blocks.
    strided_cascade_block: int = 32
    # float32 matrix products of static sizes run as ember's GEMM template (codegen/gemm_cpp.py), their
    # epilogue fused, where K is at most gemm_max_k (a thread's copy of a 16-column panel of B,
    # K x 64 bytes, stays in its L2) and A takes at most gemm_max_a_bytes (each panel reads all of A's
    # rows: A stays in the last-level cache). Elsewhere, and with gemm_template off, ATen's BLAS.
    gemm_template: bool = True
    gemm_max_k: int = 4096
    gemm_max_a_bytes: int = 8 << 20
    # A sum over rows of columns contiguous in memory (a bias gradient: [tokens, features] summed over
    # the tokens) runs column_tile columns at a time: each row adds into their accumulators, a vector
    # loop along the columns, instead of one strided loop down each column (2.5 GB/s for BERT's
    # [128, 1024] bias gradient on the 2-core machine). 1: the strided loop down each column.
    column_tile: int = 64
    # A row value costly to compute again (row_cache_min_work flops, a load counting one: one
    # transcendental op, or the rounded sum of two bf16 loads) is kept in a per-thread row array
    # instead, for rows of at most row_cache_max elements (64 KB of float on a thread's stack) and
    # up to row_cache_bytes of such arrays per kernel.
    row_cache_max: int = 16384
    row_cache_bytes: int = 128 * 1024
    row_cache_min_work: int = 4
    # A pointwise kernel whose `where`s check window bounds (a depthwise convolution's taps, a padded
    # pool) writes its vector loop twice: once for the box of positions inside every window, with the
    # checks and clamps gone, and once for the border (codegen/cpp_interior.py). Off: one loop.
    window_interiors: bool = True
    # Inside that box, the innermost outer loop's positions (a row's pixels) are computed window_jam at a
    # time in one vector loop, which reads what does not change along it (a depthwise convolution's
    # weights) once for all of them: on the 2-core AMD machine, code of this form for a 3x3 depthwise over 144
    # channels at 56x56 took 118 us a position at a time, 71 us four at a time (2-3 gained half of that, 8 lost).
    window_jam: int = 4


@dataclass(frozen=True)
class HorizontalHeuristics:
    """Which independent pointwise kernels schedule/horizontal.py runs as one launch (a combo kernel)."""

    # Sub-kernels of one launch (1: no combo kernels), and distinct buffers they pass: a kernel's
    # parameters are limited (CUDA: 4 KB of them), and compile time grows with the branches.
    max_parts: int = 32
    max_buffers: int = 192
    # A kernel over more elements keeps its own launch (its launch costs little next to its memory traffic),
    # but for an update of a mutated input, which may join a table combo kernel (schedule/horizontal.py).
    max_elements: int = 1 << 22
    # Bytes the combined schedule's planned peak may exceed the plain one's; beyond that the
    # kernels keep their own launches (grouping moves kernels, and what they read lives longer).
    max_peak_increase: int = 1 << 20
    # C++: elements of one work item (a part's chunk of rows) that OpenMP threads take in turn (a
    # combo of fewer elements than cpp.parallel_threshold runs on one thread).
    cpu_item_elements: int = 16384
    # Kernels of one body (equal but for their buffers and element counts: an optimizer's update of
    # each parameter) run as one launch that reads each part's buffer addresses from a table in
    # memory (codegen/triton_combo.py: render_triton_table), with no cap on parts or buffers, where at
    # least table_min_parts share the body; 0: never (the C++ target). Each program computes
    # table_xblock elements of one part (a power of two: a value between two is taken down), each
    # thread table_thread_bytes of the narrowest buffer its body walks (16: one vector access, 8 bf16
    # elements; 0: launch.pointwise_thread_elements).
    table_min_parts: int = 0
    table_xblock: int = 512
    table_thread_bytes: int = 16


@dataclass(frozen=True)
class FlexHeuristics:
    """FlexAttention's forward kernel (codegen/flex_triton.py, flex_cpp.py): a Tile is BLOCK_M query
    rows x BLOCK_N keys a step x warps, each within the BlockMask's blocks. The GPU's by head size
    (Hopper: two warpgroups where the value tile is wide), the CPU's rows per task and keys per step."""

    # Head size <= 64: one warpgroup over 128 x 128 scores (255 registers a thread, no spills), as Inductor's
    # Hopper choice; with a mask_mod (causal, a sliding window, documents: blocks listed as partial, or not at
    # all), 64 query rows x 128 keys a step, two loads in flight. <= 128: two warpgroups over 128 x 128, mask or
    # not. On an H200 (device time per call, d64, B4 H16 at 4096 tokens, B16 at 1024): causal 0.374 ms at 4096
    # against 0.417 with the unmasked tile, 0.454 with the masked one at 3 stages; at 1024 0.133 against 0.137
    # with 64 x 64 x 4 at 3 stages, and a 256-key sliding window 0.108 and 0.102 ms either way. Without a
    # mask_mod the larger tile is faster: ALiBi over every key 0.771 and 0.222 ms against 0.861 and 0.260, plain
    # attention 0.720 against 0.783 ms at 4096. d128 causal: 0.694 ms at 4096, 0.258 at 1024, where 128 x 64 x 8
    # took 0.803 and 0.281.
    small: Tile = Tile(128, 128, 4)
    masked: Tile = Tile(64, 128, 4)
    masked_stages: int = 2
    medium: Tile = Tile(128, 128, 8)  # <= 128
    large: Tile = Tile(64, 32, 4)  # larger
    # A score or mask program that reads a captured tensor at positions varying with the query or key
    # (T5's bucketed bias, per score; document ids, per row and column): its indices and pointers take
    # registers the small tile has none left for (255 a thread and spills; 21 ms against 5.1 with this
    # tile for T5's bias at 4096 tokens, d64, on an H200; document masking ran 1.10x Inductor with it).
    gathering: Tile = Tile(128, 64, 8)
    stages: int = 3
    cpu: Tile = Tile(32, 128, 1)
    float32: Tile = Tile(32, 64, 4)  # float32 inputs (their tiles take twice the registers)
    # The backward's kernels: dq's BLOCK_M rows x BLOCK_N keys a step, and dk/dv's BLOCK_M rows a step x
    # BLOCK_N keys. Without a mask_mod, by head size at `stages`: up to 64 (small), up to 128 (Inductor's
    # Hopper tiles), larger (other). With one, `masked` at `masked_stages` for head sizes up to 128. On an H200,
    # causal at 4096 tokens (B4 H16) and 1024 (B16): d128 dq 0.761 and 0.267 ms, dk/dv 1.041 and 0.365, against
    # 0.853 and 0.294, 1.186 and 0.404 with the unmasked tiles, and 1.247 and 1.563 ms at 4096 with 64 x 64 x 4
    # at 3 stages; d64 dk/dv 0.658 ms at 4096 against 0.697 at 3 stages. Without a mask_mod 3 stages do better
    # (ALiBi over every key, d64, dq 0.718 against 0.797 ms at 4096, 0.205 against 0.236 at 1024). (A d64 dq of
    # 64 x 128 x 4 took 0.413 ms against 0.450 on causal at 4096 tokens, but 0.129 against 0.114 on a 256-key
    # sliding window.)
    backward_small: Tile = Tile(64, 64, 4)
    backward_dq: Tile = Tile(128, 64, 8)
    backward_dkdv: Tile = Tile(64, 128, 8)
    backward_other: Tile = Tile(64, 64, 4)
    backward_masked: Tile = Tile(64, 64, 4)
    backward_float32: Tile = Tile(16, 16, 4)


@dataclass(frozen=True)
class TuneHeuristics:
    """Which launch configurations the tuner (backends/launch_tuning.py, under the setting `autotune`)
    measures around the one launch_config picks: each of the heuristic's block sizes, warps and loop
    stages changed alone, by factors of two, nearest first (a coordinate step, as in Inductor's
    coordinate-descent tuning)."""

    # Each block size and the warps are tried times and divided by 2, 4, ... up to 2**steps.
    block_steps: int = 1
    warp_steps: int = 1
    # Software-pipelining stages tried for a kernel's loop (its heuristic's besides): up to this many.
    max_loop_stages: int = 4
    # Candidates measured per kernel and round, the heuristic's (or the last round's winner) included.
    max_candidates: int = 8
    # Rounds of coordinate descent: a round that finds a faster launch is followed by one around it.
    rounds: int = 2
    # Largest block of a program (XBLOCK * RBLOCK elements) and most warps a candidate may have.
    max_block_elements: int = 1 << 15
    max_warps: int = 32
    # Kernels moving fewer bytes are launch-bound: their blocks matter little, and are not tuned.
    min_bytes: int = 1 << 20
    # A candidate replaces the heuristic's choice only if it is faster by this much (timing noise).
    min_gain_percent: int = 2


@dataclass(frozen=True)
class RealizeHeuristics:
    """Which inlined values schedule/realize.py computes once. A value whose expression costs at
    least `broadcast_min_flops` per element (ir/ops.py's flops: a sin, cos, erf, sigmoid, tanh or pow;
    an exp, log or rsqrt alone stays inlined, as a norm's rsqrt of its row statistics in the kernel
    that reduces the rows) and that a reader broadcasts over at least `broadcast_factor` times its
    elements is computed once, where the redundant work also outlasts a launch (the Target's rates)."""

    broadcast_min_flops: int = 8
    broadcast_factor: int = 4
    # Whether a kernel evaluates a 0-d value's expression for each element it computes (the C++ target's
    # loops: then broadcasting it is recomputation); Triton kernels compute 0-d values as scalars, once a
    # thread, so there they stay inlined: an optimizer's per-parameter bias corrections then keep every
    # update one body, a large parameter's too (one table kernel; schedule/horizontal.py).
    scalars_per_element: bool = True
    # A value of at least `shared_min_flops` per element that at least `shared_readers` readers inline
    # (a pool's window terms count one each) is computed once; 0 readers: never (the default, and the
    # GPU's, where recomputation hides under the loads; the C++ target sets 4). 3 flops: a frozen batch
    # norm's multiply-add and a ReLU.
    shared_readers: int = 0
    shared_min_flops: int = 3
    # Two readers suffice for a value of at least `costly_min_flops` per element (a depthwise convolution
    # read by a squeeze-and-excite's mean and by its scale), and such work does not fuse into a reduction
    # whose loop reads memory across strides (merge.py); 0: never (the GPU's; the C++ target sets 8, a sigmoid).
    costly_min_flops: int = 0
    # A value that at least two kernels read and whose inlined expression loads at least `inlined_loads`
    # buffers (small ones too: a row statistic is a load and a dependent step) is computed once. Each
    # normalization of a chain of them adds its statistics to the next value's expression, so, inlined,
    # the k-th reduction would evaluate the k-1 before it: quadratic work down a chain, single programs
    # of small rows each running the whole chain (ember bench's host_100k, 50 normalizations of 64 x 64,
    # took 1.6 ms on an H100 inlined; 0.17 ms stored every few steps).
    inlined_loads: int = 12
    # Integer arithmetic on loop positions alone (a padding's inside-the-image test) counts no work: the C++
    # target's vector loop over channels computes it once per loop (its default; the GPU's counts it).
    free_positions: bool = False


@dataclass(frozen=True)
class LowerHeuristics:
    """Which ATen ops become ember's own computation rather than a library call (aten/lowerings/)."""

    # Depthwise convolutions (one filter per channel, aten/lowerings/convolution.py) as sums over their
    # window's views, which fuse with their padding, batch norm and activation. The C++ target takes them:
    # on 2 cores, oneDNN spent 50-75 us a call on MobileNetV2's small ones. Only weights laid out with their
    # channels innermost are taken, which freezing does on the CPU alone (frontend/prepack.py): Triton leaves
    # them to cuDNN, and a GPU graph would find no such weight if this were set.
    depthwise_convolutions: bool = False
    # Under freezing, a 1x1 convolution over a channels-last input of at least this many channels is a BLAS
    # product over its [pixels, channels] view (frontend/prepack.py: _as_product), its activation fused by
    # ember; 0: never (the GPU's; the C++ target sets 32, below which MKL's products were the slower).
    product_convolutions_min_channels: int = 0
    # ... and so is one over at most this many pixels (batch times height times width), whatever its channels
    # and activation: a squeeze-and-excite block's, over a pooled [n, c, 1, 1]; 0: never (the GPU's; the C++
    # target sets 16: a oneDNN call there costs more than the work).
    product_convolutions_max_pixels: int = 0
    # Under freezing, products of one input by frozen weights (a layer's query, key and value) as one product
    # over the weights concatenated (frontend/grouped_products.py). The C++ target's: MKL's and oneDNN's
    # products over a [K, 256] weight cost about what a [K, 768] one does per call on 2 cores.
    group_frozen_products: bool = False
    # A float32 `addmm` whose bias is one value per column runs as `mm` and ember's add, which fuses into the
    # product's readers (schedule/product_bias.py). The C++ target's: ATen's CPU addmm first copies the bias into
    # every row of its output and then has the BLAS add the product to it, a write and a read of the output more.
    product_bias_as_add: bool = False


@dataclass(frozen=True)
class SkinnyHeuristics:
    """Matrix products of few rows that read one input (a decoding step's query, key and value projections; its
    gate and up projections) as one launch over all their weights (schedule/skinny.py). Such a product only
    streams its weight, and at a few megabytes a launch's fixed cost is most of its time: one launch of three
    such products ran in about a third of cuBLAS's three on an H200."""

    # Products of at most this many rows are grouped; 0: never (the C++ target's: its BLAS has no launch cost).
    max_rows: int = 0
    # Products in a group, at least; a lone product keeps cuBLAS, which reads a weight as fast.
    min_group: int = 2
    # The kernel's tile, written `XxRxW`: each program computes X columns of one product over the whole depth,
    # R of it a step (rows padded to 16, tl.dot's least), with W warps and `stages` software-pipelining stages.
    tile: Tile = Tile(32, 256, 4)
    stages: int = 4
    # Where the narrow tile would run more than `wide_programs_per_sm` programs per SM, wider ones with shorter
    # steps: on an H200 a [1, 2048] row times two [2048, 8192] matrices took 18.3 us so, 23.6 with the narrow
    # tile, whose 32 x 256 steps suit fewer columns (6.9 us for [2048, 3072] against 7.7 with 32 x 128).
    wide_tile: Tile = Tile(64, 128, 4)
    wide_stages: int = 3
    wide_programs_per_sm: int = 2


@dataclass(frozen=True)
class GraphHeuristics:
    """Which CUDA graph recordings the default mode keeps (runtime/cudagraph_judge.py)."""

    # Where the device is the slower, a recording saves at most the gaps between launches, and its copies of
    # what the caller keeps cost device time: it is kept while they take at most this percent of its replay
    # (a training step's gradients; an LM's logits take more, and its graph then runs without recording).
    default_copy_percent: int = 5


@dataclass(frozen=True)
class Heuristics:
    """The target's tunable thresholds and tables, as data."""

    split: SplitHeuristics = SplitHeuristics()
    launch: LaunchHeuristics = LaunchHeuristics()
    pad: PadHeuristics = PadHeuristics()
    horizontal: HorizontalHeuristics = HorizontalHeuristics()
    cpp: CppHeuristics = CppHeuristics()
    tune: TuneHeuristics = TuneHeuristics()
    flex: FlexHeuristics = FlexHeuristics()
    realize: RealizeHeuristics = RealizeHeuristics()
    lower: LowerHeuristics = LowerHeuristics()
    skinny: SkinnyHeuristics = SkinnyHeuristics()
    graphs: GraphHeuristics = GraphHeuristics()

    def tuned(self, text: str) -> Heuristics:
        """These heuristics with the changes `text` names: comma-separated `group.field=value`
        (`split.max_second_split=8, launch.column_one_sum=64x8x4, pad.products=1`). Raises
        ValueError naming the valid fields for an unknown one or a value that does not parse."""
        groups = {f.name: getattr(self, f.name) for f in fields(self)}
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            name, equals, raw = item.partition("=")
            group, dot, attr = name.strip().partition(".")
            if not equals or not dot or group not in groups:
                raise ValueError(f"{item!r} is not group.field=value, with group one of {', '.join(groups)}")
            record = groups[group]
            valid = [f.name for f in fields(record)]
            if attr not in valid:
                raise ValueError(f"{group} has no heuristic {attr!r} (valid: {', '.join(valid)})")
            default = next(f.default for f in fields(record) if f.name == attr)
            value = _parse(type(getattr(record, attr)), raw.strip(), zero=default == 0)
            if value is None:
                kind = _KINDS[type(getattr(record, attr))]
                kind = "0 or a positive integer" if kind == _KINDS[int] and default == 0 else kind
                raise ValueError(f"{name.strip()}={raw.strip()!r} is not {kind}")
            groups[group] = replace(record, **{attr: value})
        return replace(self, **groups)


_KINDS = {Tile: "a tile XBLOCKxRBLOCKxWARPS of powers of two", bool: "0 or 1", int: "a positive integer"}


def _parse(kind: type, text: str, zero: bool = False) -> Tile | bool | int | None:
    """`text` as a heuristic of type `kind`, or None where it is not one. `zero`: 0 is an integer
    heuristic's value too (a field whose default is 0, its "off": `horizontal.table_min_parts=0`);
    elsewhere an integer is a size or a count, at least 1."""
    if kind is bool:
        return {"0": False, "1": True}.get(text)
    if kind is Tile:
        try:
            return Tile.parse(text)
        except ValueError:
            return None
    return int(text) if text.isdigit() and int(text) >= (0 if zero else 1) else None


@dataclass(frozen=True)
class Target:
    """What the device and the code generator can do, and their measured limits."""

    name: str  # the code generator: "triton", "cpp"
    device: str = "cpu"  # the device type kernels run on: "cuda", "cpu"
    device_name: str = ""  # for reports: "NVIDIA H100 80GB HBM3", "CPU x16"
    interpreted: bool = False  # Triton's CPU interpreter runs the kernels: nothing is compiled
    sm_count: int = 0  # streaming multiprocessors (the interpreter's: INTERPRETER_SM_COUNT; 0: no GPU)
    arch: tuple = ()  # what binaries are built for: Triton's GPU target (backend, arch, warp size), the host CPU
    # Limits, for schedule/cost.py's roofline estimate, the GEMM choice and realize.py's rule for
    # broadcast transcendental work (0: unknown). The bandwidth is measured (it varies run to run and
    # stays out of the key); the rate and the launch cost are fixed figures, and schedules depend on them.
    bandwidth: float = 0.0  # bytes/s, a large copy
    flop_rate: float = 0.0  # FLOP/s, the specification's vector (not tensor-core) fp32 rate
    launch_seconds: float = 0.0
    # What the code generator renders:
    online_softmax: bool = False  # schedule/online.py's one-pass max and sum of exp
    # Programs of a row kernel that also sums its rows' columns (kernel.KColumnPartial); split.py
    # sizes those sums' chunks for them. 0: such kernels are not rendered.
    row_programs: int = 0
    # Loads and stores at rows an index tensor names, checked against the buffer's size in the kernel
    # (kernel.KRow): gathers computed where they are read (schedule/gathers.py), a KV cache's update
    # stored by the kernel computing it, and scatter-adds accumulated atomically (schedule/indexed_store.py).
    indexed_rows: bool = False
    # Stores at such rows (a KV cache's update into its input, a scatter-add): a kernel that finds a bad
    # row must stop before any row is written (Triton's device assert), or the caller's tensor changes.
    row_stores: bool = False
    # Combo kernels (schedule/horizontal.py) whose parts read or write at such rows.
    combo_rows: bool = False
    # The dtypes whose stores the code generator adds atomically (kernel.KStore.accumulate): a
    # scatter-add of another dtype stays ATen's call (schedule/indexed_store.py).
    atomic_adds: tuple = ()
    heuristics: Heuristics = Heuristics()
    # A measured fact of the device per product shape: whether a frozen linear layer's product runs faster
    # as oneDNN's over a weight packed for it than as ATen's, for [rows, k] x [k, n] (+ bias); the C++
    # target's measures once per machine and shape (backends/cpu_products.py). None: never packed. Not
    # in the key: the answer changes only which library computes a product, which the graph's ATen code
    # (in every key) then names. A module-level function: a schedule pickles its Target.
    packed_product_faster: Callable[[int, int, int, bool], bool] | None = field(default=None, compare=False, repr=False)

    @property
    def column_partials(self) -> bool:
        """Whether row kernels may accumulate split column sums (kernel.KColumnPartial)."""
        return self.row_programs > 0

    def key(self) -> tuple:
        """What a schedule or binary made for this target depends on, for cache keys: all but the
        device's display name and its measured bandwidth."""
        return (
            self.name,
            self.device,
            self.interpreted,
            self.sm_count,
            self.arch,
            self.flop_rate,
            self.launch_seconds,
            self.online_softmax,
            self.row_programs,
            self.indexed_rows,
            self.row_stores,
            self.combo_rows,
            self.atomic_adds,
            astuple(self.heuristics),
        )

    def tuned(self, text: str) -> Target:
        """This target with the heuristics changes `text` names (Heuristics.tuned)."""
        return replace(self, heuristics=self.heuristics.tuned(text)) if text.strip() else self

    def __str__(self) -> str:
        limits = f"{self.bandwidth / 1e9:.0f} GB/s measured, {self.flop_rate / 1e12:.1f} TFLOP/s spec"
        return f"{self.device_name or self.device}: {limits}"
