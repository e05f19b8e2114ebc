//! The experts of a mixture-of-experts layer on the GPU (`kernels/moe.cu`), for bf16 and f16
//! models, with no round trip to the host: the router's top k per token, the (token, slot) pairs
//! sorted by expert into a [`Plan`], the experts' SwiGLU and down projections as one grouped
//! launch each (the first gathers its rows straight from the tokens), and the weighted sum over
//! the slots with the shared expert in one pass. `EngineOptions::cuda_moe` turns the kernels off
//! (one matmul chain per expert instead, sorted on the host).

use candle_core::cuda_backend::cudarc::driver::{LaunchArgs, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Device, Tensor};

use super::module::{fatbin, kernel, Module};
use super::{cuda_device, cuda_view, kernel_name, tensor as wrap};

/// `kernels/moe.cu`.
const MOE: Module = fatbin!("moe");

/// The rows of the grouped kernels' tiles: 64 (`BM` in the kernel) or 128 (`TM`), chosen per
/// batch by [`tile_rows`]; on Hopper ([`hopper_kernels`]) one warpgroup per 64 rows. The FP8
/// kernel takes 64.
pub const TILE_ROWS: [usize; 2] = [64, 128];
/// Output columns of one grouped block, and of one SwiGLU block.
const BN: usize = 128;
const BN_SWIGLU: usize = 64;
/// The same on Hopper's warpgroup kernels (`grouped_wg_*`), whose tiles are 256 rows of w.
const WG_BN: usize = 256;
const WG_BN_SWIGLU: usize = 128;
/// The most experts the routing and sorting kernels hold in shared memory.
pub const MAX_EXPERTS: usize = 1024;
/// The most experts per token (one warp lane each).
pub const MAX_TOP_K: usize = 32;
const ROUTE_WARPS: usize = 8;
const PLACE_PAIRS: usize = 256 * 8;

/// Whether the kernels serve `experts` experts of `hidden` x `inter`, `top_k` per token, in
/// `dtype` on `device`.
pub fn supported(device: &Device, dtype: DType, hidden: usize, inter: usize, experts: usize, top_k: usize) -> bool {
    device.is_cuda()
        && matches!(dtype, DType::BF16 | DType::F16)
        && hidden.is_multiple_of(8)
        && inter.is_multiple_of(8)
        && experts <= MAX_EXPERTS
        && (1..=MAX_TOP_K.min(experts)).contains(&top_k)
}

fn launch(b: &mut LaunchArgs<'_>, grid: (u32, u32), block: u32) -> candle_core::Result<()> {
    launch_shared(b, grid, block, 0)
}

fn launch_shared(b: &mut LaunchArgs<'_>, grid: (u32, u32), block: u32, shared: usize) -> candle_core::Result<()> {
    let cfg = LaunchConfig { grid_dim: (grid.0, grid.1, 1), block_dim: (block, 1, 1), shared_mem_bytes: shared as u32 };
    // SAFETY: every caller pushes the arguments of its kernel's signature in order, and sizes
    // the buffers it passes for the indices that kernel forms (documented at each call).
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

fn as_i32(n: usize, what: &str) -> candle_core::Result<i32> {
    i32::try_from(n).map_err(|_| candle_core::Error::Msg(format!("the experts' kernels: {what} = {n} is too large")))
}

/// Runs `$body` with `$t` the half type of `$dtype`.
macro_rules! half_type {
    ($dtype:expr, $t:ident, $body:block) => {
        match $dtype {
            DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                $body
            }
            other => candle_core::bail!("the experts' kernels take bf16 or f16, got {other:?}"),
        }
    };
}

/// The router's choice for logits `[T, E]` (16-bit): `[T, k]` experts (u32, best first) and
/// their weights (f32): the softmax over all E in f32, renormalised over the k when `norm`.
pub fn route(logits: &Tensor, k: usize, norm: bool) -> candle_core::Result<(Tensor, Tensor)> {
    let logits = logits.contiguous()?;
    let (t, e) = logits.dims2()?;
    if e > MAX_EXPERTS || k == 0 || k > MAX_TOP_K.min(e) {
        candle_core::bail!("routing: {k} of {e} experts is not served (at most {MAX_TOP_K} of {MAX_EXPERTS})");
    }
    let dev = cuda_device(&logits, "moe routing")?;
    // SAFETY: the kernel writes k experts and weights for each of the t tokens.
    let idx = unsafe { dev.alloc::<u32>(t * k)? };
    let w = unsafe { dev.alloc::<f32>(t * k)? };
    if t > 0 {
        let (s, l) = logits.storage_and_layout();
        let (t_i, e_i, k_i, n_i) = (as_i32(t, "tokens")?, e as i32, k as i32, norm as i32);
        half_type!(logits.dtype(), H, {
            let lv = cuda_view::<H>(&s, l, "the router's logits")?;
            let f = kernel(dev, MOE, &kernel_name::<H>("moe_route"))?;
            let mut b = f.builder();
            b.arg(&lv).arg(&idx).arg(&w).arg(&t_i).arg(&e_i).arg(&k_i).arg(&n_i);
            launch(&mut b, (t.div_ceil(ROUTE_WARPS) as u32, 1), (ROUTE_WARPS * 32) as u32)?;
        });
    }
    Ok((wrap(idx, dev, (t, k)), wrap(w, dev, (t, k))))
}

/// The (token, slot) pairs of a batch sorted by expert, all on the device.
pub struct Plan {
    /// `[T k]` u32: the token of each row, rows grouped by expert (expert 0's first).
    pub tokens: Tensor,
    /// `[k T]` u32: the row of (slot j, token t) at `j T + t`.
    pub row_of: Tensor,
    /// `[bound, 3]` u32: (expert, first row, rows ≤ `tile_rows`) per tile; the first `n_tiles`
    /// are set.
    pub tiles: Tensor,
    /// `[1]` u32: how many tiles there are.
    pub n_tiles: Tensor,
    /// The most rows of a tile (one of [`TILE_ROWS`]).
    pub tile_rows: usize,
    bound: usize,
    t: usize,
    k: usize,
}

/// The tile rows for `pairs` (token, slot) pairs over `experts` experts: 128 where an expert
/// has 64 rows or more on average (a larger tile keeps the tensor cores busier), 64 below (less
/// of a part-full tile computed for nothing). A row's result is the same bits either way.
pub fn tile_rows(pairs: usize, experts: usize) -> usize {
    if pairs >= TILE_ROWS[0] * experts {
        TILE_ROWS[1]
    } else {
        TILE_ROWS[0]
    }
}

/// Sorts the pairs of `idx` (`[T, k]` u32 experts below `experts`) by expert, in tiles of at
/// most `tile_rows` rows (one of [`TILE_ROWS`]).
pub fn plan(idx: &Tensor, experts: usize, tile_rows: usize) -> candle_core::Result<Plan> {
    let idx = idx.contiguous()?;
    let (t, k) = idx.dims2()?;
    let pairs = t * k;
    if experts == 0 || experts > MAX_EXPERTS {
        candle_core::bail!("sorting by expert: {experts} experts (1 to {MAX_EXPERTS} are served)");
    }
    if !TILE_ROWS.contains(&tile_rows) {
        candle_core::bail!("sorting by expert: tiles of {tile_rows} rows (the kernels take {TILE_ROWS:?})");
    }
    let dev = cuda_device(&idx, "moe sorting")?;
    let bound = pairs.div_ceil(tile_rows) + experts.min(pairs);
    let counts = dev.alloc_zeros::<u32>(experts)?;
    let cursor = dev.alloc_zeros::<u32>(experts)?;
    // SAFETY: moe_offsets writes every expert's start, the first n_tiles tiles (never more than
    // `bound`) and n_tiles; moe_place writes every pair's row (the rows are a permutation).
    let starts = unsafe { dev.alloc::<u32>(experts)? };
    let tiles = unsafe { dev.alloc::<u32>(bound.max(1) * 3)? };
    let n_tiles = dev.alloc_zeros::<u32>(1)?;
    let tokens = unsafe { dev.alloc::<u32>(pairs)? };
    let row_of = unsafe { dev.alloc::<u32>(pairs)? };
    if pairs > 0 {
        let (s, l) = idx.storage_and_layout();
        let iv = cuda_view::<u32>(&s, l, "the chosen experts")?;
        let (p_i, e_i, t_i, k_i) = (as_i32(pairs, "pairs")?, experts as i32, t as i32, k as i32);
        let f = kernel(dev, MOE, "moe_count")?;
        let mut b = f.builder();
        b.arg(&iv).arg(&counts).arg(&p_i).arg(&e_i);
        launch(&mut b, (pairs.div_ceil(PLACE_PAIRS).min(1024) as u32, 1), 256)?;
        let f = kernel(dev, MOE, "moe_offsets")?;
        let mut b = f.builder();
        let bm = tile_rows as i32;
        b.arg(&counts).arg(&starts).arg(&tiles).arg(&n_tiles).arg(&e_i).arg(&bm);
        launch(&mut b, (1, 1), 256)?;
        let f = kernel(dev, MOE, "moe_place")?;
        let mut b = f.builder();
        b.arg(&iv).arg(&starts).arg(&cursor).arg(&tokens).arg(&row_of).arg(&t_i).arg(&k_i).arg(&e_i);
        launch(&mut b, (pairs.div_ceil(PLACE_PAIRS) as u32, 1), 256)?;
    }
    Ok(Plan {
        tokens: wrap(tokens, dev, pairs),
        row_of: wrap(row_of, dev, pairs),
        tiles: wrap(tiles, dev, (bound.max(1), 3)),
        n_tiles: wrap(n_tiles, dev, 1),
        tile_rows,
        bound,
        t,
        k,
    })
}

/// `silu(x[token] W_gate^T) * (x[token] W_up^T)` for every row of the plan: `x` `[T, K]` the
/// tokens, `gate_up` `[E, 2N, K]` (each expert's gate rows, then its up rows). Returns `[T k, N]`
/// in the plan's row order.
pub fn grouped_swiglu(x: &Tensor, gate_up: &Tensor, plan: &Plan) -> candle_core::Result<Tensor> {
    grouped(x, gate_up, plan, true)
}

/// `x[r] W_e^T` for every row r of the plan (expert e): `x` `[T k, K]` in the plan's row order,
/// `w` `[E, N, K]`. Returns `[T k, N]`.
pub fn grouped_matmul(x: &Tensor, w: &Tensor, plan: &Plan) -> candle_core::Result<Tensor> {
    grouped(x, w, plan, false)
}

fn grouped(x: &Tensor, w: &Tensor, plan: &Plan, swiglu: bool) -> candle_core::Result<Tensor> {
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let (xr, k) = x.dims2()?;
    let (_, wn, kw) = w.dims3()?;
    let rows = plan.t * plan.k;
    let n = if swiglu { wn / 2 } else { wn };
    let want_rows = if swiglu { plan.t } else { rows };
    let aligned = |t: &Tensor| t.layout().start_offset().is_multiple_of(8);
    if kw != k || k % 8 != 0 || n % 8 != 0 || (swiglu && wn % 2 != 0) || xr != want_rows || x.dtype() != w.dtype() {
        candle_core::bail!("grouped matmul: x {:?} and w {:?} do not fit a plan of {rows} rows", x.shape(), w.shape());
    }
    if !aligned(&x) || !aligned(&w) {
        candle_core::bail!("grouped matmul: x and w must start 16-byte aligned");
    }
    let dev = cuda_device(&x, "grouped matmul")?;
    let (n_i, k_i) = (as_i32(n, "columns")?, as_i32(k, "the reduction")?);
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (ts, tl) = plan.tiles.storage_and_layout();
    let (cs, cl) = plan.n_tiles.storage_and_layout();
    let (gs, gl) = plan.tokens.storage_and_layout();
    let tiles = cuda_view::<u32>(&ts, tl, "the tile list")?;
    let n_tiles = cuda_view::<u32>(&cs, cl, "the tile count")?;
    let gather = cuda_view::<u32>(&gs, gl, "the rows' tokens")?;
    // Hopper's warpgroup kernels where the build carries them and the GPU is a 9.0 one; the
    // mma.sync kernels elsewhere. On one GPU every batch takes the same kind.
    let hopper = hopper_kernels(x.device());
    half_type!(x.dtype(), H, {
        let xv = cuda_view::<H>(&xs, xl, "x")?;
        let wv = cuda_view::<H>(&ws, wl, "w")?;
        // SAFETY: the tiles cover every row of the plan once, and each writes all n columns of
        // its rows.
        let y = unsafe { dev.alloc::<H>(rows * n)? };
        if rows > 0 {
            let (base, threads, shared, block_cols) = if hopper {
                let base = if swiglu {
                    format!("grouped_wg_swiglu{}", plan.tile_rows)
                } else {
                    format!("grouped_wg_mm{}", plan.tile_rows)
                };
                (base, 2 * plan.tile_rows, wg_shared_bytes(plan.tile_rows), if swiglu { WG_BN_SWIGLU } else { WG_BN })
            } else {
                let base = match (swiglu, plan.tile_rows) {
                    (true, 128) => "grouped_swiglu128",
                    (true, _) => "grouped_swiglu",
                    (false, 128) => "grouped_mm128",
                    (false, _) => "grouped_mm",
                };
                (base.to_string(), 128, grouped_shared_bytes(plan.tile_rows), if swiglu { BN_SWIGLU } else { BN })
            };
            let f = kernel(dev, MOE, &kernel_name::<H>(&base))?;
            f.max_dynamic_shared(shared)?;
            let mut b = f.builder();
            let null = 0u64;
            b.arg(&xv);
            if swiglu {
                b.arg(&gather);
            } else {
                b.arg(&null);
            }
            b.arg(&wv).arg(&y).arg(&tiles).arg(&n_tiles).arg(&n_i).arg(&k_i);
            launch_shared(&mut b, (blocks(plan.bound, n.div_ceil(block_cols))?, 1), threads as u32, shared)?;
        }
        Ok(wrap(y, dev, (rows, n)))
    })
}

/// The grouped bf16/f16 kernel's dynamic shared memory (`Tile<TM>::shared_bytes` in the kernel):
/// 3 (64-row tiles) or 4 (128-row tiles) slices of K in flight, each `tile_rows` rows of x and
/// `BN` rows of w, of 32 + 8 (padding) 16-bit elements.
fn grouped_shared_bytes(tile_rows: usize) -> usize {
    let stages = if tile_rows == TILE_ROWS[1] { 4 } else { 3 };
    stages * (tile_rows + BN) * (32 + 8) * 2
}

/// Hopper's grouped kernels' dynamic shared memory (`WgTile<TM>::SHARED` in the kernel): 4 slices
/// of K in flight, each `tile_rows` rows of x and 256 of w, of 64 16-bit elements, and 1 KiB to
/// align the tiles to their swizzle.
fn wg_shared_bytes(tile_rows: usize) -> usize {
    4 * (tile_rows + WG_BN) * 64 * 2 + 1024
}

/// Whether the grouped bf16/f16 products run on Hopper's warpgroup kernels on `device`: the
/// build carries machine code for capability 90 (compiled as `sm_90a`) and the GPU is a 9.0 one
/// (H100, H200; the `sm_90a` code runs on no other).
pub fn hopper_kernels(device: &Device) -> bool {
    let built = super::module::ARCHS.split_whitespace().next().unwrap_or("").split(',').any(|a| a == "90");
    built && super::fp8::compute_capability(device) == Some((9, 0))
}

/// The grouped kernels' blocks: every column block of every tile bound, a tile's column blocks
/// consecutive (one grid dimension, which takes up to 2^31 - 1 blocks).
fn blocks(tiles: usize, col_blocks: usize) -> candle_core::Result<u32> {
    tiles
        .checked_mul(col_blocks)
        .and_then(|b| u32::try_from(b).ok())
        .filter(|&b| b < i32::MAX as u32)
        .ok_or_else(|| candle_core::Error::Msg(format!("grouped matmul: {tiles} tiles x {col_blocks} column blocks")))
}

/// FP8 experts stacked for the grouped FP8 kernel: e4m3 bytes `q` `[E, N', K]` (U8; N' = 2N,
/// gate rows first, for the SwiGLU projection) and block scales `scale` `[E, N'/128, Kb4]` (f32,
/// each expert's [`super::fp8::Fp8Weight`] scales, rows padded to Kb4).
pub struct Fp8Experts {
    pub q: Tensor,
    pub scale: Tensor,
}

impl Fp8Experts {
    /// The experts' weights, each `[N', K]` with its scales, stacked.
    pub fn stack(weights: &[&super::fp8::Fp8Weight]) -> candle_core::Result<Self> {
        let q: Vec<&Tensor> = weights.iter().map(|w| &w.q).collect();
        let s: Vec<&Tensor> = weights.iter().map(|w| &w.scale).collect();
        Ok(Fp8Experts { q: Tensor::stack(&q, 0)?, scale: Tensor::stack(&s, 0)? })
    }
}

/// Whether the grouped FP8 kernel serves experts of `hidden` x `inter` in `dtype` on `device`:
/// both multiples of 128 (whole scale blocks per tile), a GPU with FP8 tensor cores (sm_89+).
pub fn fp8_supported(device: &Device, dtype: DType, hidden: usize, inter: usize) -> bool {
    let sm = super::fp8::compute_capability(device).map_or(0, |(major, minor)| major * 10 + minor);
    matches!(dtype, DType::BF16 | DType::F16) && hidden.is_multiple_of(128) && inter.is_multiple_of(128) && sm >= 89
}

/// `silu(x W_gate^T) * (x W_up^T)` for every row of the plan from the FP8 experts `gate_up`
/// (`[E, 2N, K]`), `x` the tokens quantised by [`super::fp8::quantise`] (`xq` `[m_pad, K]`,
/// `xs` `[K/128, m_pad]`). Returns `[T k, N]` in `dtype`, in the plan's row order.
pub fn grouped_fp8_swiglu(
    xq: &Tensor,
    xs: &Tensor,
    gate_up: &Fp8Experts,
    plan: &Plan,
    dtype: DType,
) -> candle_core::Result<Tensor> {
    grouped_fp8(xq, xs, gate_up, plan, true, dtype)
}

/// `x[r] W_e^T` for every row r of the plan from the FP8 experts `w` (`[E, N, K]`), `x` `[T k,
/// K]` in the plan's row order quantised by [`super::fp8::quantise`]. Returns `[T k, N]`.
pub fn grouped_fp8_matmul(
    xq: &Tensor,
    xs: &Tensor,
    w: &Fp8Experts,
    plan: &Plan,
    dtype: DType,
) -> candle_core::Result<Tensor> {
    grouped_fp8(xq, xs, w, plan, false, dtype)
}

fn grouped_fp8(
    xq: &Tensor,
    xs: &Tensor,
    w: &Fp8Experts,
    plan: &Plan,
    swiglu: bool,
    dtype: DType,
) -> candle_core::Result<Tensor> {
    let (m_pad, k) = xq.dims2()?;
    let (groups, xs_ld) = xs.dims2()?;
    let (_, wn, kw) = w.q.dims3()?;
    let (_, wnb, ws_ld) = w.scale.dims3()?;
    let rows = plan.t * plan.k;
    let n = if swiglu { wn / 2 } else { wn };
    let want_rows = if swiglu { plan.t } else { rows };
    if plan.tile_rows != TILE_ROWS[0] {
        candle_core::bail!(
            "grouped fp8 matmul: a plan in tiles of {} rows (it takes {})",
            plan.tile_rows,
            TILE_ROWS[0]
        );
    }
    if kw != k
        || !k.is_multiple_of(128)
        || !n.is_multiple_of(128)
        || groups != k / 128
        || xs_ld != m_pad
        || m_pad < want_rows
        || wnb != wn / 128
        || ws_ld < groups
        || xq.dtype() != DType::U8
        || w.q.dtype() != DType::U8
        || xs.dtype() != DType::F32
        || w.scale.dtype() != DType::F32
    {
        candle_core::bail!(
            "grouped fp8 matmul: x {:?} (scales {:?}) and w {:?} (scales {:?}) do not fit a plan of {rows} rows",
            xq.shape(),
            xs.shape(),
            w.q.shape(),
            w.scale.shape()
        );
    }
    let (xq, xs, wq, wsc) = (xq.contiguous()?, xs.contiguous()?, w.q.contiguous()?, w.scale.contiguous()?);
    let aligned = |t: &Tensor| t.layout().start_offset().is_multiple_of(16);
    if !aligned(&xq) || !aligned(&wq) {
        candle_core::bail!("grouped fp8 matmul: x and w must start 16-byte aligned");
    }
    let dev = cuda_device(&xq, "grouped fp8 matmul")?;
    let (n_i, k_i) = (as_i32(n, "columns")?, as_i32(k, "the reduction")?);
    let (xs_ld_i, ws_ld_i) = (as_i32(xs_ld, "the scales' stride")?, as_i32(ws_ld, "the scales' stride")?);
    let block_cols = if swiglu { BN_SWIGLU } else { BN };
    let (xqs, xql) = xq.storage_and_layout();
    let (xss, xsl) = xs.storage_and_layout();
    let (wqs, wql) = wq.storage_and_layout();
    let (wss, wsl) = wsc.storage_and_layout();
    let (ts, tl) = plan.tiles.storage_and_layout();
    let (cs, cl) = plan.n_tiles.storage_and_layout();
    let (gs, gl) = plan.tokens.storage_and_layout();
    let xqv = cuda_view::<u8>(&xqs, xql, "x")?;
    let xsv = cuda_view::<f32>(&xss, xsl, "x's scales")?;
    let wqv = cuda_view::<u8>(&wqs, wql, "w")?;
    let wsv = cuda_view::<f32>(&wss, wsl, "w's scales")?;
    let tiles = cuda_view::<u32>(&ts, tl, "the tile list")?;
    let n_tiles = cuda_view::<u32>(&cs, cl, "the tile count")?;
    let gather = cuda_view::<u32>(&gs, gl, "the rows' tokens")?;
    half_type!(dtype, H, {
        // SAFETY: the tiles cover every row of the plan once, and each writes all n columns of
        // its rows.
        let y = unsafe { dev.alloc::<H>(rows * n)? };
        if rows > 0 {
            let name = kernel_name::<H>(if swiglu { "grouped_fp8_swiglu" } else { "grouped_fp8_mm" });
            let f = kernel(dev, MOE, &name)?;
            let mut b = f.builder();
            let null = 0u64;
            b.arg(&xqv).arg(&xsv).arg(&xs_ld_i);
            if swiglu {
                b.arg(&gather);
            } else {
                b.arg(&null);
            }
            b.arg(&wqv).arg(&wsv).arg(&ws_ld_i).arg(&y).arg(&tiles).arg(&n_tiles).arg(&n_i).arg(&k_i);
            launch(&mut b, (blocks(plan.bound, n.div_ceil(block_cols))?, 1), 128)?;
        }
        Ok(wrap(y, dev, (rows, n)))
    })
}

/// The layer's output `[T, H]`: for each token the sum over its slots, best first, of
/// `weights[t, j] * ys[row_of(j, t)]` in f32, plus `shared_y * sigmoid(x . gate)` when
/// `shared` is `(shared_y [T, H], x [T, H], gate [H])`, rounded once to `ys`' type.
pub fn combine(
    ys: &Tensor,
    plan: &Plan,
    weights: &Tensor,
    shared: Option<(&Tensor, &Tensor, &Tensor)>,
) -> candle_core::Result<Tensor> {
    let (ys, weights) = (ys.contiguous()?, weights.contiguous()?);
    let (rows, h) = ys.dims2()?;
    let (t, k) = (plan.t, plan.k);
    if rows != t * k || weights.dims2()? != (t, k) || weights.dtype() != DType::F32 || h % 8 != 0 {
        candle_core::bail!("combine: ys {:?}, weights {:?} and a plan of {t} x {k}", ys.shape(), weights.shape());
    }
    let shared = match shared {
        Some((y, x, g)) => {
            let (y, x, g) = (y.contiguous()?, x.contiguous()?, g.flatten_all()?.contiguous()?);
            if y.dims2()? != (t, h) || x.dims2()? != (t, h) || g.dim(0)? != h {
                candle_core::bail!(
                    "combine: the shared expert's {:?}, x {:?}, gate {:?}",
                    y.shape(),
                    x.shape(),
                    g.shape()
                );
            }
            Some((y, x, g))
        }
        None => None,
    };
    let dev = cuda_device(&ys, "moe combine")?;
    let (ys_s, ys_l) = ys.storage_and_layout();
    let (ro_s, ro_l) = plan.row_of.storage_and_layout();
    let (w_s, w_l) = weights.storage_and_layout();
    let row_of = cuda_view::<u32>(&ro_s, ro_l, "the rows of the slots")?;
    let wv = cuda_view::<f32>(&w_s, w_l, "the routing weights")?;
    let (t_i, h_i, k_i) = (as_i32(t, "tokens")?, as_i32(h, "hidden")?, k as i32);
    half_type!(ys.dtype(), H, {
        let yv = cuda_view::<H>(&ys_s, ys_l, "the experts' outputs")?;
        // SAFETY: one block per token writes all h columns of its row.
        let out = unsafe { dev.alloc::<H>(t * h)? };
        if t > 0 {
            let f = kernel(dev, MOE, &kernel_name::<H>("moe_combine"))?;
            let mut b = f.builder();
            b.arg(&yv).arg(&row_of).arg(&wv);
            let null = 0u64;
            let held = shared
                .as_ref()
                .map(|(y, x, g)| (y.storage_and_layout(), x.storage_and_layout(), g.storage_and_layout()));
            let views = match &held {
                Some(((ys2, yl2), (xs2, xl2), (gs2, gl2))) => Some((
                    cuda_view::<H>(ys2, yl2, "the shared expert's output")?,
                    cuda_view::<H>(xs2, xl2, "x")?,
                    cuda_view::<H>(gs2, gl2, "the shared expert's gate")?,
                )),
                None => None,
            };
            match &views {
                Some((y, x, g)) => {
                    b.arg(y).arg(x).arg(g);
                }
                None => {
                    b.arg(&null).arg(&null).arg(&null);
                }
            }
            b.arg(&out).arg(&t_i).arg(&h_i).arg(&k_i);
            launch(&mut b, (t as u32, 1), 256)?;
        }
        Ok(wrap(out, dev, (t, h)))
    })
}
