//! glibc's thresholds as layertap sets them at start-up: a batch's large temporaries, freed,
//! are reused by the next batch instead of coming back from the kernel as fresh pages.
#![cfg(all(target_os = "linux", target_env = "gnu"))]

/// Minor page faults of the calling thread so far.
fn faults() -> i64 {
    // SAFETY: getrusage writes the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) }, 0);
    u.ru_minflt
}

/// One "batch": temporaries of the given sizes in MiB, all alive at once, every page written,
/// then freed.
fn batch(sizes: &[usize]) -> i64 {
    let before = faults();
    let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&m| vec![0u8; m << 20]).collect();
    for b in &mut bufs {
        for i in (0..b.len()).step_by(4096) {
            b[i] = 1;
        }
    }
    std::hint::black_box(&bufs);
    drop(bufs);
    faults() - before
}

/// Batches of different shapes one after another, as a server's are: after the first of each
/// shape, the memory comes from what earlier batches freed.
#[test]
fn freed_batches_are_reused_without_page_faults() {
    layertap::server::reuse_large_allocations();
    let shapes: [&[usize]; 3] = [&[24, 24], &[10, 10, 10, 10, 10, 10], &[30, 2, 16]];
    let first: Vec<i64> = shapes.iter().map(|s| batch(s)).collect();
    let later: Vec<i64> = (0..12).map(|i| batch(shapes[i % 3])).collect();
    eprintln!("page faults: first batches {first:?}, later batches {later:?}");
    assert!(first[0] >= (24 << 20) / 4096, "the first batch maps fresh memory: {first:?}");
    for (i, &f) in later.iter().enumerate() {
        let pages: usize = shapes[i % 3].iter().map(|m| (m << 20) / 4096).sum();
        assert!(f < pages as i64 / 10, "batch {} took {f} page faults for {pages} pages: memory was not reused", i + 4);
    }
}
