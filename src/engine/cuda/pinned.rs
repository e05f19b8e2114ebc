//! Device-to-host copies on a stream of their own, into page-locked buffers that are reused:
//! how a batch's prepared hidden states leave a CUDA device while it computes the next batch.

use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, PinnedHostSlice};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{CudaDevice, Device, Storage, Tensor};

use crate::engine::host::{Fp8Taps, HostBytes, HostTensor, LentBuffer, Taps};
use crate::engine::output::Prepared;
use crate::engine::{EngineError, OutDType};

fn fail(msg: String) -> EngineError {
    EngineError::from(candle_core::Error::Msg(msg))
}

/// Page-locked host buffers: the device copies into them directly (no staging, no page
/// faults), and a buffer returns here when the last answer cut from it is encoded.
pub struct PinnedPool {
    ctx: Arc<CudaContext>,
    free: Mutex<Vec<PinnedHostSlice<u8>>>,
    /// Wait for the copies by spinning (`EngineOptions::spin_wait`) rather than asleep.
    spin_wait: bool,
}

/// Buffers are sized in steps of this many bytes so batches of similar size share them.
const STEP: usize = 64 << 20;
/// Idle buffers kept for reuse; more are freed.
const KEEP: usize = 4;
/// Copies smaller than this go to ordinary memory.
const SMALL: usize = 1 << 20;

impl PinnedPool {
    pub fn new(ctx: Arc<CudaContext>, spin_wait: bool) -> Arc<Self> {
        Arc::new(PinnedPool { ctx, free: Mutex::new(Vec::new()), spin_wait })
    }

    fn take(self: &Arc<Self>, len: usize) -> Result<PinnedBuf, EngineError> {
        let reused = {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            // The smallest idle buffer that fits.
            let best = free.iter().enumerate().filter(|(_, b)| b.len() >= len).min_by_key(|(_, b)| b.len());
            best.map(|(i, _)| i).map(|i| free.swap_remove(i))
        };
        let buf = match reused {
            Some(b) => b,
            None => {
                let size = len.div_ceil(STEP).max(1) * STEP;
                // SAFETY: the memory is uninitialised until the copy writes it; only the first
                // `len` bytes, which the copy fills, are ever read.
                unsafe { self.ctx.alloc_pinned_with_flags::<u8>(size, 0) }
                    .map_err(|e| fail(format!("cannot allocate {size} bytes of page-locked host memory: {e}")))?
            }
        };
        Ok(PinnedBuf { buf: Some(buf), len, pool: self.clone() })
    }

    fn give_back(&self, buf: PinnedHostSlice<u8>) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        free.push(buf);
        if free.len() > KEEP {
            // Drop the smallest: the large ones fit every batch.
            if let Some(i) = free.iter().enumerate().min_by_key(|(_, b)| b.len()).map(|(i, _)| i) {
                free.swap_remove(i);
            }
        }
    }
}

pub struct PinnedBuf {
    buf: Option<PinnedHostSlice<u8>>,
    len: usize,
    pool: Arc<PinnedPool>,
}

impl LentBuffer for PinnedBuf {
    fn bytes(&self) -> &[u8] {
        match &self.buf {
            // The copy into it has been waited for before the buffer is handed out.
            Some(b) => b.as_slice().map(|s| &s[..self.len]).unwrap_or(&[]),
            None => &[],
        }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.give_back(b);
        }
    }
}

/// Waits for the copies queued on `stream` (and the batch they wait for) with the thread
/// asleep. A plain stream synchronisation spins a core for the whole batch under the driver's
/// default scheduling (spin while there are fewer contexts than cores), and that core is the
/// host's, which encodes answers. With `spin` (`EngineOptions::spin_wait`) it spins as before, for
/// comparison.
fn wait(stream: &Arc<CudaStream>, spin: bool) -> Result<(), EngineError> {
    if spin {
        return stream.synchronize().map_err(|e| fail(format!("device-to-host copy: {e}")));
    }
    let done = stream
        .record_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))
        .map_err(|e| fail(format!("recording a CUDA event: {e}")))?;
    done.synchronize().map_err(|e| fail(format!("device-to-host copy: {e}")))
}

fn copy<T: DeviceRepr>(
    s: &CudaSlice<T>,
    range: (usize, usize),
    stream: &Arc<CudaStream>,
    pool: &Arc<PinnedPool>,
) -> Result<HostBytes, EngineError> {
    let view = s.slice(range.0..range.1);
    let bytes = (range.1 - range.0) * std::mem::size_of::<T>();
    if bytes < SMALL {
        // Screens and scales: too small for a page-locked buffer of their own.
        let v: Vec<T> = stream.clone_dtoh(&view).map_err(|e| fail(format!("device-to-host copy: {e}")))?;
        wait(stream, pool.spin_wait)?;
        // SAFETY: `T` is a plain number type (every byte initialised); the vector is read as
        // its bytes, in memory order, and not used as `T` again.
        let b = unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), bytes) }.to_vec();
        return Ok(HostBytes::Vec(b));
    }
    let mut dst = pool.take(bytes)?;
    let buf = dst.buf.as_mut().ok_or_else(|| fail("pinned buffer missing".into()))?;
    // SAFETY: a view of the same bytes as `T` (16- or 32-bit floats, for which every bit
    // pattern is valid); the buffer holds at least `bytes` bytes and is page-aligned.
    let dst_t: &mut [T] = unsafe {
        let p = buf.as_mut_ptr().map_err(|e| fail(format!("pinned buffer: {e}")))?;
        std::slice::from_raw_parts_mut(p.cast::<T>(), range.1 - range.0)
    };
    stream.memcpy_dtoh(&view, dst_t).map_err(|e| fail(format!("device-to-host copy: {e}")))?;
    wait(stream, pool.spin_wait)?;
    Ok(HostBytes::Lent(Box::new(dst)))
}

/// Copies a contiguous tensor's bytes into host memory on `stream`. The caller orders
/// `stream` after the work that wrote the tensor (an event recorded on the compute stream).
pub fn bytes_to_host(t: &Tensor, stream: &Arc<CudaStream>, pool: &Arc<PinnedPool>) -> Result<HostBytes, EngineError> {
    let (storage, layout) = t.storage_and_layout();
    let range = layout.contiguous_offsets().ok_or_else(|| fail("hidden states must be contiguous to copy".into()))?;
    let Storage::Cuda(c) = &*storage else {
        return Err(fail("the device-to-host copy expects a CUDA tensor".into()));
    };
    match &c.slice {
        CudaStorageSlice::BF16(s) => copy(s, range, stream, pool),
        CudaStorageSlice::F16(s) => copy(s, range, stream, pool),
        CudaStorageSlice::F32(s) => copy(s, range, stream, pool),
        CudaStorageSlice::F8E4M3(s) => copy(s, range, stream, pool),
        CudaStorageSlice::U8(s) => copy(s, range, stream, pool),
        CudaStorageSlice::U32(s) => copy(s, range, stream, pool),
        _ => Err(fail(format!("no device-to-host copy for {:?}", t.dtype()))),
    }
}

/// [`bytes_to_host`] for a tensor of `dtype`.
pub fn to_host(
    t: &Tensor,
    dtype: OutDType,
    stream: &Arc<CudaStream>,
    pool: &Arc<PinnedPool>,
) -> Result<HostTensor, EngineError> {
    if t.dtype() != dtype.candle() {
        return Err(fail("dtype mismatch in the device-to-host copy".into()));
    }
    Ok(HostTensor { dtype, shape: t.dims().to_vec(), data: bytes_to_host(t, stream, pool)? })
}

/// Copies a prepared batch's blocks to the host on `stream` (ordered after the work that
/// wrote them by the caller).
pub fn prepared_to_host(
    layers: Vec<usize>,
    p: Prepared,
    dtype: OutDType,
    hidden: usize,
    layers_run: usize,
    stream: &Arc<CudaStream>,
    pool: &Arc<PinnedPool>,
) -> Result<Taps, EngineError> {
    let width = layers.len();
    let small = |t: &Tensor| -> Result<Vec<u8>, EngineError> { Ok(bytes_to_host(t, stream, pool)?.into_vec()) };
    let (host, nonfinite) = match p.plain {
        Some(b) => (to_host(&b.states, dtype, stream, pool)?, small(&b.nonfinite)?),
        None => (HostTensor::empty(dtype, width, hidden), Vec::new()),
    };
    let fp8 = match p.fp8 {
        Some(b) => {
            let scale = b.scale.as_ref().ok_or_else(|| fail("an fp8 block without scales".into()))?;
            let scale = small(scale)?.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            Some(Fp8Taps {
                host: to_host(&b.states, OutDType::Float8E4M3, stream, pool)?,
                scale,
                nonfinite: small(&b.nonfinite)?,
            })
        }
        None => None,
    };
    // Log-probabilities are small (`rows x k`): copied as plain vectors.
    let logprobs = match p.logprobs {
        Some(l) => {
            let f32s = |t: &Tensor| -> Result<Vec<f32>, EngineError> {
                Ok(small(t)?.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            };
            let ids = small(&l.ids)?.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            Some(crate::engine::logprobs::TopK {
                top_k: l.top_k,
                ids,
                logprobs: f32s(&l.logprobs)?,
                target: f32s(&l.target)?,
            })
        }
        None => None,
    };
    Ok(Taps { layers, host, nonfinite, fp8, logprobs, layers_run })
}

/// The copies of a device's finished batches to the host: a stream of their own, ordered after
/// the compute stream's work by an event, and a pool of page-locked buffers.
pub struct HostCopies {
    device: CudaDevice,
    stream: Arc<CudaStream>,
    pool: Arc<PinnedPool>,
}

impl HostCopies {
    /// For a CUDA device; `None` for any other. `spin_wait`: see [`PinnedPool`].
    pub fn for_device(device: &Device, spin_wait: bool) -> Result<Option<Self>, EngineError> {
        let Device::Cuda(d) = device else { return Ok(None) };
        let ctx = d.cuda_stream().context().clone();
        let stream =
            ctx.new_stream().map_err(|e| EngineError::Load(format!("cannot create a CUDA copy stream: {e}")))?;
        Ok(Some(HostCopies { device: d.clone(), stream, pool: PinnedPool::new(ctx, spin_wait) }))
    }

    /// Starts the copy of a prepared batch (see [`prepared_to_host`]) behind the work queued on
    /// the device so far, and returns what finishes it (on any thread).
    pub fn start(
        &self,
        layers: Vec<usize>,
        prepared: Prepared,
        dtype: OutDType,
        hidden: usize,
        layers_run: usize,
    ) -> Result<impl FnOnce() -> Result<Taps, EngineError> + Send + 'static, EngineError> {
        // The copy runs on its own stream, so it must be ordered after the work that wrote
        // the prepared blocks: an event recorded now, behind that work on the compute stream. (Kernels
        // that take their output as a shared reference record no write for the copy to wait
        // on, and a copy that starts early reads rows not yet written.)
        let written =
            self.device.cuda_stream().record_event(None).map_err(|e| fail(format!("recording a CUDA event: {e}")))?;
        let (stream, pool) = (self.stream.clone(), self.pool.clone());
        Ok(move || {
            stream.wait(&written).map_err(|e| fail(format!("waiting on a CUDA event: {e}")))?;
            prepared_to_host(layers, prepared, dtype, hidden, layers_run, &stream, &pool)
        })
    }
}
