//! Times the f32 CPU matmul every projection runs (`[T, in] x [in, out]`, candle's `gemm`) on the
//! default model's shapes (SmolLM2-135M: hidden 576, 9 + 3 + 3 heads of 64, intermediate 1536)
//! at a batch of T tokens, and prints which `gemm` kernels this build and CPU use:
//! `RAYON_NUM_THREADS=2 cargo run --release --example cpu_matmul_bench [T]` (default 4096).
use candle_core::{Device, Tensor};

fn main() -> candle_core::Result<()> {
    let t: usize = std::env::args().nth(1).map_or(4096, |a| a.parse().expect("T: a number of tokens"));
    #[cfg(target_arch = "x86_64")]
    println!(
        "{{\"cpu_avx512f\": {}, \"cpu_avx2_fma\": {}, \"threads\": {}}}",
        std::arch::is_x86_feature_detected!("avx512f"),
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"),
        candle_core::utils::get_num_threads()
    );
    // (name, in, out) of one layer's projections.
    let shapes = [("q", 576, 576), ("k_v", 576, 192), ("o", 576, 576), ("gate_up", 576, 1536), ("down", 1536, 576)];
    for (name, inp, out) in shapes {
        let x = Tensor::randn(0f32, 1.0, (t, inp), &Device::Cpu)?;
        let w = Tensor::randn(0f32, 1.0, (inp, out), &Device::Cpu)?;
        x.matmul(&w)?;
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let reps = 10;
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                x.matmul(&w)?;
            }
            best = best.min(t0.elapsed().as_secs_f64() / reps as f64);
        }
        let gflops = 2.0 * (t * inp * out) as f64 / best / 1e9;
        println!("{{\"shape\": \"{name}\", \"t\": {t}, \"in\": {inp}, \"out\": {out}, \"ms\": {:.2}, \"gflops\": {gflops:.1}}}", best * 1e3);
    }
    Ok(())
}
