//! Opening a device by name and reading its memory.

#[cfg(feature = "cuda")]
use super::{cuda, EngineOptions};
use super::{Device, EngineError};

/// Parses `cpu` or `cuda:N`.
pub fn parse_device(s: &str) -> Result<Device, EngineError> {
    match s {
        "cpu" => Ok(Device::Cpu),
        _ => {
            let idx = s
                .strip_prefix("cuda:")
                .and_then(|i| i.parse::<usize>().ok())
                .ok_or_else(|| EngineError::Load(format!("unknown device {s:?}; use cpu or cuda:N")))?;
            #[cfg(feature = "cuda")]
            let options = EngineOptions::startup();
            #[cfg(feature = "cuda")]
            if !options.spin_wait {
                if let Err(e) = cuda::device::sleep_in_device_waits(idx) {
                    tracing::warn!(device = s, "waits on the device keep the driver's default scheduling: {e}");
                }
            }
            let d = Device::new_cuda(idx).map_err(|e| {
                EngineError::Load(format!(
                    "cannot open {s}: {e} (was layertap built with `--features cuda`, and is the GPU visible?)"
                ))
            })?;
            #[cfg(feature = "cuda")]
            {
                tracing::info!(
                    device = s,
                    kernels = cuda::module::ARCHS,
                    "CUDA device opened; kernels built for these compute capabilities"
                );
                if !options.pool_release {
                    if let Err(e) = cuda::device::keep_freed_device_memory(&d) {
                        tracing::warn!(device = s, "the device's memory pool keeps its default release threshold: {e}");
                    }
                }
            }
            Ok(d)
        }
    }
}

/// Number of visible CUDA devices (0 without the `cuda` feature).
pub fn cuda_device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        cuda::device::count()
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// Memory used and total on a device, in bytes, or None where it cannot be read (the CPU).
pub fn device_memory(device: &Device) -> Option<(u64, u64)> {
    #[cfg(feature = "cuda")]
    {
        cuda::device::memory(device)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        None
    }
}

/// A handle for reading a device's memory from another thread (the metrics endpoint), taken once
/// the device's model is loaded; for a replica in stages, its devices' memory added up.
#[derive(Clone)]
pub struct MemoryProbe(Vec<Device>);

impl MemoryProbe {
    pub fn new(device: &Device) -> Self {
        MemoryProbe(vec![device.clone()])
    }

    /// The probe of a replica whose stages are on `devices` (each device counted once).
    pub fn of(devices: &[Device]) -> Self {
        let mut distinct: Vec<Device> = Vec::new();
        for d in devices {
            if !distinct.iter().any(|o| o.same_device(d)) {
                distinct.push(d.clone());
            }
        }
        MemoryProbe(distinct)
    }

    /// Used and total bytes, where the devices report them (GPUs).
    pub fn sample(&self) -> Option<(u64, u64)> {
        self.0.iter().try_fold((0, 0), |(u, t), d| device_memory(d).map(|(du, dt)| (u + du, t + dt)))
    }
}
