//! Reused buffers for encoded answers.
//!
//! An answer of a long sequence is tens to hundreds of megabytes. Written into a fresh vector,
//! every page of it is a page fault that the kernel zero-fills, and freeing it hands the pages
//! back (glibc maps allocations over 32 MiB on their own; smaller ones go back with the periodic
//! `malloc_trim`). On the benchmark host that system time was more than half of what an
//! identity answer cost to encode (bench/RESULTS.md, "Answers into reused buffers"). Answers
//! are therefore written into buffers taken from this pool; a buffer comes back when the last
//! reference to the answer's bytes is dropped (the response has been written to its socket).
//!
//! Idle buffers are bounded ([`MAX_IDLE`] of them, [`MAX_IDLE_BYTES`] in all) and freed once
//! they have been idle for a moment ([`release_idle`], called by the server's memory trimming
//! thread), so memory at rest goes back to the system as before.

use std::sync::Mutex;

/// Buffers smaller than this are plain vectors: the allocator reuses them cheaply.
pub const MIN_POOLED: usize = 1 << 20;
/// Idle buffers kept at most.
pub const MAX_IDLE: usize = 64;
/// Bytes of idle buffers kept at most.
pub const MAX_IDLE_BYTES: usize = 4 << 30;
/// New buffers are sized in steps of this many bytes, so answers of similar sizes share them.
const STEP: usize = 1 << 20;

struct Idle {
    buf: Vec<u8>,
    /// When it was given back.
    since: std::time::Instant,
}

struct Pool {
    idle: Vec<Idle>,
    bytes: usize,
}

static POOL: Mutex<Pool> = Mutex::new(Pool { idle: Vec::new(), bytes: 0 });

fn pool() -> std::sync::MutexGuard<'static, Pool> {
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// An empty buffer that holds at least `capacity` bytes without growing: an idle one from the
/// pool when one fits (the smallest that does, and not more than twice the size asked plus a
/// step, so small answers do not hold large buffers), else a new one.
pub fn take(capacity: usize) -> AnswerBuf {
    if capacity < MIN_POOLED {
        return AnswerBuf { buf: Vec::with_capacity(capacity), pooled: false };
    }
    let reused = {
        let mut p = pool();
        let fit = p
            .idle
            .iter()
            .enumerate()
            .filter(|(_, b)| b.buf.capacity() >= capacity && b.buf.capacity() <= 2 * capacity + STEP)
            .min_by_key(|(_, b)| b.buf.capacity())
            .map(|(i, _)| i);
        fit.map(|i| {
            let b = p.idle.swap_remove(i).buf;
            p.bytes -= b.capacity();
            b
        })
    };
    let buf = reused.unwrap_or_else(|| Vec::with_capacity(capacity.next_multiple_of(STEP)));
    AnswerBuf { buf, pooled: true }
}

fn give_back(mut buf: Vec<u8>) {
    buf.clear();
    let cap = buf.capacity();
    let mut p = pool();
    p.idle.push(Idle { buf, since: std::time::Instant::now() });
    p.bytes += cap;
    // Over the bounds, the smallest go first: the large ones fit every answer.
    while p.idle.len() > MAX_IDLE || p.bytes > MAX_IDLE_BYTES {
        let Some(i) = p.idle.iter().enumerate().min_by_key(|(_, b)| b.buf.capacity()).map(|(i, _)| i) else {
            break;
        };
        let b = p.idle.swap_remove(i);
        p.bytes -= b.buf.capacity();
    }
}

/// Frees the buffers idle for `at_least` or longer; returns how many bytes that freed.
pub fn release_idle(at_least: std::time::Duration) -> usize {
    let freed: Vec<Idle> = {
        let mut p = pool();
        let (freed, keep): (Vec<Idle>, Vec<Idle>) =
            std::mem::take(&mut p.idle).into_iter().partition(|b| b.since.elapsed() >= at_least);
        p.idle = keep;
        p.bytes = p.idle.iter().map(|b| b.buf.capacity()).sum();
        freed
    };
    // Freed outside the lock.
    freed.iter().map(|b| b.buf.capacity()).sum()
}

/// Bytes held by idle buffers.
pub fn idle_bytes() -> usize {
    pool().bytes
}

/// Bytes being written or waiting to be sent; back to the pool when dropped (when it came from
/// the pool).
pub struct AnswerBuf {
    buf: Vec<u8>,
    pooled: bool,
}

impl AnswerBuf {
    /// The bytes as a vector of their own (the buffer does not go back to the pool).
    pub fn into_vec(mut self) -> Vec<u8> {
        self.pooled = false;
        std::mem::take(&mut self.buf)
    }

    /// The bytes for a response body, without a copy; the buffer goes back to the pool when the
    /// body (every clone of it) is dropped.
    pub fn into_bytes(self) -> bytes::Bytes {
        if self.pooled {
            bytes::Bytes::from_owner(self)
        } else {
            bytes::Bytes::from(self.into_vec())
        }
    }

    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// The vector itself, for writers that fill a `Vec<u8>` (a zstd decoder's output, say); the
    /// buffer still goes back to the pool when dropped.
    pub fn as_mut_vec(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }
}

impl std::ops::Deref for AnswerBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.buf
    }
}

impl std::ops::DerefMut for AnswerBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

impl AsRef<[u8]> for AnswerBuf {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl std::io::Write for AnswerBuf {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn write_all(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.buf.extend_from_slice(data);
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for AnswerBuf {
    fn drop(&mut self) {
        if self.pooled && self.buf.capacity() >= MIN_POOLED {
            give_back(std::mem::take(&mut self.buf));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The pool is one per process: the tests that use it take turns.
    static SERIAL: Mutex<()> = Mutex::new(());

    /// A buffer given back is the one the next answer of a similar size writes into; a much
    /// smaller answer gets a new one; small answers are never pooled.
    #[test]
    fn buffers_come_back_and_are_reused() {
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        release_idle(Duration::ZERO);
        let mut a = take(4 << 20);
        std::io::Write::write_all(&mut a, &[7u8; 100]).unwrap();
        let (ptr, cap) = (a.as_ptr(), a.capacity());
        let body = a.into_bytes();
        let clone = body.clone();
        drop(body);
        assert_eq!(idle_bytes(), 0, "still referenced by a clone of the body");
        assert_eq!(&clone[..], &[7u8; 100][..]);
        drop(clone);
        assert_eq!(idle_bytes(), cap, "back in the pool once every reference is gone");
        let b = take(3 << 20);
        assert_eq!((b.as_ptr(), b.capacity(), b.len()), (ptr, cap, 0), "the same buffer, empty");
        let small = take(64 << 10);
        assert!(!small.pooled);
        drop(b);
        let tiny = take(MIN_POOLED);
        assert_ne!(tiny.as_ptr(), ptr, "a buffer of 4 MiB is not lent to an answer of 1 MiB");
        drop(tiny);
        release_idle(Duration::ZERO);
    }

    /// A buffer filled as a vector (what a zstd decoder writes into) holds what was written and
    /// still comes back to the pool.
    #[test]
    fn a_buffer_filled_as_a_vector_comes_back() {
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        release_idle(Duration::ZERO);
        let data: Vec<u8> = (0..(3u32 << 20)).map(|i| (i % 251) as u8).collect();
        let frame = zstd::bulk::compress(&data, 1).unwrap();
        let mut out = take(data.len());
        let cap = out.capacity();
        zstd::bulk::Decompressor::new().unwrap().decompress_to_buffer(&frame[..], out.as_mut_vec()).unwrap();
        assert_eq!(&out[..], &data[..]);
        assert_eq!(out.capacity(), cap, "decoded in place, not grown");
        drop(out);
        assert_eq!(idle_bytes(), cap);
        release_idle(Duration::ZERO);
    }

    /// Idle buffers go once idle for the time given; the bounds hold.
    #[test]
    fn idle_buffers_are_freed_and_the_bounds_hold() {
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        release_idle(Duration::ZERO);
        drop(take(2 << 20));
        let held = idle_bytes();
        assert!(held >= 2 << 20);
        assert_eq!(release_idle(Duration::from_secs(3600)), 0, "idle for less than that: kept");
        assert_eq!(idle_bytes(), held);
        std::thread::sleep(Duration::from_millis(20));
        // Other tests of this crate run beside this one and may return buffers of their own to
        // the pool meanwhile: at least this test's are freed.
        assert!(release_idle(Duration::from_millis(10)) >= held, "idle for longer: freed");
        let many: Vec<AnswerBuf> = (0..MAX_IDLE + 8).map(|_| take(MIN_POOLED)).collect();
        drop(many);
        assert_eq!(pool().idle.len(), MAX_IDLE);
        assert!(idle_bytes() <= MAX_IDLE_BYTES);
        let v = take(MIN_POOLED).into_vec();
        assert!(v.capacity() >= MIN_POOLED);
        assert_eq!(pool().idle.len(), MAX_IDLE - 1, "a buffer taken as a vector does not come back");
        release_idle(Duration::ZERO);
        assert_eq!(idle_bytes(), 0);
    }
}
