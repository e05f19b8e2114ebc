//! Times the fused CPU attention (`packed_attention`) on a packed batch shaped like the CPU
//! benchmark's default model (9 query heads, 3 key/value heads of 64) and sequences of 64–498
//! tokens: `RAYON_NUM_THREADS=2 cargo run --release --example cpu_attention_bench`.
use candle_core::{Device, Tensor};
use layertap::engine::layers::cpu_attention::packed_attention;

fn main() -> candle_core::Result<()> {
    let lens = [498usize, 400, 300, 256, 200, 150, 100, 64];
    let t: usize = lens.iter().sum();
    let seqs: Vec<(usize, usize)> = lens.iter().scan(0, |at, &l| Some((std::mem::replace(at, *at + l), l))).collect();
    let (heads, kv, d) = (9, 3, 64);
    let q = Tensor::randn(0f32, 1.0, (t, heads, d), &Device::Cpu)?;
    let k = Tensor::randn(0f32, 1.0, (t, kv, d), &Device::Cpu)?;
    let v = Tensor::randn(0f32, 1.0, (t, kv, d), &Device::Cpu)?;
    // Each query visits the keys up to itself, in every head: 2 d flops for its score, 2 d for
    // the weighted value.
    let visits: f64 = lens.iter().map(|&l| (l * (l + 1) / 2) as f64).sum::<f64>() * heads as f64;
    packed_attention(&q, &k, &v, &seqs, 0.125, None, None)?;
    for _ in 0..3 {
        let reps = 20;
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            packed_attention(&q, &k, &v, &seqs, 0.125, None, None)?;
        }
        let dt = t0.elapsed().as_secs_f64() / reps as f64;
        println!(
            "{{\"ms\": {:.2}, \"ns_per_key_visit\": {:.2}, \"gflops\": {:.1}}}",
            dt * 1e3,
            dt / visits * 1e9,
            visits * 4.0 * d as f64 / dt / 1e9
        );
    }
    Ok(())
}
