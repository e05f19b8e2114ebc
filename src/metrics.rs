//! Prometheus collectors, on a registry owned by the application (never the global one).

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

pub struct Metrics {
    pub registry: Registry,
    pub requests: IntCounterVec,
    pub request_duration: HistogramVec,
    pub in_flight: IntGaugeVec,
    pub queue_duration: Histogram,
    pub inference_duration: Histogram,
    pub queue_requests: IntGauge,
    pub queue_tokens: IntGauge,
    pub batch_tokens: Histogram,
    pub batch_sequences: Histogram,
    pub tokens: IntCounter,
    pub sequences_cancelled: IntCounter,
    pub hidden_state_bytes: IntCounterVec,
    pub device_memory_used: IntGaugeVec,
    pub device_memory_total: IntGaugeVec,
    pub model_info: IntGaugeVec,
    pub batches_cancelled: IntCounter,
    pub oom_retries: IntCounter,
    pub batch_token_budget: IntGauge,
    pub selfcheck_error: GaugeVec,
    pub selfcheck_seconds: GaugeVec,
    pub nonfinite: IntCounterVec,
    pub heap_in_use: IntGauge,
    pub answer_buffers_idle: IntGauge,
}

fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: T) -> T {
    r.register(Box::new(c.clone())).expect("metric names are unique");
    c
}

fn buckets(start: f64, factor: f64, n: usize) -> Vec<f64> {
    prometheus::exponential_buckets(start, factor, n).expect("valid buckets")
}

impl Metrics {
    pub fn new() -> Self {
        let r = Registry::new();
        #[cfg(target_os = "linux")]
        {
            let _ = r.register(Box::new(prometheus::process_collector::ProcessCollector::for_self()));
        }
        let secs = buckets(0.001, 2.0, 18); // 1 ms .. ~131 s
        Metrics {
            requests: reg(
                &r,
                IntCounterVec::new(
                    Opts::new("layertap_requests_total", "HTTP requests by route and status"),
                    &["route", "status"],
                )
                .unwrap(),
            ),
            request_duration: reg(
                &r,
                HistogramVec::new(
                    HistogramOpts::new("layertap_request_duration_seconds", "HTTP request duration by route")
                        .buckets(secs.clone()),
                    &["route"],
                )
                .unwrap(),
            ),
            in_flight: reg(
                &r,
                IntGaugeVec::new(Opts::new("layertap_in_flight_requests", "HTTP requests being served"), &["route"])
                    .unwrap(),
            ),
            queue_duration: reg(
                &r,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "layertap_queue_duration_seconds",
                        "Time a request waits before its first batch",
                    )
                    .buckets(secs.clone()),
                )
                .unwrap(),
            ),
            inference_duration: reg(
                &r,
                Histogram::with_opts(
                    HistogramOpts::new("layertap_inference_duration_seconds", "Forward pass time of one batch")
                        .buckets(secs),
                )
                .unwrap(),
            ),
            queue_requests: reg(
                &r,
                IntGauge::new("layertap_queue_requests", "Requests admitted and not yet answered").unwrap(),
            ),
            queue_tokens: reg(&r, IntGauge::new("layertap_queue_tokens", "Tokens waiting in the queue").unwrap()),
            batch_tokens: reg(
                &r,
                Histogram::with_opts(
                    HistogramOpts::new("layertap_batch_tokens", "Tokens per batch").buckets(buckets(16.0, 2.0, 14)),
                )
                .unwrap(),
            ),
            batch_sequences: reg(
                &r,
                Histogram::with_opts(
                    HistogramOpts::new("layertap_batch_sequences", "Sequences per batch")
                        .buckets(buckets(1.0, 2.0, 11)),
                )
                .unwrap(),
            ),
            tokens: reg(&r, IntCounter::new("layertap_tokens_total", "Tokens run through the model").unwrap()),
            sequences_cancelled: reg(
                &r,
                IntCounter::new(
                    "layertap_cancelled_sequences_total",
                    "Sequences dropped because their client went away: before running, or stopped between layers",
                )
                .unwrap(),
            ),
            hidden_state_bytes: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "layertap_hidden_state_bytes_total",
                        "Bytes of answers: stage=raw before compression, stage=encoded as sent",
                    ),
                    &["stage"],
                )
                .unwrap(),
            ),
            device_memory_used: reg(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "layertap_device_memory_used_bytes",
                        "Memory in use per device (GPU memory on CUDA, process resident memory on CPU)",
                    ),
                    &["device"],
                )
                .unwrap(),
            ),
            device_memory_total: reg(
                &r,
                IntGaugeVec::new(
                    Opts::new("layertap_device_memory_total_bytes", "Memory per device (GPU memory or host RAM)"),
                    &["device"],
                )
                .unwrap(),
            ),
            model_info: reg(
                &r,
                IntGaugeVec::new(
                    Opts::new("layertap_model_info", "The served model (value 1)"),
                    &["model", "architecture", "num_layers", "hidden_size", "dtype"],
                )
                .unwrap(),
            ),
            batches_cancelled: reg(
                &r,
                IntCounter::new(
                    "layertap_cancelled_batches_total",
                    "Batches stopped between layers because every request in them had gone",
                )
                .unwrap(),
            ),
            oom_retries: reg(
                &r,
                IntCounter::new(
                    "layertap_oom_retries_total",
                    "Batches that ran out of device memory and were retried in smaller pieces (or once more alone)",
                )
                .unwrap(),
            ),
            batch_token_budget: reg(
                &r,
                IntGauge::new(
                    "layertap_batch_token_budget",
                    "Most tokens per batch now (lowered when a batch runs out of device memory)",
                )
                .unwrap(),
            ),
            selfcheck_error: reg(
                &r,
                GaugeVec::new(
                    Opts::new(
                        "layertap_selfcheck_relative_error",
                        "Start-up self-check: relative error of the serving path against the portable f32 path, per \
                         device and hidden-state index (+Inf where the serving path returned a non-finite value)",
                    ),
                    &["device", "index"],
                )
                .unwrap(),
            ),
            selfcheck_seconds: reg(
                &r,
                GaugeVec::new(
                    Opts::new(
                        "layertap_selfcheck_seconds",
                        "Start-up self-check: seconds it added to each device's start (the probe, and any wait for \
                         the reference past the device's own load)",
                    ),
                    &["device"],
                )
                .unwrap(),
            ),
            nonfinite: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "layertap_nonfinite_total",
                        "Returned token states holding a NaN or an infinity as sent, per layer (index, or final_prenorm); layer=\"logprobs\": rows whose log-probabilities are not finite",
                    ),
                    &["layer"],
                )
                .unwrap(),
            ),
            heap_in_use: reg(
                &r,
                IntGauge::new(
                    "layertap_heap_in_use_bytes",
                    "Host heap memory allocated and not yet freed, as the allocator counts it (glibc; 0 elsewhere); \
                     resident memory above it is freed memory the allocator has not handed back",
                )
                .unwrap(),
            ),
            answer_buffers_idle: reg(
                &r,
                IntGauge::new(
                    "layertap_answer_buffers_idle_bytes",
                    "Host memory held by idle answer buffers, kept for the next answers and freed once idle for 1 s",
                )
                .unwrap(),
            ),
            registry: r,
        }
    }

    /// The text exposition of every collector.
    pub fn render(&self) -> String {
        self.heap_in_use.set(i64::try_from(heap_in_use()).unwrap_or(i64::MAX));
        self.answer_buffers_idle.set(i64::try_from(crate::bufpool::idle_bytes()).unwrap_or(i64::MAX));
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Resident memory of this process and total host memory, in bytes (Linux; zeros elsewhere).
pub fn host_memory() -> (u64, u64) {
    let page = 4096u64;
    let rss = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
        .map(|p| p * page)
        .unwrap_or(0);
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0);
    (rss, total)
}

/// Bytes the host allocator has handed out and not had back: its arenas' chunks in use plus its
/// directly mapped blocks (glibc's `mallinfo2`; 0 with another C library). A leak grows this;
/// fragmentation grows only resident memory.
pub fn heap_in_use() -> u64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 only reads the allocator's statistics.
        let m = unsafe { libc::mallinfo2() };
        (m.uordblks + m.hblkhd) as u64
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scrape carries the allocator's count of heap in use, non-zero where glibc reports it.
    #[test]
    fn heap_in_use_is_scraped() {
        let text = Metrics::new().render();
        let value: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("layertap_heap_in_use_bytes "))
            .expect("layertap_heap_in_use_bytes in the scrape")
            .trim()
            .parse()
            .unwrap();
        if cfg!(all(target_os = "linux", target_env = "gnu")) {
            assert!(value > 0.0, "glibc reports no heap in use: {value}");
        }
    }
}
