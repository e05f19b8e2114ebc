//! How answers are encoded side by side: a bound on the threads all answers compress on at once,
//! and the zstd threads one answer uses. The format itself is [`crate::answer::codec`].

/// The most threads answers compress on at once, over all answers: every core but two (left to
/// the device threads, which launch kernels and copy the states to the host, and to the
/// runtime's connections), at least one. Before the bound each answer over 8 MiB started its own
/// 8 zstd workers, and with 256 requests in flight the server delivered fewer tokens per second
/// than with 64 (bench/RESULTS.md, "HTTP for the hybrids").
pub fn encode_threads() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()).saturating_sub(2).max(1))
}

/// The zstd threads one answer of `raw_bytes` uses: one, or for answers over 8 MiB the number in
/// `LAYERTAP_ZSTD_THREADS` (at most [`encode_threads`]). One thread per answer, with answers
/// compressed side by side, is the default: answers in flight give the parallelism.
pub fn zstd_threads(raw_bytes: usize) -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let n =
        *N.get_or_init(|| std::env::var("LAYERTAP_ZSTD_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(1usize));
    if raw_bytes > 8 << 20 {
        n.clamp(1, encode_threads())
    } else {
        1
    }
}

/// A count of threads for encoding answers, shared by the answers in flight.
pub struct EncodeSlots {
    sem: tokio::sync::Semaphore,
    max: usize,
}

impl EncodeSlots {
    pub fn new(max: usize) -> Self {
        let max = max.max(1);
        EncodeSlots { sem: tokio::sync::Semaphore::new(max), max }
    }

    /// Waits until `threads` (at most all of them) are free and holds them while the permit
    /// lives. Waiters are served in arrival order.
    pub async fn acquire(&self, threads: usize) -> tokio::sync::SemaphorePermit<'_> {
        let n = threads.clamp(1, self.max) as u32;
        // The semaphore is never closed, so acquiring only waits.
        self.sem.acquire_many(n).await.expect("the encoding semaphore is never closed")
    }
}

/// [`EncodeSlots::acquire`] on the process's [`encode_threads`].
pub async fn encode_permit(threads: usize) -> tokio::sync::SemaphorePermit<'static> {
    static SLOTS: std::sync::OnceLock<EncodeSlots> = std::sync::OnceLock::new();
    SLOTS.get_or_init(|| EncodeSlots::new(encode_threads())).acquire(threads).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Encoding never uses more threads than the slots hold: a request for more takes all of
    /// them, and the next waits until they are given back.
    #[tokio::test]
    async fn encode_slots_bound_the_threads() {
        use std::time::Duration;
        let slots = EncodeSlots::new(3);
        let big = slots.acquire(8).await;
        assert_eq!(slots.sem.available_permits(), 0, "a request for 8 of 3 threads takes the 3");
        assert!(
            tokio::time::timeout(Duration::from_millis(50), slots.acquire(1)).await.is_err(),
            "no thread is free while the first answer encodes"
        );
        drop(big);
        let one = tokio::time::timeout(Duration::from_secs(5), slots.acquire(1)).await.expect("a thread is free again");
        let two = tokio::time::timeout(Duration::from_secs(5), slots.acquire(2)).await.expect("two more are free");
        assert_eq!(slots.sem.available_permits(), 0);
        drop((one, two));
        assert_eq!(slots.sem.available_permits(), 3);
        assert_eq!(zstd_threads(1 << 20), 1);
    }
}
