//! A CUDA device's set-up and what is read from it: how its host threads wait, what its memory
//! pool keeps, how many devices there are and how much memory one uses.

use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaContext};
use candle_core::Device;

/// Makes the host threads that wait on device `ordinal` sleep instead of spin, before its
/// (primary) context is opened. Under the driver's default scheduling a thread waiting for the
/// GPU (a synchronisation, or a copy from pageable memory that must wait for the stream) spins
/// while there are fewer contexts than cores: the device thread then holds a core all the time
/// the GPU works, and that core is one the encoders cannot use. (`EngineOptions::spin_wait`
/// keeps the default, for comparison: then this is not called.)
pub fn sleep_in_device_waits(ordinal: usize) -> Result<(), String> {
    result::init().map_err(|e| e.to_string())?;
    let dev = result::device::get(ordinal as i32).map_err(|e| e.to_string())?;
    let flags = sys::CUctx_flags::CU_CTX_SCHED_BLOCKING_SYNC as u32;
    // SAFETY: `dev` is a device handle the driver just returned; the call only records flags for
    // the primary context that `Device::new_cuda` retains next.
    unsafe { sys::cuDevicePrimaryCtxSetFlags_v2(dev, flags) }.result().map_err(|e| e.to_string())
}

/// Keeps the memory a CUDA device's default pool has freed (the pool `cuMemAllocAsync` draws
/// from) mapped for reuse. With the pool's default release threshold of 0, every synchronisation
/// hands the freed blocks back to the driver, and the next batch maps them again. The server's
/// activations are reused batch after batch, as PyTorch's caching allocator keeps its own.
/// (`EngineOptions::pool_release` leaves the default: then this is not called.) Does nothing on
/// other devices.
pub fn keep_freed_device_memory(device: &Device) -> Result<(), String> {
    let Device::Cuda(d) = device else { return Ok(()) };
    let ctx = d.cuda_stream().context().clone();
    ctx.bind_to_thread().map_err(|e| e.to_string())?;
    let mut keep = u64::MAX;
    // SAFETY: the device comes from a live context; the release threshold's value is a u64.
    unsafe {
        let pool = result::device::get_default_mem_pool(ctx.cu_device()).map_err(|e| e.to_string())?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep as *mut u64).cast(),
        )
        .map_err(|e| e.to_string())
    }
}

/// Number of visible CUDA devices.
pub fn count() -> usize {
    CudaContext::device_count().map(|n| n as usize).unwrap_or(0)
}

/// Memory used and total on a CUDA device, in bytes; `None` for any other device or where it
/// cannot be read.
pub fn memory(device: &Device) -> Option<(u64, u64)> {
    let Device::Cuda(d) = device else { return None };
    d.cuda_stream().context().mem_get_info().ok().map(|(free, total)| ((total - free) as u64, total as u64))
}
