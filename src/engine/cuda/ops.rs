//! Fused element-wise kernels for CUDA (`kernels/ops.cu`).

use super::module::{fatbin, kernel, Module};
use super::{contiguous_view, cpu_fwd_cuda_only, cuda_device, cuda_view, kernel_name, tensor, KernelType};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Shape, Tensor};

/// `kernels/ops.cu`.
pub(super) const OPS: Module = fatbin!("ops");

/// `silu(gate) * up` where `gu` is `[rows, 2 * inter]` holding the gate projection then the up
/// projection (one matmul makes both). Returns `[rows, inter]`. `inter` must be a multiple of 8.
pub fn silu_mul(gu: &Tensor) -> candle_core::Result<Tensor> {
    gu.contiguous()?.apply_op1_no_bwd(&SiluMul)
}

struct SiluMul;

impl SiluMul {
    fn launch<T: KernelType>(dev: &CudaDevice, gu: &CudaSlice<T>, l: &Layout) -> candle_core::Result<CudaSlice<T>> {
        let (rows, two_inter) = l.shape().dims2()?;
        let inter = two_inter / 2;
        let vec = 16 / std::mem::size_of::<T>();
        if two_inter % 2 != 0 || inter % 8 != 0 || !l.start_offset().is_multiple_of(vec) {
            candle_core::bail!("silu_mul: [rows, 2*inter] contiguous with inter a multiple of 8, got {:?}", l.shape());
        }
        let src = contiguous_view(gu, l, "silu_mul: the gate and up projections")?;
        // SAFETY: the kernel writes every element of the output.
        let out = unsafe { dev.alloc::<T>(rows * inter)? };
        let func = kernel(dev, OPS, &kernel_name::<T>("silu_mul"))?;
        // The count in usize: an f32 [1M, 2 x 17408] input has 4.6 G vectors, past u32 (the
        // kernel strides over the grid with size_t indices).
        let vecs = rows * inter / vec;
        let cfg = LaunchConfig {
            grid_dim: (vecs.div_ceil(256).clamp(1, 65535 * 8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&src);
        b.arg(&out);
        let (r, i) = (rows, inter);
        b.arg(&r);
        b.arg(&i);
        if rows * inter > 0 {
            // SAFETY: argument types and order match the kernel (pointers, then two size_t).
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(out)
    }
}

impl candle_core::CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }

    cpu_fwd_cuda_only!(1);

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = s.device();
        let slice = match &s.slice {
            CudaStorageSlice::BF16(x) => CudaStorageSlice::BF16(Self::launch(dev, x, l)?),
            CudaStorageSlice::F16(x) => CudaStorageSlice::F16(Self::launch(dev, x, l)?),
            CudaStorageSlice::F32(x) => CudaStorageSlice::F32(Self::launch(dev, x, l)?),
            _ => candle_core::bail!("silu_mul: unsupported dtype {:?}", s.dtype()),
        };
        let (rows, two_inter) = l.shape().dims2()?;
        Ok((CudaStorage { slice, device: dev.clone() }, Shape::from((rows, two_inter / 2))))
    }
}

/// `x + y` in f32, for `x` f32 (the residual stream) and `y` bf16 or f16 (a sublayer's output).
pub fn add_f32(x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    if x.dims() != y.dims() {
        candle_core::bail!("add_f32: shapes {:?} and {:?} differ", x.dims(), y.dims());
    }
    x.contiguous()?.apply_op2_no_bwd(&y.contiguous()?, &AddF32)
}

/// RMSNorm of an f32 `[rows, cols]` tensor with a bf16/f16 weight `[cols]`, in the weight's type.
pub fn rms_norm_f32(x: &Tensor, w: &Tensor, eps: f32) -> candle_core::Result<Tensor> {
    rms_norm_f32_to(x, w, eps, w.dtype())
}

/// RMSNorm of an f32 `[rows, cols]` tensor written in `out` (bf16 or f16), with a weight `[cols]`
/// of that type or f32 (the hybrids' zero-centred norms keep `1 + w` in f32): `x / rms(x) * w`
/// in f32, rounded once.
pub fn rms_norm_f32_to(x: &Tensor, w: &Tensor, eps: f32, out: DType) -> candle_core::Result<Tensor> {
    let cols = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / cols.max(1);
    let y = x.contiguous()?.reshape((rows, cols))?.apply_op2_no_bwd(&w.contiguous()?, &RmsNormF32 { eps, out })?;
    y.reshape(x.dims())
}

/// The residual add and the RMSNorm after it in one kernel: for the f32 stream `x`, a 16-bit
/// sublayer output `y` of its shape and a weight `w` of `y`'s type or f32, returns `x + y`
/// (f32) and its RMSNorm in `y`'s type, bitwise what [`add_f32`] then [`rms_norm_f32_to`] give,
/// with one pass over memory instead of two.
pub fn add_rms_norm_f32(x: &Tensor, y: &Tensor, w: &Tensor, eps: f32) -> candle_core::Result<(Tensor, Tensor)> {
    let cols = x.dim(candle_core::D::Minus1)?;
    if x.dims() != y.dims()
        || w.dims() != [cols]
        || x.dtype() != DType::F32
        || !(w.dtype() == y.dtype() || w.dtype() == DType::F32)
    {
        candle_core::bail!(
            "add_rms_norm_f32: x {:?} {:?}, y {:?} {:?}, w {:?} {:?} do not fit",
            x.dims(),
            x.dtype(),
            y.dims(),
            y.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    let dev = cuda_device(x, "add_rms_norm_f32")?;
    let (x, y, w) = (x.contiguous()?, y.contiguous()?, w.contiguous()?);
    let rows = x.elem_count() / cols.max(1);
    // SAFETY: the kernel writes every element (one block per row, all of its columns).
    let x_out = unsafe { dev.alloc::<f32>(rows * cols)? };
    let f32w = w.dtype() == DType::F32;
    let normed = match (y.dtype(), f32w) {
        (DType::BF16, false) => {
            tensor(add_rms_norm_launch::<half::bf16, half::bf16>(dev, (&x, &y, &w), &x_out, rows, eps)?, dev, x.shape())
        }
        (DType::F16, false) => {
            tensor(add_rms_norm_launch::<half::f16, half::f16>(dev, (&x, &y, &w), &x_out, rows, eps)?, dev, x.shape())
        }
        (DType::BF16, true) => {
            tensor(add_rms_norm_launch::<half::bf16, f32>(dev, (&x, &y, &w), &x_out, rows, eps)?, dev, x.shape())
        }
        (DType::F16, true) => {
            tensor(add_rms_norm_launch::<half::f16, f32>(dev, (&x, &y, &w), &x_out, rows, eps)?, dev, x.shape())
        }
        (d, _) => candle_core::bail!("add_rms_norm_f32: the sublayer output must be bf16 or f16, got {d:?}"),
    };
    Ok((tensor(x_out, dev, x.shape()), normed))
}

/// The norm kernels' name for output type `T` and weight type `W`: `{base}_f32_{T}` where the
/// weight is `T`, `{base}_f32w_{T}` where it is f32.
fn norm_kernel<T: KernelType, W: 'static>(base: &str) -> String {
    let f32w = std::any::TypeId::of::<W>() == std::any::TypeId::of::<f32>();
    kernel_name::<T>(&format!("{base}_{}", if f32w { "f32w" } else { "f32" }))
}

/// Launches `add_rms_norm_f32{,w}_{bf16,f16}` on contiguous `x` (f32), `y` (`T`) and `w`
/// (`W`: `T` or f32), writing `x_out` and returning the normed rows.
fn add_rms_norm_launch<T: KernelType, W: CudaDType + DeviceRepr + 'static>(
    dev: &CudaDevice,
    (x, y, w): (&Tensor, &Tensor, &Tensor),
    x_out: &CudaSlice<f32>,
    rows: usize,
    eps: f32,
) -> candle_core::Result<CudaSlice<T>> {
    let cols = w.elem_count();
    let (xs, xl) = x.storage_and_layout();
    let (ys, yl) = y.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let xv = cuda_view::<f32>(&xs, xl, "add_rms_norm_f32: x")?;
    let yv = cuda_view::<T>(&ys, yl, "add_rms_norm_f32: y")?;
    let wv = cuda_view::<W>(&ws, wl, "add_rms_norm_f32: w")?;
    // SAFETY: the kernel writes every element.
    let normed = unsafe { dev.alloc::<T>(rows * cols)? };
    let func = kernel(dev, OPS, &norm_kernel::<T, W>("add_rms_norm"))?;
    let mut b = func.builder();
    b.arg(&xv);
    b.arg(&yv);
    b.arg(&wv);
    b.arg(x_out);
    b.arg(&normed);
    let (c, e) = (cols as i32, eps);
    b.arg(&c);
    b.arg(&e);
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    if rows * cols > 0 {
        // SAFETY: argument types and order match the kernel; x, y and both outputs hold rows x
        // cols elements and w cols, which covers every index it forms.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(normed)
}

struct AddF32;

impl AddF32 {
    fn launch<T: KernelType>(
        dev: &CudaDevice,
        x: &CudaSlice<f32>,
        xl: &Layout,
        y: &CudaSlice<T>,
        yl: &Layout,
    ) -> candle_core::Result<CudaSlice<f32>> {
        let n = xl.shape().elem_count();
        let x = contiguous_view(x, xl, "add_f32: x")?;
        let y = contiguous_view(y, yl, "add_f32: y")?;
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<f32>(n)? };
        let blocks = n.div_ceil(256).clamp(1, 1 << 20) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let func = kernel(dev, OPS, &kernel_name::<T>("add_f32"))?;
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&y);
        b.arg(&out);
        b.arg(&n);
        // SAFETY: argument types and order match the kernel.
        unsafe { b.launch(cfg) }.w()?;
        Ok(out)
    }
}

impl candle_core::CustomOp2 for AddF32 {
    fn name(&self) -> &'static str {
        "add-f32"
    }

    cpu_fwd_cuda_only!(2);

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        ys: &CudaStorage,
        yl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = xs.device();
        let CudaStorageSlice::F32(x) = &xs.slice else { candle_core::bail!("add_f32: x must be f32") };
        let out = match &ys.slice {
            CudaStorageSlice::BF16(y) => Self::launch(dev, x, xl, y, yl)?,
            CudaStorageSlice::F16(y) => Self::launch(dev, x, xl, y, yl)?,
            _ => candle_core::bail!("add_f32: y must be bf16 or f16"),
        };
        Ok((CudaStorage { slice: CudaStorageSlice::F32(out), device: dev.clone() }, xl.shape().clone()))
    }
}

struct RmsNormF32 {
    eps: f32,
    /// The output type (bf16 or f16); the weight is of this type or f32.
    out: DType,
}

impl RmsNormF32 {
    fn launch<T: KernelType, W: DeviceRepr + 'static>(
        &self,
        dev: &CudaDevice,
        x: &CudaSlice<f32>,
        xl: &Layout,
        w: &CudaSlice<W>,
        wl: &Layout,
    ) -> candle_core::Result<CudaSlice<T>> {
        let (rows, cols) = xl.shape().dims2()?;
        let x = contiguous_view(x, xl, "rms_norm_f32: x")?;
        let w = contiguous_view(w, wl, "rms_norm_f32: w")?;
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<T>(rows * cols)? };
        let func = kernel(dev, OPS, &norm_kernel::<T, W>("rms_norm"))?;
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (c, eps) = (cols as i32, self.eps);
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&w);
        b.arg(&out);
        b.arg(&c);
        b.arg(&eps);
        if rows > 0 {
            // SAFETY: argument types and order match the kernel.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(out)
    }
}

impl candle_core::CustomOp2 for RmsNormF32 {
    fn name(&self) -> &'static str {
        "rms-norm-f32"
    }

    cpu_fwd_cuda_only!(2);

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = xs.device();
        let cols = xl.shape().dims2()?.1;
        if wl.shape().elem_count() != cols {
            candle_core::bail!("rms_norm_f32: weight {:?} for rows of {cols}", wl.shape());
        }
        let CudaStorageSlice::F32(x) = &xs.slice else { candle_core::bail!("rms_norm_f32: x must be f32") };
        let slice = match (&ws.slice, self.out) {
            (CudaStorageSlice::BF16(w), DType::BF16) => CudaStorageSlice::BF16(self.launch(dev, x, xl, w, wl)?),
            (CudaStorageSlice::F16(w), DType::F16) => CudaStorageSlice::F16(self.launch(dev, x, xl, w, wl)?),
            (CudaStorageSlice::F32(w), DType::BF16) => {
                CudaStorageSlice::BF16(self.launch::<half::bf16, f32>(dev, x, xl, w, wl)?)
            }
            (CudaStorageSlice::F32(w), DType::F16) => {
                CudaStorageSlice::F16(self.launch::<half::f16, f32>(dev, x, xl, w, wl)?)
            }
            (_, out) => candle_core::bail!(
                "rms_norm_f32: a {:?} weight with {out:?} output (the weight is the output's 16-bit type or f32)",
                ws.dtype()
            ),
        };
        Ok((CudaStorage { slice, device: dev.clone() }, xl.shape().clone()))
    }
}

/// f32 values as fp8 (E4M3): round to nearest even, saturating at ±448, NaN kept. (Candle's own
/// cast to F8E4M3 on CUDA looks up a kernel name its kernels do not define.)
pub fn f32_to_fp8(x: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&F32ToFp8)
}

struct F32ToFp8;

impl candle_core::CustomOp1 for F32ToFp8 {
    fn name(&self) -> &'static str {
        "f32-to-fp8"
    }

    cpu_fwd_cuda_only!(1);

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = s.device();
        let x = match &s.slice {
            CudaStorageSlice::F32(x) => contiguous_view(x, l, "f32_to_fp8: x")?,
            _ => candle_core::bail!("f32_to_fp8: x must be f32"),
        };
        let n = l.shape().elem_count();
        // SAFETY: the kernel writes every element of the output.
        let out = unsafe { dev.alloc::<float8::F8E4M3>(n)? };
        let func = kernel(dev, OPS, "f32_to_fp8_e4m3")?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, 65535 * 8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&out);
        b.arg(&n);
        if n > 0 {
            // SAFETY: argument types and order match the kernel (two pointers, then a size_t).
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((CudaStorage { slice: CudaStorageSlice::F8E4M3(out), device: dev.clone() }, l.shape().clone()))
    }
}

/// `[rows]` u8, 1 where a row of `x` (`[rows, cols]` bf16, f16 or f32) holds an infinity or a
/// NaN, else 0: the exponent bits read directly, one pass over the values, a warp per row (64-bit
/// indices, so no slicing of long batches).
pub fn nonfinite_rows(x: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&NonfiniteRows)
}

struct NonfiniteRows;

impl NonfiniteRows {
    fn launch<T: KernelType>(dev: &CudaDevice, x: &CudaSlice<T>, l: &Layout) -> candle_core::Result<CudaSlice<u8>> {
        let (rows, cols) = l.shape().dims2()?;
        let xv = contiguous_view(x, l, "nonfinite_rows: x")?;
        // SAFETY: the kernel writes every element (a warp per row).
        let out = unsafe { dev.alloc::<u8>(rows)? };
        if rows == 0 {
            return Ok(out);
        }
        let size = std::mem::size_of::<T>();
        // 16-byte loads when every row starts on a 16-byte boundary (allocations are aligned).
        let vec = i32::from((cols * size).is_multiple_of(16) && (l.start_offset() * size).is_multiple_of(16));
        let blocks = rows.div_ceil(8);
        if blocks > u32::MAX as usize / 2 {
            candle_core::bail!("nonfinite_rows: {rows} rows are more than one launch takes");
        }
        let func = kernel(dev, OPS, &kernel_name::<T>("nonfinite_rows"))?;
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut b = func.builder();
        b.arg(&xv);
        b.arg(&out);
        b.arg(&rows);
        b.arg(&cols);
        b.arg(&vec);
        // SAFETY: argument types and order match the kernel (two pointers, two size_t, an int).
        unsafe { b.launch(cfg) }.w()?;
        Ok(out)
    }
}

impl candle_core::CustomOp1 for NonfiniteRows {
    fn name(&self) -> &'static str {
        "nonfinite-rows"
    }

    cpu_fwd_cuda_only!(1);

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = s.device();
        let out = match &s.slice {
            CudaStorageSlice::BF16(x) => Self::launch(dev, x, l)?,
            CudaStorageSlice::F16(x) => Self::launch(dev, x, l)?,
            CudaStorageSlice::F32(x) => Self::launch(dev, x, l)?,
            _ => candle_core::bail!("nonfinite_rows: unsupported dtype {:?}", s.dtype()),
        };
        Ok((CudaStorage { slice: CudaStorageSlice::U8(out), device: dev.clone() }, Shape::from(l.shape().dims2()?.0)))
    }
}

/// Rows of a 2-D tensor copied by a kernel that indexes in 64 bits (candle's copy and gather
/// kernels index in 32, and wrap past 2^32 elements): `src` `[R, C]` with unit stride along its
/// rows and any row stride (a column slice of a wider tensor is fine). With `idx` (`[n]` u32 on
/// the same device, each below R) row `idx[i]` of `src` becomes row `i`; without, every row is
/// copied in order. Returns a new contiguous `[n, C]` (or `[R, C]`), bitwise the rows it copied.
pub fn copy_rows(src: &Tensor, idx: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let dev = cuda_device(src, "copy_rows")?;
    let cols = src.dim(1)?;
    let rows = match idx {
        Some(i) => i.dim(0)?,
        None => src.dim(0)?,
    };
    macro_rules! run {
        ($t:ty) => {{
            // SAFETY: the kernel writes every element (each of the rows, all of its columns).
            let mut out = unsafe { dev.alloc::<$t>(rows * cols)? };
            copy_rows_into::<$t>(dev, src, idx, &mut out, 0, cols)?;
            Ok(tensor(out, dev, (rows, cols)))
        }};
    }
    match src.dtype() {
        DType::BF16 => run!(half::bf16),
        DType::F16 => run!(half::f16),
        DType::F32 => run!(f32),
        DType::U32 => run!(u32),
        DType::U8 => run!(u8),
        DType::F8E4M3 => run!(float8::F8E4M3),
        d => candle_core::bail!("copy_rows: unsupported dtype {d:?}"),
    }
}

/// `[T, L, H]` from `L` tensors `[T, H]` of one dtype: what `Tensor::stack(parts, 1)` gives, by
/// one row-copy launch per part (64-bit indices: the stack of many long taps passes 2^32
/// elements, where candle's copy wraps).
pub fn stack_rows(parts: &[Tensor]) -> candle_core::Result<Tensor> {
    let Some(first) = parts.first() else { candle_core::bail!("stack_rows: no tensors") };
    let dev = cuda_device(first, "stack_rows")?;
    let (t, h) = first.dims2()?;
    let l = parts.len();
    if parts.iter().any(|p| p.dims() != [t, h] || p.dtype() != first.dtype()) {
        candle_core::bail!("stack_rows: every part must be [{t}, {h}] {:?}", first.dtype());
    }
    macro_rules! run {
        ($t:ty) => {{
            // SAFETY: part `j` writes columns j H .. (j + 1) H of every row: together, every element.
            let mut out = unsafe { dev.alloc::<$t>(t * l * h)? };
            for (j, p) in parts.iter().enumerate() {
                copy_rows_into::<$t>(dev, p, None, &mut out, j * h, l * h)?;
            }
            Ok(tensor(out, dev, (t, l, h)))
        }};
    }
    match first.dtype() {
        DType::BF16 => run!(half::bf16),
        DType::F16 => run!(half::f16),
        DType::F32 => run!(f32),
        DType::U8 => run!(u8),
        d => candle_core::bail!("stack_rows: unsupported dtype {d:?}"),
    }
}

/// Copies the rows of `src` (`[R, C]`, unit column stride), or those `idx` picks, into `dst`:
/// row `i` at `dst[dst_offset + i * dst_s ..][..C]`.
fn copy_rows_into<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    src: &Tensor,
    idx: Option<&Tensor>,
    dst: &mut CudaSlice<T>,
    dst_offset: usize,
    dst_s: usize,
) -> candle_core::Result<()> {
    let (src_rows, cols) = src.dims2()?;
    let st = src.stride();
    if cols > 1 && st[1] != 1 {
        candle_core::bail!("copy_rows: the source needs unit stride along its rows, got strides {st:?}");
    }
    let src_s = if src_rows > 1 { st[0] } else { cols };
    let rows = match idx {
        Some(i) => i.dim(0)?,
        None => src_rows,
    };
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    if src_rows == 0 || dst_offset + (rows - 1) * dst_s + cols > dst.len() {
        candle_core::bail!("copy_rows: {rows} rows of {cols} do not fit the source or the destination");
    }
    let (ss, sl) = src.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*ss else { candle_core::bail!("copy_rows: the source must be on the GPU") };
    let start = sl.start_offset();
    let sv = cs.as_cuda_slice::<T>()?.slice(start..start + (src_rows - 1) * src_s + cols);
    let held = idx.map(|i| i.storage_and_layout());
    let iv = match &held {
        Some((s, l)) => Some(cuda_view::<u32>(s, l, "copy_rows: the row indices")?),
        None => None,
    };
    let mut dv = dst.slice_mut(dst_offset..);
    let func = kernel(dev, OPS, &format!("copy_rows_b{}", std::mem::size_of::<T>()))?;
    let mut b = func.builder();
    let null = 0u64;
    b.arg(&sv);
    match &iv {
        Some(v) => b.arg(v),
        None => b.arg(&null),
    };
    b.arg(&mut dv);
    b.arg(&rows);
    b.arg(&cols);
    b.arg(&src_s);
    b.arg(&dst_s);
    let cfg = LaunchConfig { grid_dim: (rows.min(1 << 20) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: argument types and order match the kernel (two pointers, an index pointer or null,
    // four size_t); the source view holds every row it reads (indices are the caller's to keep
    // below R), and the check above keeps every row written inside `dst`.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// MXFP4 weights dequantised to `dtype` (bf16, f16 or f32) on the GPU: `blocks` `[rows, in / 2]`
/// u8 (two e2m1 values a byte, the low nibble first), `scales` `[rows, in / 32]` u8 (E8M0, one
/// per 32 values; none may be 0xFF, which the loader refuses). Returns the weight transposed,
/// `[in, rows]` (as float projections are held): the values
/// [`crate::engine::layers::mxfp4::dequantise`] gives on the CPU, exactly (in bf16 and f32).
pub fn mxfp4_dequantise(blocks: &Tensor, scales: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    let (rows, half) = blocks.dims2()?;
    if blocks.dtype() != DType::U8
        || scales.dtype() != DType::U8
        || scales.dims2()? != (rows, half / 16)
        || half % 16 != 0
    {
        candle_core::bail!(
            "mxfp4_dequantise: blocks {:?} {:?} and scales {:?} {:?} (u8, [rows, in/2] and [rows, in/32])",
            blocks.dtype(),
            blocks.dims(),
            scales.dtype(),
            scales.dims()
        );
    }
    blocks.contiguous()?.apply_op2_no_bwd(&scales.contiguous()?, &Mxfp4Dequantise { dtype })
}

struct Mxfp4Dequantise {
    dtype: DType,
}

impl Mxfp4Dequantise {
    fn launch<T: KernelType>(
        dev: &CudaDevice,
        blocks: &CudaSlice<u8>,
        bl: &Layout,
        scales: &CudaSlice<u8>,
        sl: &Layout,
    ) -> candle_core::Result<CudaSlice<T>> {
        let (rows, half) = bl.shape().dims2()?;
        let (n, inp) = (2 * rows * half, 2 * half);
        let bv = contiguous_view(blocks, bl, "mxfp4_dequantise: blocks")?;
        let sv = contiguous_view(scales, sl, "mxfp4_dequantise: scales")?;
        // SAFETY: the kernel writes every element of the [in, rows] output.
        let out = unsafe { dev.alloc::<T>(n)? };
        let func = kernel(dev, OPS, &kernel_name::<T>("mxfp4_to"))?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, 65535 * 8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&bv);
        b.arg(&sv);
        b.arg(&out);
        b.arg(&rows);
        b.arg(&inp);
        if n > 0 {
            // SAFETY: two u8 pointers, the output pointer and two size_t, as the kernel takes
            // them; the shapes were checked against each other, so every index is inside.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(out)
    }
}

impl candle_core::CustomOp2 for Mxfp4Dequantise {
    fn name(&self) -> &'static str {
        "mxfp4-dequantise"
    }

    cpu_fwd_cuda_only!(2);

    fn cuda_fwd(
        &self,
        bs: &CudaStorage,
        bl: &Layout,
        ss: &CudaStorage,
        sl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = bs.device();
        let (CudaStorageSlice::U8(b), CudaStorageSlice::U8(s)) = (&bs.slice, &ss.slice) else {
            candle_core::bail!("mxfp4_dequantise: blocks and scales must be u8");
        };
        let slice = match self.dtype {
            DType::BF16 => CudaStorageSlice::BF16(Self::launch(dev, b, bl, s, sl)?),
            DType::F16 => CudaStorageSlice::F16(Self::launch(dev, b, bl, s, sl)?),
            DType::F32 => CudaStorageSlice::F32(Self::launch(dev, b, bl, s, sl)?),
            d => candle_core::bail!("mxfp4_dequantise: to {d:?}: bf16, f16 or f32 only"),
        };
        let (rows, half) = bl.shape().dims2()?;
        Ok((CudaStorage { slice, device: dev.clone() }, Shape::from((2 * half, rows))))
    }
}
