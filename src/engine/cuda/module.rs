//! Our CUDA kernels (`kernels/*.cu`), built by build.rs into fat binaries holding machine code
//! for every compute capability in `LAYERTAP_CUDA_ARCHS` and PTX for the newest (which the
//! driver compiles for GPUs newer still), loaded once per device context.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchArgs};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::WrapErr;
use candle_core::CudaDevice;

/// One of the fat binaries: build.rs compiles every `kernels/{name}.cu` into `{name}.fatbin`,
/// and the wrapper of those kernels embeds it with [`fatbin!`].
#[derive(Clone, Copy)]
pub struct Module {
    name: &'static str,
    image: &'static [u8],
}

impl Module {
    pub const fn new(name: &'static str, image: &'static [u8]) -> Self {
        Module { name, image }
    }
}

/// The [`Module`] of `kernels/{name}.cu`, embedded from the fat binary build.rs made of it.
macro_rules! fatbin {
    ($name:literal) => {
        $crate::engine::cuda::module::Module::new(
            $name,
            include_bytes!(concat!(env!("OUT_DIR"), "/", $name, ".fatbin")),
        )
    };
}
pub(crate) use fatbin;

/// The compute capabilities the kernels carry machine code for, and the one whose PTX they
/// carry, as build.rs compiled them.
pub const ARCHS: &str = env!("LAYERTAP_CUDA_ARCHS");

/// A kernel ready to launch on its device's stream.
pub struct Kernel {
    func: CudaFunction,
    stream: Arc<CudaStream>,
}

impl Kernel {
    pub fn builder(&self) -> LaunchArgs<'_> {
        self.stream.launch_builder(&self.func)
    }

    /// Lets launches of this kernel use `bytes` of dynamic shared memory (past the default 48 KiB).
    pub fn max_dynamic_shared(&self, bytes: usize) -> candle_core::Result<()> {
        use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum as A;
        self.func.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32).w()
    }
}

type Loaded = Mutex<HashMap<(usize, &'static str), Arc<CudaModule>>>;

/// Kernel `name` of `module` on `dev`: the module is loaded once per device context (the driver
/// picks the machine code for the GPU, or compiles the PTX).
pub fn kernel(dev: &CudaDevice, module: Module, name: &str) -> candle_core::Result<Kernel> {
    static LOADED: OnceLock<Loaded> = OnceLock::new();
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let key = (Arc::as_ptr(ctx) as usize, module.name);
    let m = {
        let mut loaded = LOADED.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        match loaded.get(&key) {
            Some(m) => m.clone(),
            None => {
                let m = ctx.load_module(Ptx::from_binary(module.image.to_vec())).map_err(|e| {
                    candle_core::Error::Msg(format!(
                        "loading the {} kernels (built for compute capabilities {ARCHS}): {e}; \
                         rebuild with LAYERTAP_CUDA_ARCHS including this GPU's",
                        module.name
                    ))
                })?;
                loaded.insert(key, m.clone());
                m
            }
        }
    };
    let func = m.load_function(name).w()?;
    Ok(Kernel { func, stream })
}
