//! Tokenization equals Hugging Face transformers: plain text and chats rendered with the template
//! (tiny fixture tokenizer; references from scripts/make_fixtures.py).

mod common;

use common::{fixtures, tiny_tokenizer};
use layertap::tokenizer::ChatMessage;
use serde_json::Value;

fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("tiny/tokenizer_reference.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

pub fn messages(v: &Value) -> Vec<ChatMessage> {
    serde_json::from_value(v.clone()).unwrap()
}

#[test]
fn text_ids_equal_transformers() {
    let tok = tiny_tokenizer();
    let r = reference();
    let texts = r["texts"].as_array().unwrap();
    assert!(texts.len() >= 4);
    for t in texts {
        assert_eq!(tok.encode_text(t["text"].as_str().unwrap()).unwrap(), ids(&t["input_ids"]), "{}", t["text"]);
    }
}

#[test]
fn chat_rendering_and_ids_equal_transformers() {
    let tok = tiny_tokenizer();
    let r = reference();
    for c in r["chats"].as_array().unwrap() {
        let msgs = messages(&c["messages"]);
        assert_eq!(tok.render_chat(&msgs, false).unwrap(), c["rendered"].as_str().unwrap());
        assert_eq!(tok.encode_chat(&msgs).unwrap().ids, ids(&c["input_ids"]));
    }
}

#[test]
fn loss_mask_covers_assistant_turns_and_their_end_marker_only() {
    let tok = tiny_tokenizer();
    let msgs = vec![
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Name a color."),
        ChatMessage::new("assistant", "Blue."),
        ChatMessage::new("user", "Another?"),
        ChatMessage::new("assistant", "Red."),
    ];
    let t = tok.encode_chat(&msgs).unwrap();
    assert_eq!(t.ids.len(), t.loss_mask.len());
    // Decode the masked runs: each must be an assistant answer followed by the end-of-turn text.
    let decoded: Vec<String> = common::masked_runs(&tok, &t).into_iter().map(|(_, text)| text).collect();
    assert_eq!(decoded, vec!["Blue.<|im_end|>\n".to_string(), "Red.<|im_end|>\n".to_string()]);
}

#[test]
fn a_model_without_chat_template_refuses_messages_clearly() {
    let dir = fixtures().join("tiny/qwen3_qknorm");
    let src = layertap::engine::TokenizerSource::HfFiles {
        tokenizer_json: dir.join("tokenizer.json"),
        tokenizer_config: None,
        chat_template: None,
    };
    let tok = layertap::tokenizer::TextTokenizer::from_source(&src).unwrap().unwrap();
    let e = tok.encode_chat(&[ChatMessage::new("user", "hi")]).unwrap_err();
    assert!(e.to_string().contains("no chat template"), "{e}");
}
