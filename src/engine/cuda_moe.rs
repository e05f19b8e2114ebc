//! The experts of a mixture-of-experts layer in one launch per projection (`kernels/moe.cu`):
//! rows sorted by expert, each block of rows multiplied by its own expert's weight.
//! `LAYERTAP_CUDA_MOE=0` turns the kernel off (one matmul chain per expert instead).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Device, Layout, Shape, Tensor};

use super::cuda_module::{cuda_view, kernel, MOE};

/// Rows and columns of the kernel's block tile, and its step along the reduction.
const BM: usize = 64;
const BN: usize = 128;
const BK: usize = 32;

/// Whether the kernel serves experts of `hidden` x `inter` in `dtype` on `device`.
pub fn supported(device: &Device, dtype: DType, hidden: usize, inter: usize) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("LAYERTAP_CUDA_MOE").is_ok_and(|v| v == "0"));
    !off && device.is_cuda() && matches!(dtype, DType::BF16 | DType::F16) && hidden % BK == 0 && inter % BK == 0
}

/// The work list for experts whose rows start at `starts[e]` and number `counts[e]`: one
/// `(expert, first row, rows)` triple per block of at most 64 rows.
pub fn tiles(starts: &[usize], counts: &[usize], device: &Device) -> candle_core::Result<(Tensor, usize)> {
    let mut list = Vec::new();
    for (e, (&s, &n)) in starts.iter().zip(counts).enumerate() {
        for r in (0..n).step_by(BM) {
            list.extend([e as u32, (s + r) as u32, (n - r).min(BM) as u32]);
        }
    }
    let n = list.len() / 3;
    Ok((Tensor::new(list.as_slice(), device)?, n))
}

/// `x`: `[R, K]` rows sorted by expert, `w`: `[E, N, K]`, `tiles` from [`tiles`]. Returns
/// `[R, N]`: each row times its expert's weight, transposed.
pub fn grouped_matmul(x: &Tensor, w: &Tensor, tiles: &(Tensor, usize)) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &Grouped { tiles: tiles.0.clone(), n_tiles: tiles.1 })
}

struct Grouped {
    tiles: Tensor,
    n_tiles: usize,
}

impl Grouped {
    fn launch<T: DeviceRepr>(
        &self,
        dev: &CudaDevice,
        name: &str,
        x: (&CudaSlice<T>, &Layout),
        w: (&CudaSlice<T>, &Layout),
        tiles: &CudaView<'_, u32>,
    ) -> candle_core::Result<CudaSlice<T>> {
        let (r, k) = x.1.shape().dims2()?;
        let (_, n, kw) = w.1.shape().dims3()?;
        let aligned = |l: &Layout| l.contiguous_offsets().filter(|(a, _)| a % 8 == 0);
        let (Some((xa, xb)), Some((wa, wb))) = (aligned(x.1), aligned(w.1)) else {
            candle_core::bail!("grouped matmul: x and w must be contiguous and 16-byte aligned");
        };
        if kw != k || k % BK != 0 || n % 8 != 0 {
            candle_core::bail!("grouped matmul: x {:?} and w {:?} do not fit", x.1.shape(), w.1.shape());
        }
        // SAFETY: every row of y belongs to exactly one tile (the tiles cover each expert's rows),
        // and every tile writes all N columns of its rows.
        let y = unsafe { dev.alloc::<T>(r * n)? };
        if self.n_tiles == 0 {
            return Ok(y);
        }
        let func = kernel(dev, MOE, name)?;
        let mut b = func.builder();
        let (xv, wv) = (x.0.slice(xa..xb), w.0.slice(wa..wb));
        let (n_i, k_i) = (n as i32, k as i32);
        b.arg(&xv);
        b.arg(&wv);
        b.arg(&y);
        b.arg(tiles);
        b.arg(&n_i);
        b.arg(&k_i);
        let cfg = LaunchConfig {
            grid_dim: (self.n_tiles as u32, n.div_ceil(BN) as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match the kernel's signature; the tile list indexes rows of x and y
        // and experts of w (built from the same counts as x's order).
        unsafe { b.launch(cfg) }.w()?;
        Ok(y)
    }
}

impl candle_core::CustomOp2 for Grouped {
    fn name(&self) -> &'static str {
        "grouped-matmul"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("the grouped matmul kernel runs on CUDA devices only")
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = x.device();
        let (ts, tl) = self.tiles.storage_and_layout();
        let tiles = cuda_view::<u32>(&ts, tl, "grouped matmul: the tile list")?;
        let slice = match (&x.slice, &w.slice) {
            (CudaStorageSlice::BF16(xs), CudaStorageSlice::BF16(ws)) => {
                CudaStorageSlice::BF16(self.launch(dev, "grouped_mm_bf16", (xs, xl), (ws, wl), &tiles)?)
            }
            (CudaStorageSlice::F16(xs), CudaStorageSlice::F16(ws)) => {
                CudaStorageSlice::F16(self.launch(dev, "grouped_mm_f16", (xs, xl), (ws, wl), &tiles)?)
            }
            _ => candle_core::bail!("grouped matmul: x and w must both be bf16 or f16, got {:?}", x.dtype()),
        };
        let r = xl.shape().dims2()?.0;
        let n = wl.shape().dims3()?.1;
        Ok((CudaStorage { slice, device: dev.clone() }, Shape::from((r, n))))
    }
}
