"""FlexAttention's forward as a C++ kernel (ir/flex.py says what it computes).

One task per (batch, query head, BlockMask query block), spread over OpenMP threads. A task walks
the key blocks its BlockMask row lists (partial blocks with mask_mod, then full blocks without),
and for each query row of its block computes the scores of one key block (a dot product vectorized
over the head dim), applies score_mod and the mask, and updates the row's online softmax: running
max, sum of exponentials and the weighted sum of values (vectorized over the value dim). Rows hold
their state across blocks in per-task arrays. Scores compute in the spec's working precision.

The signature is `void name(void* const* ptrs, const int64_t* p)`: `ptrs` the tensors (q, k, v,
out, lse, max, kv_num_blocks, kv_indices, [full_kv_num_blocks, full_kv_indices], captured
tensors), `p` the sizes and strides in `CPP_PARAMS` order, then each captured tensor's sizes and
strides.
"""

from __future__ import annotations

from ember.codegen.flex_expr import CPP_HELPERS, CPP_TYPES, render_program
from ember.ir.flex import FlexSpec

# The leading integer parameters, in order (backends/flex.py fills them).
PARAMS = [
    *("B", "H", "M", "N", "G", "SB", "SH"),
    *("sqb", "sqh", "sqm", "sqd", "skb", "skh", "skn", "skd", "svb", "svh", "svn", "svd", "sob", "soh", "som", "sod"),
    *("snb", "snh", "snq", "sib", "sih", "siq", "sik", "sfb", "sfh", "sfq", "sjb", "sjh", "sjq", "sjk"),
]
# The C++ kernel's: PARAMS, then the BlockMask's block sizes (Triton's kernel takes them as constants).
CPP_PARAMS = [*PARAMS, "QB", "KB"]


def _load_scalar(dtype, ptr: str) -> str:
    if CPP_TYPES[dtype] == "uint16_t":
        return f"ember_bf16_to_f32({ptr})"
    return f"static_cast<W>({ptr})"


def render_flex_cpp(spec: FlexSpec, name: str, block_m: int, block_n: int) -> str:
    t = CPP_TYPES[spec.dtype]
    w = CPP_TYPES[spec.work_dtype]
    n_fixed = 10 if spec.has_full_blocks else 8
    buf_lines = []
    offset = len(CPP_PARAMS)
    for i, buf in enumerate(spec.buffers):
        buf_lines.append(
            f"const {CPP_TYPES[buf.dtype]}* __restrict__ buf{i} = (const {CPP_TYPES[buf.dtype]}*)ptrs[{n_fixed + i}];"
        )
        buf_lines.append(
            f"const int64_t* buf{i}_size = p + {offset}; const int64_t* buf{i}_stride = p + {offset + buf.ndim};"
        )
        offset += 2 * buf.ndim

    def load(number: int, indices: list[str]) -> str:
        ndim = len(indices)
        wrapped = [f"({ix} < 0 ? {ix} + buf{number}_size[{d}] : {ix})" for d, ix in enumerate(indices)]
        inside = " && ".join(f"({wx}) >= 0 && ({wx}) < buf{number}_size[{d}]" for d, wx in enumerate(wrapped))
        where = " + ".join(f"({wx}) * buf{number}_stride[{d}]" for d, wx in enumerate(wrapped)) if ndim else "0"
        return f"(({inside or 'true'}) ? buf{number}[{where}] : ({CPP_TYPES[spec.buffers[number].dtype]})0)"

    args = {0: "sc", 1: "bi", 2: "hi", 3: "qi", 4: "ki"}
    score_lines, score_result = (
        render_program(spec.score, "cpp", args, load, "s") if spec.score is not None else ([], "sc")
    )
    mask_lines, mask_result = (
        render_program(spec.mask, "cpp", args, load, "m") if spec.mask is not None else ([], "true")
    )
    indent = "\n" + " " * 20
    score_code = indent.join(score_lines)
    mask_code = indent.join(mask_lines)
    unpack = "\n    ".join(f"const int64_t {n} = p[{i}];" for i, n in enumerate(CPP_PARAMS))
    full_walk = (
        """
        {
            const int64_t nfull = full_num[sb * sfb + sh * sfh + qb * sfq];
            for (int64_t t = 0; t < nfull; t++) block(full_idx[sb * sjb + sh * sjh + qb * sjq + t * sjk], true);
        }"""
        if spec.has_full_blocks
        else ""
    )
    full_ptrs = (
        "const int32_t* full_num = (const int32_t*)ptrs[8];\n    const int32_t* full_idx = (const int32_t*)ptrs[9];"
        if spec.has_full_blocks
        else ""
    )
    bufs = "\n    ".join(buf_lines)
    return f"""
{CPP_HELPERS}
template <bool UNIT>
static void {name}_body(void* const* ptrs, const int64_t* p) {{
    typedef {w} W;
    const {t}* __restrict__ Q = (const {t}*)ptrs[0];
    const {t}* __restrict__ K = (const {t}*)ptrs[1];
    const {t}* __restrict__ V = (const {t}*)ptrs[2];
    {t}* __restrict__ O = ({t}*)ptrs[3];
    W* __restrict__ LSE = (W*)ptrs[4];
    W* __restrict__ MAX = (W*)ptrs[5];
    const int32_t* kv_num = (const int32_t*)ptrs[6];
    const int32_t* kv_idx = (const int32_t*)ptrs[7];
    {full_ptrs}
    {bufs}
    {unpack}
    // Unit strides along the head dims (the common layout) as constants, so those loops vectorize.
    const int64_t sqd_ = UNIT ? 1 : sqd, skd_ = UNIT ? 1 : skd, svd_ = UNIT ? 1 : svd, sod_ = UNIT ? 1 : sod;
    constexpr int64_t D = {spec.head_dim}, DV = {spec.value_dim};
    constexpr int64_t BM = {block_m}, BN = {block_n};  // rows per task, keys per step: at most
    // Within the BlockMask's blocks: the largest power of two dividing each block size, at most BM / BN.
    const int64_t BMr = std::min<int64_t>(BM, QB & -QB), BNr = std::min<int64_t>(BN, KB & -KB);
    const W scale = (W){spec.scale!r};
    const W LN2 = (W)0.6931471805599453;
    const int64_t ntiles = (M + BMr - 1) / BMr;
    #pragma omp parallel for collapse(3) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
    for (int64_t tile = 0; tile < ntiles; tile++) {{
        const int64_t hk = h / G, sb = b % SB, sh = h % SH, qb = tile * BMr / QB, m0 = tile * BMr;
        const int64_t rows = std::min(BMr, M - m0);
        W acc[BM * DV], mrow[BM], lrow[BM], s[BN], qrow[D], kt[D * BN];
        for (int64_t i = 0; i < rows; i++) {{ mrow[i] = -INFINITY; lrow[i] = 0; }}
        for (int64_t i = 0; i < rows * DV; i++) acc[i] = 0;
        const int32_t bi = (int32_t)b, hi = (int32_t)h;
        auto step = [&](int64_t n0, int64_t n1, bool full) {{
            // The step's keys transposed (kt[d][j]): each row's scores are then FMAs along j, in vectors.
            const int64_t cnt = n1 - n0;
            for (int64_t j = 0; j < cnt; j++) {{
                const {t}* kp = K + b * skb + hk * skh + (n0 + j) * skn;
                for (int64_t d = 0; d < D; d++) kt[d * BN + j] = {_load_scalar(spec.dtype, "kp[d * skd_]")};
            }}
            for (int64_t i = 0; i < rows; i++) {{
                const int64_t qpos = m0 + i;
                const int32_t qi = (int32_t)qpos;
                const {t}* qp = Q + b * sqb + h * sqh + qpos * sqm;
                for (int64_t d = 0; d < D; d++) qrow[d] = {_load_scalar(spec.dtype, "qp[d * sqd_]")};
                #pragma omp simd
                for (int64_t j = 0; j < cnt; j++) s[j] = 0;
                for (int64_t d = 0; d < D; d++) {{
                    const W qd = qrow[d];
                    const W* kr = kt + d * BN;
                    #pragma omp simd
                    for (int64_t j = 0; j < cnt; j++) s[j] += qd * kr[j];
                }}
                #pragma omp simd
                for (int64_t j = 0; j < cnt; j++) s[j] *= scale;
                #pragma omp simd
                for (int64_t j = 0; j < cnt; j++) {{
                    const int32_t ki = (int32_t)(n0 + j);
                    const W sc = s[j];
                    {score_code}
                    W val = {score_result};
                    if (!full) {{
                    {mask_code}
                    val = ({mask_result}) ? val : (W)-INFINITY;
                    }}
                    s[j] = val;
                }}
                W mx = -INFINITY;
                #pragma omp simd reduction(max : mx)
                for (int64_t j = 0; j < cnt; j++) mx = mx < s[j] ? s[j] : mx;
                const W mnew = mrow[i] < mx ? mx : mrow[i];
                if (mnew == -INFINITY) continue;
                const W alpha = std::exp(mrow[i] - mnew);
                W* a = acc + i * DV;
                if (alpha != 1) {{
                    lrow[i] *= alpha;
                    #pragma omp simd
                    for (int64_t d = 0; d < DV; d++) a[d] *= alpha;
                }}
                W total = 0;
                #pragma omp simd reduction(+ : total)
                for (int64_t j = 0; j < cnt; j++) {{
                    s[j] = std::exp(s[j] - mnew);
                    total += s[j];
                }}
                lrow[i] += total;
                for (int64_t j = 0; j < cnt; j++) {{
                    const W pr = s[j];
                    if (pr == 0) continue;
                    const {t}* vp = V + b * svb + hk * svh + (n0 + j) * svn;
                    #pragma omp simd
                    for (int64_t d = 0; d < DV; d++) a[d] += pr * {_load_scalar(spec.dtype, "vp[d * svd_]")};
                }}
                mrow[i] = mnew;
            }}
        }};
        auto block = [&](int64_t kb, bool full) {{
            const int64_t end = std::min(N, (kb + 1) * KB);
            for (int64_t n0 = kb * KB; n0 < end; n0 += BNr) step(n0, std::min(end, n0 + BNr), full);
        }};
        {{
            const int64_t npart = kv_num[sb * snb + sh * snh + qb * snq];
            for (int64_t t = 0; t < npart; t++) block(kv_idx[sb * sib + sh * sih + qb * siq + t * sik], false);
        }}{full_walk}
        for (int64_t i = 0; i < rows; i++) {{
            const int64_t qpos = m0 + i;
            const W l = lrow[i];
            const W inv = l > 0 ? (W)1 / l : (W)0;
            {t}* op = O + b * sob + h * soh + qpos * som;
            for (int64_t d = 0; d < DV; d++) op[d * sod_] = {_store("acc[i * DV + d] * inv", spec.dtype)};
            const int64_t r = (b * H + h) * M + qpos;
            LSE[r] = l > 0 ? (mrow[i] + std::log(l)) / LN2 : (W)-INFINITY;
            MAX[r] = mrow[i] / LN2;
        }}
    }}
}}

extern "C" void {name}(void* const* ptrs, const int64_t* p) {{
    const int64_t unit = p[{_index("sqd")}] == 1 && p[{_index("skd")}] == 1 && p[{_index("svd")}] == 1 && p[{_index("sod")}] == 1;
    if (unit) {name}_body<true>(ptrs, p);
    else {name}_body<false>(ptrs, p);
}}
"""


def _index(name: str) -> int:
    return PARAMS.index(name)


def _store(expr: str, dtype) -> str:
    if CPP_TYPES[dtype] == "uint16_t":
        return f"ember_f32_to_bf16((float)({expr}))"
    return f"({CPP_TYPES[dtype]})({expr})"


__all__ = ["CPP_PARAMS", "PARAMS", "render_flex_cpp"]
