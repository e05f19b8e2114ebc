//! What `--quantize fp8` costs per weight at load: a random bf16 `[n, k]` projection (the
//! Qwen3-8B MLP's up projection by default) quantised to e4m3 in 128 x 128 blocks on the CPU,
//! as the loader does, best of several runs; prints one JSON line with the elements per second
//! and per core.
//!
//! ```sh
//! cargo run --release --example fp8_quantise_cost -- [--n 12288] [--k 4096] [--runs 5]
//! ```

use std::time::Instant;

use layertap::engine::layers::fp8::quantise_weight_with;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{name} {v}: a whole number")))
}

fn main() {
    let (n, k, runs) = (arg("--n", 12288), arg("--k", 4096), arg("--runs", 5));
    // A fixed pseudo-random bf16 weight of about the scale of a trained projection.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<u16> = (0..n * k)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = (state >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            half::bf16::from_f32((u - 0.5) * 0.08).to_bits()
        })
        .collect();
    let mut best = f64::INFINITY;
    let mut check = 0u64;
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        let (q, s) = quantise_weight_with(n, k, |i| half::bf16::from_bits(data[i]).to_f32()).expect("finite");
        best = best.min(t.elapsed().as_secs_f64());
        check = q.iter().map(|&b| u64::from(b)).sum::<u64>() + s.len() as u64;
    }
    let cores = rayon::current_num_threads();
    let per_s = (n * k) as f64 / best;
    println!(
        "{{\"n\": {n}, \"k\": {k}, \"seconds\": {best:.4}, \"elements_per_s\": {per_s:.0}, \"threads\": {cores}, \
         \"elements_per_s_per_thread\": {:.0}, \"checksum\": {check}}}",
        per_s / cores as f64
    );
}
