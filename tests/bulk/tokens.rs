//! `--tokens`: which rows a file keeps (all, the assistant turns, the last k) and their positions.

use crate::common::*;
use crate::{assert_states, file_path, run_extract};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_values_other_than_all_assistant_and_last_k_are_refused_at_parse_time() {
    for bad in ["last:0", "last:", "last:-1", "first:2", "ranges", "Assistant"] {
        let (code, err) = run_extract(
            "http://127.0.0.1:9",
            std::path::Path::new("x"),
            std::path::Path::new("y"),
            "1",
            &["--tokens", bad],
        )
        .await;
        assert_eq!(code, Some(2), "{bad}: {err}");
        assert!(err.contains("--tokens") && err.contains("last:"), "{bad}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_assistant_and_last_k_keep_the_selected_rows_and_their_positions() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("data.jsonl");
    let lines = [
        serde_json::json!({"id": "chat", "messages": [
            {"role": "user", "content": "Hi there, how are you?"},
            {"role": "assistant", "content": "Very well, thank you."}]}),
        serde_json::json!({"id": "ids", "input_ids": [3, 4, 5, 6, 7]}),
        serde_json::json!({"id": "one", "input_ids": [9]}),
    ];
    std::fs::write(&input, lines.iter().map(|l| l.to_string() + "\n").collect::<String>()).unwrap();
    let mut outs = Vec::new();
    for tokens in ["all", "assistant", "last:2"] {
        let out = dir.path().join(tokens.replace(':', "-"));
        let (code, err) = run_extract(&s.base, &input, &out, "2,-1", &["--tokens", tokens]).await;
        assert_eq!(code, Some(0), "{tokens}: {err}");
        outs.push(out);
    }
    let mut partial = false;
    for id in ["chat", "ids", "one"] {
        let read = |out: &std::path::Path| {
            let bytes = std::fs::read(file_path(out, id)).unwrap();
            read_safetensors_bytes(&bytes)
        };
        let (full, meta) = read(&outs[0]);
        assert_eq!(meta["tokens"], "all");
        assert!(!full.contains_key("positions"));
        let ids = &full["input_ids"].i64;
        let mask = &full["loss_mask"].i64;
        let n = ids.len();
        let assistant: Vec<usize> = (0..n).filter(|&i| mask[i] == 1).collect();
        partial |= !assistant.is_empty() && assistant.len() < n;
        for (out, rows, label) in
            [(&outs[1], assistant, "assistant"), (&outs[2], (n.saturating_sub(2)..n).collect(), "last:2")]
        {
            let (t, meta) = read(out);
            assert_eq!(meta["tokens"], label, "{id}");
            let what = format!("{id} with --tokens {label}");
            assert_eq!(t["positions"].i64, rows.iter().map(|&r| r as i64).collect::<Vec<_>>(), "{what}");
            assert_eq!(t["input_ids"].i64, rows.iter().map(|&r| ids[r]).collect::<Vec<_>>(), "{what}");
            assert_eq!(t["loss_mask"].i64, rows.iter().map(|&r| mask[r]).collect::<Vec<_>>(), "{what}");
            let sel: Vec<u32> = rows.iter().map(|&r| ids[r] as u32).collect();
            assert_states(&t, &sel, &[2, FAKE_LAYERS], &what);
            let width = 2 * FAKE_HIDDEN;
            let want: Vec<f32> =
                rows.iter().flat_map(|&r| full["hidden_states"].f32[r * width..(r + 1) * width].to_vec()).collect();
            assert_eq!(t["hidden_states"].f32, want, "{what}: the full run's rows");
        }
    }
    assert!(partial, "the chat sample has rows outside the assistant turn");
}
