//! The Gated DeltaNet's CUDA kernels (`kernels/gdn.cu`): the conv + SiLU + l2norm + gates of
//! every token, the chunk-local UT solve of every chunk, and the recurrent scan of every
//! sequence, three launches per layer over the whole packed batch. Everything is f32 from the
//! projections' outputs on, as on the portable path (`layers::delta_rule`), which stays the
//! definition the kernel tests compare against; for bf16 and f16 models the chunk products run
//! on tensor cores with TF32 operands ([`Products`]). `EngineOptions::cuda_gdn` turns the kernels
//! off, `EngineOptions::gdn_tf32` keeps every product in f32.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Device, Layout, Shape, Tensor};

use super::module::{fatbin, kernel, Module};
use super::{contiguous_view, cpu_fwd_cuda_only, cuda_view, kernel_name, KernelType};
use crate::engine::config::{LinearAttentionConfig, GDN_CHUNK};
use crate::engine::profile::{self, Phase, Profiler};

/// `kernels/gdn.cu`.
const GDN: Module = fatbin!("gdn");

/// Value columns per scan block (`BV` in the kernel; `BVT` in the tensor-core one).
const BV: usize = 32;
const BVT: usize = 64;
const THREADS: u32 = 256;
/// Tokens per conv block (`CONV_TOKENS`), and the longest conv its registers hold (`CONV_MAX`).
const CONV_TOKENS: usize = 16;
const CONV_MAX: usize = 8;
/// The most sequences one scan launch takes (its grid z dimension, capped at 65,535 by the
/// device); a batch of more launches the scan over slices of its sequence table.
const SEQS_PER_SCAN: usize = 65535;
/// The most dynamic shared memory one block may use on sm_80 and newer.
const MAX_SHARED: usize = 227 * 1024;

fn local_shared(dk: usize, dv: usize) -> usize {
    4 * (GDN_CHUNK * ((2 * dk).max(dk + dv) + 4) + GDN_CHUNK * 65 + 2 * GDN_CHUNK)
}

fn scan_shared(dk: usize) -> usize {
    let (st, kt) = (dk + 4, GDN_CHUNK + 4);
    4 * ((GDN_CHUNK * st).max(dk * kt) + GDN_CHUNK * st + GDN_CHUNK * kt + GDN_CHUNK * BV + dk * BV + GDN_CHUNK)
}

/// The tensor-core kernels' shared memory: `gdn_chunk_local_tc` and `gdn_chunk_scan_tc`.
fn local_tc_shared(dk: usize, dv: usize) -> usize {
    4 * (GDN_CHUNK * (dk.max(dv) + 4) + GDN_CHUNK * (dk + 4) + 2 * GDN_CHUNK * 68 + 3 * GDN_CHUNK)
}

fn scan_tc_shared(dk: usize) -> usize {
    4 * (2 * GDN_CHUNK * (dk + 4)
        + GDN_CHUNK * (dk + 8)
        + GDN_CHUNK * 68
        + (GDN_CHUNK + dk) * (BVT + 8)
        + 2 * GDN_CHUNK)
}

/// How the chunk products (K K^T, Q K^T, the solve's right-hand sides, and the scan's products
/// with the state) are computed. The triangular inverse, the decays and the state are f32 either
/// way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Products {
    /// f32 on the CUDA cores: the portable path's arithmetic.
    F32,
    /// Tensor cores, operands rounded to TF32 (11 significant bits), f32 accumulation. For models
    /// computed in bf16 (8 bits) or f16 (11 bits), whose q, k and v were rounded to fewer or as
    /// many bits by their projections.
    Tf32,
}

impl Products {
    /// [`Products::Tf32`] for bf16 and f16 models when `tf32` (`EngineOptions::gdn_tf32`); f32
    /// otherwise.
    pub fn for_dtype(dtype: DType, tf32: bool) -> Self {
        match dtype {
            DType::BF16 | DType::F16 if tf32 => Products::Tf32,
            _ => Products::F32,
        }
    }
}

/// Whether the tensor-core kernels serve this layer shape (the f32 ones serve it otherwise).
pub fn tensor_cores_fit(d: &LinearAttentionConfig) -> bool {
    let (dk, dv) = (d.key_head_dim, d.value_head_dim);
    dk % 16 == 0 && dv % 8 == 0 && local_tc_shared(dk, dv) <= MAX_SHARED && scan_tc_shared(dk) <= MAX_SHARED
}

/// Whether the kernels serve this layer shape on `device` (`EngineOptions::cuda_gdn` can still
/// turn them off).
pub fn supported(device: &Device, d: &LinearAttentionConfig) -> bool {
    let (dk, dv) = (d.key_head_dim, d.value_head_dim);
    device.is_cuda()
        && d.num_key_heads > 0
        && d.num_value_heads.is_multiple_of(d.num_key_heads)
        && dk.max(dv) <= 1024
        && (1..=CONV_MAX).contains(&d.conv_kernel)
        && dk % 4 == 0
        && local_shared(dk, dv) <= MAX_SHARED
        && scan_shared(dk) <= MAX_SHARED
}

/// The batch's layout for the kernels: each token's position in its sequence, the chunks
/// (first token, tokens) in sequence order, and the sequences (first token, tokens, first chunk).
pub struct Tables {
    pos: Tensor,
    chunks: Tensor,
    seqs: Tensor,
    n_chunks: usize,
    n_seqs: usize,
}

impl Tables {
    pub fn new(seqs: &[(usize, usize)], device: &Device) -> candle_core::Result<Self> {
        let pos: Vec<u32> = seqs.iter().flat_map(|&(_, len)| 0..len as u32).collect();
        let (mut chunks, mut list) = (Vec::new(), Vec::new());
        for &(start, len) in seqs.iter().filter(|s| s.1 > 0) {
            list.extend([start as u32, len as u32, (chunks.len() / 2) as u32]);
            for c in 0..len.div_ceil(GDN_CHUNK) {
                chunks.extend([(start + c * GDN_CHUNK) as u32, (len - c * GDN_CHUNK).min(GDN_CHUNK) as u32]);
            }
        }
        Ok(Tables {
            n_chunks: chunks.len() / 2,
            n_seqs: list.len() / 3,
            pos: Tensor::new(pos.as_slice(), device)?,
            chunks: Tensor::new(chunks.as_slice(), device)?,
            seqs: Tensor::new(list.as_slice(), device)?,
        })
    }
}

/// `t` as the kernels read it: row-major rows, possibly spaced apart (a view of a wider tensor,
/// kept as is); any other layout is copied.
fn rowwise(t: &Tensor) -> candle_core::Result<Tensor> {
    let st = t.stride();
    if t.rank() == 2 && st[1] == 1 && (t.dim(0)? <= 1 || st[0] >= t.dim(1)?) {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

/// One layer as the kernels take it: the weights they read (on the device, f32) and how its
/// chunk products are computed.
pub struct GdnWeights<'a> {
    /// `[conv_dim, kernel]`: `w[c][kernel - 1]` multiplies the token itself.
    pub conv: &'a Tensor,
    /// `-exp(A_log)`, `[value_heads]`.
    pub neg_a: &'a Tensor,
    pub dt_bias: &'a Tensor,
    /// See [`Products`]; shapes the tensor-core kernels do not serve use f32.
    pub products: Products,
}

/// `qkv`: `[T, >= conv_dim]` (the q, k, v channels first), `b`, `a`: `[T, >= value_heads]`,
/// all of the compute dtype with unit stride along the last dimension (views of a fused
/// projection's output are fine). Returns the delta rule's output `[T, value_heads, dv]`, f32.
/// With `profile` on, each launch's time is charged to its phase ([`Phase::GdnConv`],
/// [`Phase::GdnLocal`], [`Phase::GdnScan`]).
pub fn forward(
    qkv: &Tensor,
    b: &Tensor,
    a: &Tensor,
    w: &GdnWeights<'_>,
    tables: &Tables,
    d: &LinearAttentionConfig,
    profile: &Profiler,
) -> candle_core::Result<Tensor> {
    let (qkv, b, a) = (rowwise(qkv)?, rowwise(b)?, rowwise(a)?);
    let op = GdnOp {
        conv: w.conv.contiguous()?,
        neg_a: w.neg_a.contiguous()?,
        dt_bias: w.dt_bias.contiguous()?,
        pos: tables.pos.clone(),
        chunks: tables.chunks.clone(),
        seqs: tables.seqs.clone(),
        n_chunks: tables.n_chunks,
        n_seqs: tables.n_seqs,
        tensor_cores: w.products == Products::Tf32 && tensor_cores_fit(d),
        timed: profile.is_on(),
        d: d.clone(),
    };
    qkv.apply_op3_no_bwd(&b, &a, &op)
}

struct GdnOp {
    conv: Tensor,
    neg_a: Tensor,
    dt_bias: Tensor,
    pos: Tensor,
    chunks: Tensor,
    seqs: Tensor,
    n_chunks: usize,
    n_seqs: usize,
    tensor_cores: bool,
    /// Time each launch (see [`Timer`]).
    timed: bool,
    d: LinearAttentionConfig,
}

/// `(rows, leading dimension, view from the first element)` of a `[rows, cols]` input whose
/// rows may be spaced apart (a narrow of a wider tensor).
fn rows<'a, T: DeviceRepr>(
    s: &'a CudaSlice<T>,
    l: &Layout,
    cols: usize,
    what: &str,
) -> candle_core::Result<(usize, usize, CudaView<'a, T>)> {
    let (r, c) = l.shape().dims2()?;
    let st = l.stride();
    if c < cols || st[1] != 1 || (r > 1 && st[0] < c) {
        candle_core::bail!(
            "gated deltanet kernels: {what} {:?} (strides {st:?}) needs {cols} unit-stride columns",
            l.shape()
        );
    }
    let ld = if r > 1 { st[0] } else { c };
    let len = if r == 0 { 0 } else { (r - 1) * ld + c };
    Ok((r, ld, s.slice(l.start_offset()..l.start_offset() + len)))
}

/// When profiling, the time of one launch (the stream drained before and after).
struct Timer(Option<std::time::Instant>);

impl Timer {
    fn start(on: bool) -> Self {
        Timer(on.then(std::time::Instant::now))
    }

    fn stop(self, dev: &CudaDevice, phase: Phase) -> candle_core::Result<()> {
        if let Some(t) = self.0 {
            dev.cuda_stream().synchronize().w()?;
            profile::add(phase, t.elapsed().as_secs_f64());
        }
        Ok(())
    }
}

impl GdnOp {
    fn launch<T: KernelType>(
        &self,
        dev: &CudaDevice,
        x: (&CudaSlice<T>, &Layout),
        b: (&CudaSlice<T>, &Layout),
        a: (&CudaSlice<T>, &Layout),
    ) -> candle_core::Result<CudaSlice<f32>> {
        let d = &self.d;
        let (nk, nv, dk, dv) = (d.num_key_heads, d.num_value_heads, d.key_head_dim, d.value_head_dim);
        let conv_dim = 2 * nk * dk + nv * dv;
        let (t, ldx, xv) = rows(x.0, x.1, conv_dim, "qkv")?;
        let (tb, ldb, bv) = rows(b.0, b.1, nv, "b")?;
        let (ta, lda, av) = rows(a.0, a.1, nv, "a")?;
        if tb != t || ta != t || self.pos.dim(0)? != t {
            candle_core::bail!(
                "gated deltanet kernels: {t} tokens of qkv, {tb} of b, {ta} of a, {} in the batch",
                self.pos.dim(0)?
            );
        }
        let (conv_s, conv_l) = self.conv.storage_and_layout();
        let conv = cuda_view::<f32>(&conv_s, conv_l, "the conv weight")?;
        let kernel_size = self.conv.dim(1)?;
        if !(1..=CONV_MAX).contains(&kernel_size) {
            candle_core::bail!("gated deltanet kernels: a conv of {kernel_size} taps (1 to {CONV_MAX} fit)");
        }
        let (a_s, a_l) = self.neg_a.storage_and_layout();
        let neg_a = cuda_view::<f32>(&a_s, a_l, "A")?;
        let (dt_s, dt_l) = self.dt_bias.storage_and_layout();
        let dt_bias = cuda_view::<f32>(&dt_s, dt_l, "dt_bias")?;
        let (pos_s, pos_l) = self.pos.storage_and_layout();
        let pos = cuda_view::<u32>(&pos_s, pos_l, "the positions")?;
        let (ch_s, ch_l) = self.chunks.storage_and_layout();
        let chunks = cuda_view::<u32>(&ch_s, ch_l, "the chunk table")?;
        let (sq_s, sq_l) = self.seqs.storage_and_layout();
        let seqs = cuda_view::<u32>(&sq_s, sq_l, "the sequence table")?;
        let out = unsafe { dev.alloc::<f32>(t * nv * dv)? };
        if t == 0 {
            return Ok(out);
        }
        // SAFETY (all allocations below): every element is written by a kernel before it is read
        // (the conv kernel writes every channel of every token and every gate; the local kernel
        // every row of every chunk, zeros past a sequence's end; the scan every token's output).
        let mixed = unsafe { dev.alloc::<f32>(t * conv_dim)? };
        let beta = unsafe { dev.alloc::<f32>(t * nv)? };
        let g = unsafe { dev.alloc::<f32>(t * nv)? };
        let ch = self.n_chunks * nv;
        let gcum = unsafe { dev.alloc::<f32>(ch * GDN_CHUNK)? };
        let wk = unsafe { dev.alloc::<f32>(ch * GDN_CHUNK * dk)? };
        let u = unsafe { dev.alloc::<f32>(ch * GDN_CHUNK * dv)? };
        let p = unsafe { dev.alloc::<f32>(ch * GDN_CHUNK * GDN_CHUNK)? };
        let (nk_i, nv_i, dk_i, dv_i) = (nk as i32, nv as i32, dk as i32, dv as i32);

        let f = kernel(dev, GDN, &kernel_name::<T>("gdn_conv"))?;
        let mut l = f.builder();
        let (ldx_i, k_i, ldb_i, lda_i) = (ldx as i32, kernel_size as i32, ldb as i32, lda as i32);
        let q_scale = (dk as f64).powf(-0.5) as f32;
        l.arg(&xv);
        l.arg(&ldx_i);
        l.arg(&conv);
        l.arg(&k_i);
        l.arg(&pos);
        l.arg(&bv);
        l.arg(&ldb_i);
        l.arg(&av);
        l.arg(&lda_i);
        l.arg(&neg_a);
        l.arg(&dt_bias);
        l.arg(&mixed);
        l.arg(&beta);
        l.arg(&g);
        let t_i = t as i32;
        l.arg(&t_i);
        l.arg(&nk_i);
        l.arg(&nv_i);
        l.arg(&dk_i);
        l.arg(&dv_i);
        l.arg(&q_scale);
        let hd = dk.max(dv).div_ceil(32) * 32;
        let cfg = LaunchConfig {
            grid_dim: (t.div_ceil(CONV_TOKENS) as u32, (2 * nk + nv) as u32, 1),
            block_dim: (hd as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let timed = Timer::start(self.timed);
        // SAFETY: arguments match the kernel's signature; every index it forms is below t rows
        // of the views, conv_dim channels and nv heads.
        unsafe { l.launch(cfg) }.w()?;
        timed.stop(dev, Phase::GdnConv)?;

        let tc = if self.tensor_cores { "_tc" } else { "" };
        let f = kernel(dev, GDN, &format!("gdn_chunk_local{tc}"))?;
        let bytes = if self.tensor_cores { local_tc_shared(dk, dv) } else { local_shared(dk, dv) };
        f.max_dynamic_shared(bytes)?;
        let mut l = f.builder();
        l.arg(&mixed);
        l.arg(&beta);
        l.arg(&g);
        l.arg(&chunks);
        l.arg(&gcum);
        l.arg(&wk);
        l.arg(&u);
        l.arg(&p);
        l.arg(&nk_i);
        l.arg(&nv_i);
        l.arg(&dk_i);
        l.arg(&dv_i);
        let cfg = LaunchConfig {
            grid_dim: (self.n_chunks as u32, nv as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: bytes as u32,
        };
        let timed = Timer::start(self.timed);
        // SAFETY: as above; the chunk table lists chunks inside the batch.
        unsafe { l.launch(cfg) }.w()?;
        timed.stop(dev, Phase::GdnLocal)?;

        let f = kernel(dev, GDN, &format!("gdn_chunk_scan{tc}"))?;
        let bytes = if self.tensor_cores { scan_tc_shared(dk) } else { scan_shared(dk) };
        f.max_dynamic_shared(bytes)?;
        let timed = Timer::start(self.timed);
        // Every sequence's entry holds its own first token and first chunk, so a slice of the
        // table is scanned as the whole one would be.
        for s0 in (0..self.n_seqs).step_by(SEQS_PER_SCAN) {
            let n = SEQS_PER_SCAN.min(self.n_seqs - s0);
            let part = seqs.slice(3 * s0..3 * (s0 + n));
            let mut l = f.builder();
            l.arg(&mixed);
            l.arg(&part);
            l.arg(&gcum);
            l.arg(&wk);
            l.arg(&u);
            l.arg(&p);
            l.arg(&out);
            l.arg(&nk_i);
            l.arg(&nv_i);
            l.arg(&dk_i);
            l.arg(&dv_i);
            let cfg = LaunchConfig {
                grid_dim: (dv.div_ceil(if self.tensor_cores { BVT } else { BV }) as u32, nv as u32, n as u32),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: bytes as u32,
            };
            // SAFETY: as above; the sequence table's chunks are those of the chunk table.
            unsafe { l.launch(cfg) }.w()?;
        }
        timed.stop(dev, Phase::GdnScan)?;
        Ok(out)
    }
}

impl candle_core::CustomOp3 for GdnOp {
    fn name(&self) -> &'static str {
        "gated-deltanet"
    }

    cpu_fwd_cuda_only!(3);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        b: &CudaStorage,
        bl: &Layout,
        a: &CudaStorage,
        al: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = x.device();
        let out = match (&x.slice, &b.slice, &a.slice) {
            (CudaStorageSlice::F32(xs), CudaStorageSlice::F32(bs), CudaStorageSlice::F32(as_)) => {
                self.launch(dev, (xs, xl), (bs, bl), (as_, al))?
            }
            (CudaStorageSlice::BF16(xs), CudaStorageSlice::BF16(bs), CudaStorageSlice::BF16(as_)) => {
                self.launch(dev, (xs, xl), (bs, bl), (as_, al))?
            }
            (CudaStorageSlice::F16(xs), CudaStorageSlice::F16(bs), CudaStorageSlice::F16(as_)) => {
                self.launch(dev, (xs, xl), (bs, bl), (as_, al))?
            }
            _ => candle_core::bail!(
                "gated deltanet kernels: qkv, b, a must share one of f32, bf16, f16, got {:?}, {:?}, {:?}",
                x.dtype(),
                b.dtype(),
                a.dtype()
            ),
        };
        let t = xl.shape().dims2()?.0;
        let d = &self.d;
        Ok((
            CudaStorage { slice: CudaStorageSlice::F32(out), device: dev.clone() },
            Shape::from((t, d.num_value_heads, d.value_head_dim)),
        ))
    }
}

/// `rms_norm(x) * w * silu(z)` over the value dimension, in f32, rounded once to `z`'s dtype:
/// `x` the delta rule's output `[T, value_heads, dv]` f32, `z` `[T, >= value_heads * dv]` (unit
/// stride along the last dimension), `w` `[dv]` f32. One launch; the same values as
/// `layers::norm::GatedRmsNorm` computes with separate ops.
pub fn gated_norm(x: &Tensor, z: &Tensor, w: &Tensor, eps: f32) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op2_no_bwd(&rowwise(z)?, &GatedNorm { w: w.contiguous()?, eps })
}

struct GatedNorm {
    w: Tensor,
    eps: f32,
}

impl GatedNorm {
    fn launch<T: KernelType>(
        &self,
        dev: &CudaDevice,
        x: (&CudaSlice<f32>, &Layout),
        z: (&CudaSlice<T>, &Layout),
    ) -> candle_core::Result<CudaSlice<T>> {
        let (t, nv, dv) = x.1.shape().dims3()?;
        let xv = contiguous_view(x.0, x.1, "gated norm: x")?;
        let (tz, ldz, zv) = rows(z.0, z.1, nv * dv, "z")?;
        if tz != t || self.w.dims() != [dv] || dv > 1024 {
            candle_core::bail!(
                "gated norm: x {:?}, z {:?}, w {:?} do not fit",
                x.1.shape(),
                z.1.shape(),
                self.w.dims()
            );
        }
        let (w_s, w_l) = self.w.storage_and_layout();
        let w = cuda_view::<f32>(&w_s, w_l, "the gated norm weight")?;
        // SAFETY: either kernel below writes every element (every row, every column of it).
        let out = unsafe { dev.alloc::<T>(t * nv * dv)? };
        if t * nv == 0 {
            return Ok(out);
        }
        // The warp-per-row kernel when every row of x, z, w and out starts on 4 elements (16
        // bytes for the f32 ones; allocations are aligned), with J groups of 4 columns a lane.
        let quads = dv.is_multiple_of(4)
            && ldz.is_multiple_of(4)
            && z.1.start_offset().is_multiple_of(4)
            && x.1.start_offset().is_multiple_of(4)
            && w_l.start_offset().is_multiple_of(4);
        if quads {
            let j = (dv / 4).div_ceil(32).next_power_of_two();
            let f = kernel(dev, GDN, &kernel_name::<T>(&format!("gdn_gated_norm4_{j}")))?;
            let mut l = f.builder();
            let (ldz_i, rows_i, nv_i, dv_i) = (ldz as i32, (t * nv) as i32, nv as i32, dv as i32);
            l.arg(&xv);
            l.arg(&zv);
            l.arg(&ldz_i);
            l.arg(&w);
            l.arg(&out);
            l.arg(&rows_i);
            l.arg(&nv_i);
            l.arg(&dv_i);
            l.arg(&self.eps);
            let cfg = LaunchConfig {
                grid_dim: ((t * nv).div_ceil(8) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: arguments match the kernel's signature; it reads groups of 4 below dv of
            // rows below t * nv, and writes every element of out (a warp per row).
            unsafe { l.launch(cfg) }.w()?;
            return Ok(out);
        }
        let f = kernel(dev, GDN, &kernel_name::<T>("gdn_gated_norm"))?;
        let mut l = f.builder();
        let (ldz_i, nv_i, dv_i) = (ldz as i32, nv as i32, dv as i32);
        l.arg(&xv);
        l.arg(&zv);
        l.arg(&ldz_i);
        l.arg(&w);
        l.arg(&out);
        l.arg(&nv_i);
        l.arg(&dv_i);
        l.arg(&self.eps);
        let cfg = LaunchConfig {
            grid_dim: ((t * nv) as u32, 1, 1),
            block_dim: (dv.div_ceil(32) as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match the kernel's signature; indices stay below t rows of z and x.
        unsafe { l.launch(cfg) }.w()?;
        Ok(out)
    }
}

impl candle_core::CustomOp2 for GatedNorm {
    fn name(&self) -> &'static str {
        "gated-rms-norm"
    }

    cpu_fwd_cuda_only!(2);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        z: &CudaStorage,
        zl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = x.device();
        let CudaStorageSlice::F32(xs) = &x.slice else {
            candle_core::bail!("gated norm: x must be f32, got {:?}", x.dtype())
        };
        let slice = match &z.slice {
            CudaStorageSlice::F32(zs) => CudaStorageSlice::F32(self.launch(dev, (xs, xl), (zs, zl))?),
            CudaStorageSlice::BF16(zs) => CudaStorageSlice::BF16(self.launch(dev, (xs, xl), (zs, zl))?),
            CudaStorageSlice::F16(zs) => CudaStorageSlice::F16(self.launch(dev, (xs, xl), (zs, zl))?),
            _ => candle_core::bail!("gated norm: z must be f32, bf16 or f16, got {:?}", z.dtype()),
        };
        Ok((CudaStorage { slice, device: dev.clone() }, xl.shape().clone()))
    }
}
