//! With the `cuda` feature, compiles every `kernels/*.cu` (attention, the Gated DeltaNet, the
//! experts' grouped matmul, fused element-wise ops) with nvcc into a fat binary of the same name
//! in `OUT_DIR` (`kernels/ops.cu` into `ops.fatbin`, which the wrapper of those kernels embeds):
//! machine code for every compute capability in `LAYERTAP_CUDA_ARCHS` and PTX for the newest of
//! them, which the driver compiles for GPUs newer still. Without the feature, does nothing.
//!
//! `LAYERTAP_CUDA_ARCHS` (default `80,86,89,90,100,120`: A100; A10 and RTX 30; L4, L40S and RTX 40;
//! H100 and H200; B200; RTX PRO 6000 and RTX 50) is a comma-separated list of compute
//! capabilities, 80 or newer (the attention kernel uses tensor-core instructions). CUDA 12.8 or
//! newer compiles 100 and 120; with an older toolkit, leave them out. Capability 90 is compiled
//! as `sm_90a` (Hopper's machine code with its warpgroup MMA, which runs on 9.0 GPUs only; the
//! kernels that use it are chosen only there).

use std::path::PathBuf;
use std::process::Command;

const DEFAULT_ARCHS: &str = "80,86,89,90,100,120";
const KERNELS: &str = "kernels";

/// The files in `kernels/` whose name ends in `.{ext}`, sorted.
fn sources(ext: &str) -> Vec<PathBuf> {
    let dir = std::fs::read_dir(KERNELS).unwrap_or_else(|e| panic!("cannot read {KERNELS}/: {e}"));
    let mut found: Vec<PathBuf> = dir
        .map(|e| e.unwrap_or_else(|e| panic!("cannot read {KERNELS}/: {e}")).path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == ext))
        .collect();
    found.sort();
    found
}

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    // The folder itself, for kernels added or removed; each file, for kernels edited.
    println!("cargo::rerun-if-changed={KERNELS}");
    let (kernels, headers) = (sources("cu"), sources("cuh"));
    for f in kernels.iter().chain(&headers) {
        println!("cargo::rerun-if-changed={}", f.display());
    }
    println!("cargo::rerun-if-env-changed=LAYERTAP_CUDA_ARCHS");
    println!("cargo::rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let list = std::env::var("LAYERTAP_CUDA_ARCHS").unwrap_or_else(|_| DEFAULT_ARCHS.into());
    let mut archs: Vec<u32> = list
        .split(',')
        .map(|a| a.trim().replace('.', ""))
        .filter(|a| !a.is_empty())
        .map(|a| a.parse().unwrap_or_else(|_| panic!("LAYERTAP_CUDA_ARCHS={list}: {a:?} is not a compute capability")))
        .collect();
    archs.sort_unstable();
    archs.dedup();
    if archs.is_empty() || archs[0] < 80 {
        panic!("LAYERTAP_CUDA_ARCHS={list}: layertap's CUDA kernels need compute capability 8.0 or newer");
    }
    let newest = *archs.last().expect("not empty");
    let mut gencode: Vec<String> = archs
        .iter()
        .map(|&a| {
            if a == 90 {
                "-gencode=arch=compute_90a,code=sm_90a".to_string()
            } else {
                format!("-gencode=arch=compute_{a},code=sm_{a}")
            }
        })
        .collect();
    gencode.push(format!("-gencode=arch=compute_{newest},code=compute_{newest}"));
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    for source in &kernels {
        let name = source.file_stem().and_then(|s| s.to_str()).expect("a kernel file's name is UTF-8");
        let status = Command::new(&nvcc)
            .args(["--fatbin", "-O3", "-std=c++17", "--use_fast_math"])
            .args(&gencode)
            .arg("-o")
            .arg(out_dir.join(format!("{name}.fatbin")))
            .arg(source)
            .status()
            .unwrap_or_else(|e| {
                panic!("cannot run {nvcc} (needed by the cuda feature; is the CUDA toolkit on PATH?): {e}")
            });
        if !status.success() {
            panic!(
                "{nvcc} failed to compile {} for compute capabilities {list} ({status}); \
                 an older toolkit may not know the newest: set LAYERTAP_CUDA_ARCHS",
                source.display()
            );
        }
    }
    let archs: Vec<String> = archs.iter().map(u32::to_string).collect();
    println!("cargo::rustc-env=LAYERTAP_CUDA_ARCHS={} (PTX {newest})", archs.join(","));
}
