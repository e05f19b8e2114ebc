//! `--top-k`: the plain layout's files carry the server's log-probabilities as they came; the
//! speculators layout, which has no slot for them, refuses the flag before any request.

use crate::common::*;
use crate::{file_path, manifest, run_extract, write_input};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_k_adds_the_logprobs_to_each_plain_file_and_speculators_refuses_it() {
    let (running, base) = real_server("tiny/qwen2_bias_tied", limits()).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("data.jsonl");
    write_input(&input, &[("a", vec![5, 6, 7, 8]), ("b", vec![9, 10])]);
    let out = dir.path().join("out");
    let (code, err) =
        run_extract(&base, &input, &out, "-1", &["--top-k", "3", "--target-logprobs", "--tokens", "last:2"]).await;
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(manifest(&out).len(), 2);
    for (id, rows) in [("a", 2), ("b", 2)] {
        let bytes = std::fs::read(file_path(&out, id)).unwrap();
        layertap::answer::checksum::verify_checksums(&bytes).unwrap();
        let (t, meta) = read_safetensors_bytes(&bytes);
        assert_eq!(meta["top_k"], "3");
        assert_eq!(t["topk_ids"].shape, vec![rows, 3], "{id}");
        assert_eq!(t["topk_logprobs"].shape, vec![rows, 3], "{id}");
        let target = &t["target_logprobs"].f32;
        assert_eq!(target.len(), rows);
        assert!(target[rows - 1].is_nan() && target[..rows - 1].iter().all(|x| x.is_finite()), "{id}: {target:?}");
    }
    let spec = dir.path().join("spec");
    let (code, err) = run_extract(&base, &input, &spec, "-1", &["--top-k", "3", "--layout", "speculators"]).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--layout speculators cannot hold --top-k") && err.contains("--layout plain"), "{err}");
    assert!(!spec.join("manifest.jsonl").exists());
    let (code, err) = run_extract(&base, &input, &spec, "-1", &["--target-logprobs"]).await;
    assert_eq!(code, Some(2), "--target-logprobs needs --top-k: {err}");
    running.shutdown.cancel();
    running.task.await.unwrap().unwrap();
}
