//! Everything of the engine that touches CUDA directly (the `cuda` feature): our kernels
//! (`kernels/*.cu`, [`module`]) and the candle ops that launch them, the device's set-up
//! ([`device`]), and the copies of results to page-locked host memory ([`pinned`]). The rest of
//! the engine reaches the CUDA bindings only through these modules.
//!
//! What the wrappers share lives here: the kernel name for an element type ([`kernel_name`]),
//! the view of a contiguous input ([`contiguous_view`], [`cuda_view`]), a tensor made from a
//! kernel's output ([`tensor`]), and the CPU side of an op that only has a CUDA kernel
//! ([`cuda_only_on_cpu`]).

pub mod attention;
pub mod device;
pub mod fp8;
pub mod gdn;
pub mod logprobs;
pub mod module;
pub mod moe;
pub mod ops;
pub mod pinned;
pub mod rope;

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr};
use candle_core::cuda_backend::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Device, Layout, Shape, Storage, Tensor};

/// An element type the kernels are instantiated for. A kernel's name ends in its type's
/// [`KernelType::SUFFIX`] (`silu_mul_bf16`, `gdn_conv_f32`, …).
pub trait KernelType: CudaDType + DeviceRepr {
    const SUFFIX: &'static str;
}

impl KernelType for half::bf16 {
    const SUFFIX: &'static str = "bf16";
}

impl KernelType for half::f16 {
    const SUFFIX: &'static str = "f16";
}

impl KernelType for f32 {
    const SUFFIX: &'static str = "f32";
}

/// The name of kernel `base` instantiated for `T`: `{base}_{suffix}`.
pub fn kernel_name<T: KernelType>(base: &str) -> String {
    format!("{base}_{}", T::SUFFIX)
}

/// The elements of `s` that a contiguous layout `l` covers; `what` names the input in the error
/// otherwise.
pub fn contiguous_view<'a, T: DeviceRepr>(
    s: &'a CudaSlice<T>,
    l: &Layout,
    what: &str,
) -> candle_core::Result<CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(s.slice(a..b)),
        None => candle_core::bail!("{what} must be contiguous"),
    }
}

/// The elements of a contiguous tensor held on the GPU, borrowed from its storage (`s`, `l`: what
/// `Tensor::storage_and_layout` returns); `what` names it in the error otherwise.
pub fn cuda_view<'a, T: CudaDType + DeviceRepr>(
    s: &'a Storage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<CudaView<'a, T>> {
    match s {
        Storage::Cuda(c) if l.is_contiguous() => contiguous_view(c.as_cuda_slice::<T>()?, l, what),
        _ => candle_core::bail!("{what} must be a contiguous tensor on the GPU"),
    }
}

/// The CUDA device `t` lives on; `op` names the caller in the error otherwise.
pub fn cuda_device<'a>(t: &'a Tensor, op: &str) -> candle_core::Result<&'a CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d),
        _ => cuda_only_on_cpu(op),
    }
}

/// A kernel's output as a tensor of `shape` on `dev` (no gradient).
pub fn tensor<T: CudaDType>(s: CudaSlice<T>, dev: &CudaDevice, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone())), shape, BackpropOp::none(), false)
}

/// What an op that only has a CUDA kernel answers elsewhere: an error naming it.
pub fn cuda_only_on_cpu<T>(op: &str) -> candle_core::Result<T> {
    candle_core::bail!("{op} runs on CUDA devices only")
}

/// The `cpu_fwd` of a candle custom op (`CustomOp1`, `CustomOp2` or `CustomOp3`, by its
/// number of inputs) that only has a CUDA kernel: [`cuda_only_on_cpu`] with the op's name.
macro_rules! cpu_fwd_cuda_only {
    (1) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            $crate::engine::cuda::cuda_only_on_cpu(candle_core::CustomOp1::name(self))
        }
    };
    (2) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            $crate::engine::cuda::cuda_only_on_cpu(candle_core::CustomOp2::name(self))
        }
    };
    (3) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            $crate::engine::cuda::cuda_only_on_cpu(candle_core::CustomOp3::name(self))
        }
    };
}
pub(crate) use cpu_fwd_cuda_only;
