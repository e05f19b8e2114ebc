//! With the `cuda` feature, compiles `kernels/*.cu` (attention, fused element-wise ops) to PTX
//! with nvcc (loaded by the driver at run time). Without it, does nothing.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=kernels/attention.cu");
    println!("cargo::rerun-if-changed=kernels/ops.cu");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    // The kernels need tensor-core mma (sm_80+); PTX for the oldest target runs on newer GPUs.
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap: u32 =
        cap.trim().replace('.', "").parse().unwrap_or_else(|_| panic!("CUDA_COMPUTE_CAP={cap} is not a number"));
    if cap < 80 {
        panic!("layertap's CUDA kernels need compute capability 8.0 or newer (CUDA_COMPUTE_CAP={cap})");
    }
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    for name in ["attention", "ops"] {
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", "--use_fast_math"])
            .arg(format!("-arch=sm_{cap}"))
            .arg("-o")
            .arg(out_dir.join(format!("{name}.ptx")))
            .arg(format!("kernels/{name}.cu"))
            .status()
            .unwrap_or_else(|e| {
                panic!("cannot run {nvcc} (needed by the cuda feature; is the CUDA toolkit on PATH?): {e}")
            });
        if !status.success() {
            panic!("{nvcc} failed to compile kernels/{name}.cu ({status})");
        }
    }
}
