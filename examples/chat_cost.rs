//! What a chat's tokenization and loss mask cost (the rendering grows with messages × assistant
//! turns): `cargo run --release --example chat_cost`. The default model's chat template on chats
//! of 512 messages (`--max-messages`' default), and gpt-oss's released template on 64 turns
//! where `make tokenizers` has fetched its tokenizer.
use layertap::engine::loader::ModelFiles;
use layertap::tokenizer::{ChatMessage, TextTokenizer};

fn time(what: &str, tok: &TextTokenizer, msgs: &[ChatMessage]) {
    let runs = 5;
    let t0 = std::time::Instant::now();
    let mut ids = 0;
    for _ in 0..runs {
        ids = tok.encode_chat(msgs).expect("the chat tokenizes").ids.len();
    }
    println!("{what}: {:.3} s a chat ({ids} ids, mean of {runs})", t0.elapsed().as_secs_f64() / runs as f64);
}

fn main() {
    let f = ModelFiles::locate(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf").expect("run `make model` first");
    let tok = TextTokenizer::from_source(&f.tokenizer_source().unwrap()).unwrap().unwrap();
    for alternate in [true, false] {
        let msgs: Vec<ChatMessage> = (0..512)
            .map(|i| {
                let role = if alternate && i % 2 == 0 { "user" } else { "assistant" };
                ChatMessage::new(role, format!("Message number {i}."))
            })
            .collect();
        let turns = msgs.iter().filter(|m| m.role == "assistant").count();
        time(&format!("SmolLM2's template, 512 messages, {turns} assistant turns"), &tok, &msgs);
    }
    let Ok(json) = tokenizers::Tokenizer::from_file(".cache/tokenizers/gptoss/tokenizer.json") else {
        return println!("gpt-oss: skipped (run `make tokenizers`)");
    };
    let template = std::fs::read_to_string("tests/fixtures/chat/templates/gpt-oss.jinja").unwrap();
    let tok = TextTokenizer::new(json, Some(template), None, None);
    let mut msgs = vec![ChatMessage::new("system", "Be brief.")];
    for i in 0..64 {
        msgs.push(ChatMessage::new("user", format!("Question number {i}?")));
        msgs.push(ChatMessage::new("assistant", format!("Answer number {i}.")));
    }
    time("gpt-oss's template, 129 messages, 64 assistant turns", &tok, &msgs);
}
