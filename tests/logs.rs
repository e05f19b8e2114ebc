//! What the server logs: our faults once at ERROR, expected states lower, client-sent ids quoted,
//! no colour codes off a terminal.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use layertap::engine::ModelInfo;
use layertap::server::Setup;
use serde_json::json;

#[derive(Clone, Default)]
struct Buffer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Buffer {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Buffer {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_are_logged_once_at_error_and_expected_states_lower() {
    let logs = Buffer::default();
    let w = logs.clone();
    tracing_subscriber::fmt()
        .with_env_filter("debug")
        .with_ansi(false)
        .with_writer(move || w.clone())
        .try_init()
        .unwrap();
    // A model whose vocabulary is smaller than its tokenizer's: text gives an internal error.
    let info = ModelInfo { vocab_size: 50, ..fake_info() };
    let l = layertap::http::Limits { request_timeout: Duration::from_millis(200), ..limits() };
    let s = fake_server_with(Setup { info, ..fake_setup(l) }, Duration::from_secs(5)).await;
    let (running, control, base) = (s.running, s.control, s.base);
    let url = format!("{base}/v1/hidden-states");
    let r = client()
        .post(&url)
        .header("x-request-id", "abc\" forged=\"1")
        .json(&json!({"inputs": [{"text": "zebra quartz"}], "layers": [1]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 500);
    control.delay_ms.store(1000, std::sync::atomic::Ordering::SeqCst);
    let r = client().post(&url).json(&json!({"inputs": [{"input_ids": [1]}], "layers": [1]})).send().await.unwrap();
    assert_eq!(r.status(), 503, "timed out");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let text = logs.text();
    let errors: Vec<&str> = text.lines().filter(|l| l.contains(" ERROR ")).collect();
    assert_eq!(errors.len(), 1, "one ERROR line for the one fault: {errors:#?}");
    assert!(errors[0].contains("outside the model's vocabulary"), "{}", errors[0]);
    assert!(errors[0].contains(r#"request_id="abc\" forged=\"1""#), "the client's id is quoted: {}", errors[0]);
    assert!(text.lines().any(|l| l.contains(" WARN ") && l.contains("timed out")), "{text}");
    running.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_writes_no_colour_codes_to_a_pipe() {
    let (mut child, base) = serve_binary(&fixtures().join("tiny/llama_gqa_rope3"), &[], |c| {
        c.env("LAYERTAP_LOG", "debug").env_remove("NO_COLOR").stderr(Stdio::piped());
    })
    .await;
    let r = client().get(format!("{base}/v1/info")).header("x-request-id", "id with\tspace").send().await.unwrap();
    assert_eq!(r.status(), 200);
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    child.wait().unwrap();
    assert!(err.contains("ready"), "{err}");
    assert!(!err.contains('\u{1b}'), "colour codes on a pipe: {err}");
    assert!(err.contains(r#"request_id="id with\tspace""#), "{err}");
}
