//! CPU cost of encoding answers as the server does (safetensors with checksums, identity or
//! zstd), in CPU-seconds per GB of hidden states, user and system time apart:
//! `cargo run --release --example encode_bench -- [--hidden 2048] [--layers 5] [--threads 2]
//! [--seconds 4] [--level 1]`.
//!
//! Two ways are timed side by side: `fresh`, what the server did before answers were written into
//! reused buffers (a new vector and a new zstd encoder per answer), and `pooled`,
//! [`codec::encode_answer_on`] as the server calls it now.
//!
//! The states are synthetic bf16 (normal values, which zstd shrinks about as much as real
//! models' states), in answers of 100–4,096 tokens drawn like `bench/gpu`'s workload. Every
//! thread encodes from one source buffer that it reuses, as answers are cut from the device's
//! reused host buffers; the server's allocator settings and its memory trimming thread are on.
use std::collections::HashMap;
use std::time::Instant;

use layertap::answer::codec::{self, AnswerParts};
use layertap::engine::OutDType;

fn arg(name: &str, default: f64) -> f64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// User and system CPU seconds of the whole process so far.
fn cpu_times() -> (f64, f64) {
    // SAFETY: getrusage writes the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    (s(u.ru_utime), s(u.ru_stime))
}

/// A small deterministic generator (xorshift) and a Box–Muller normal.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        let (a, b) = (self.next().max(1e-12), self.next());
        ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
    }
}

/// The encoding as it was before the pool: a new vector (and a new zstd encoder) per answer.
fn fresh(a: &AnswerParts, zstd: Option<i32>) -> usize {
    let size: usize = a.chunks.iter().map(|c| c.len()).sum::<usize>() + 4096 + a.input_ids.len() * 9;
    match zstd {
        None => {
            let mut out = Vec::with_capacity(size);
            codec::write_safetensors(&mut out, a).expect("encode");
            out.len()
        }
        Some(level) => {
            let mut enc = zstd::stream::Encoder::new(Vec::with_capacity(size / 2), level).expect("zstd");
            codec::write_safetensors(&mut enc, a).expect("encode");
            enc.finish().expect("zstd").len()
        }
    }
}

fn main() {
    let hidden = arg("--hidden", 2048.0) as usize;
    let layers = arg("--layers", 5.0) as usize;
    let threads = arg("--threads", 2.0) as usize;
    let seconds = arg("--seconds", 4.0);
    let level = arg("--level", 1.0) as i32;
    layertap::server::reuse_large_allocations();
    layertap::server::return_free_memory_periodically();
    let max_tokens = 4096;
    let mut rng = Rng(0x9e3779b97f4a7c15);
    let source: Vec<u8> = (0..max_tokens * layers * hidden)
        .flat_map(|_| half::bf16::from_f32(rng.normal() * 0.7).to_le_bytes())
        .collect();
    // Lengths 100–4,096, uniform as in bench/gpu's workload.
    let lens: Vec<usize> = (0..64).map(|_| 100 + (rng.next() * (max_tokens - 100) as f64) as usize).collect();
    let rounds = arg("--rounds", 2.0) as usize;
    for (round, zstd, pooled) in
        (0..rounds).flat_map(|r| [(r, None, false), (r, None, true), (r, Some(level), false), (r, Some(level), true)])
    {
        let t0 = Instant::now();
        let c0 = cpu_times();
        let (raw, enc): (u64, u64) = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (source, lens) = (&source, &lens);
                    s.spawn(move || {
                        let (mut raw, mut enc, mut i) = (0u64, 0u64, t);
                        while t0.elapsed().as_secs_f64() < seconds {
                            let n = lens[i % lens.len()];
                            i += threads;
                            let bytes = n * layers * hidden * 2;
                            let parts = AnswerParts {
                                dtype: OutDType::Bfloat16,
                                shape: vec![n, layers, hidden],
                                chunks: vec![&source[..bytes]],
                                scale: None,
                                input_ids: (0..n as i64).collect(),
                                cu_seqlens: vec![0, n as i64],
                                loss_mask: vec![1; n],
                                positions: None,
                                logprobs: None,
                                metadata: HashMap::from([("model".to_string(), "bench".to_string())]),
                            };
                            let len = if pooled {
                                codec::encode_answer_on(&parts, zstd, 1).expect("encode").len()
                            } else {
                                fresh(&parts, zstd)
                            };
                            raw += bytes as u64;
                            enc += len as u64;
                        }
                        (raw, enc)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("thread")).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
        });
        let wall = t0.elapsed().as_secs_f64();
        let c1 = cpu_times();
        let gb = raw as f64 / 1e9;
        println!(
            "{{\"round\": {round}, \"way\": \"{}\", \"encoding\": \"{}\", \"hidden\": {hidden}, \"layers\": {layers}, \"threads\": {threads}, \"gb\": {gb:.3}, \
             \"ratio\": {:.3}, \"gb_per_s\": {:.3}, \"user_s_per_gb\": {:.3}, \"sys_s_per_gb\": {:.3}, \"cpu_s_per_gb\": {:.3}}}",
            if pooled { "pooled" } else { "fresh" },
            zstd.map_or("identity".to_string(), |l| format!("zstd {l}")),
            raw as f64 / enc as f64,
            gb / wall,
            (c1.0 - c0.0) / gb,
            (c1.1 - c0.1) / gb,
            (c1.0 - c0.0 + c1.1 - c0.1) / gb,
        );
    }
}
