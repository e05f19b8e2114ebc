//! Properties and seeds: text and chat tokenization and the chat template, alone and through
//! /v1/tokenize.

use std::path::Path;

use layertap::tokenizer::ChatMessage;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::{json, Value};

use crate::common;
use crate::oracle::check_error;
use crate::{call, check, config, fail_with, nasty_text, seed_texts, tokenizer};

fn chat() -> impl Strategy<Value = Vec<ChatMessage>> {
    let role = prop_oneof![
        8 => prop::sample::select(vec!["user", "assistant", "system", "tool"]).prop_map(String::from),
        1 => nasty_text(),
    ];
    let reasoning = prop_oneof![3 => Just(None), 1 => nasty_text().prop_map(Some)];
    prop::collection::vec(
        (role, nasty_text(), reasoning).prop_map(|(role, content, reasoning_content)| ChatMessage {
            role,
            content,
            reasoning_content,
        }),
        0..6,
    )
}

fn check_chat(m: &[ChatMessage]) -> Result<(), TestCaseError> {
    let tok = tokenizer();
    let r = tok.encode_chat(m);
    if m.is_empty() {
        check!(r.is_err(), "an empty chat was accepted");
        return Ok(());
    }
    // Roles the template does not know are refused, naming the first such message.
    if let Some(i) = m.iter().position(|x| !tok.roles().contains(&x.role)) {
        let e = match r {
            Err(layertap::tokenizer::TokenizeError::Invalid(e)) => e,
            other => return Err(TestCaseError::fail(format!("role {:?} was not refused: {other:?}", m[i].role))),
        };
        check!(e.contains(&format!("messages[{i}].role")), "the refusal names another message: {e}");
        return Ok(());
    }
    let t = r.map_err(|e| TestCaseError::fail(format!("chat refused: {e}")))?;
    check!(t.ids.len() == t.loss_mask.len(), "{} ids, {} mask", t.ids.len(), t.loss_mask.len());
    check!(t.loss_mask.iter().all(|&x| x <= 1), "mask values {:?}", t.loss_mask);
    check!(t.ids.iter().all(|&i| (i as usize) < tok.vocab_size()), "ids outside the vocabulary");
    let has_assistant = m.iter().any(|x| x.role == "assistant");
    check!(
        has_assistant == t.loss_mask.contains(&1),
        "assistant turn present: {has_assistant}, mask {:?}",
        t.loss_mask
    );
    // The ids are those of the rendered template, which holds every turn.
    let rendered = tok.render_chat(m, false).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let text = tok.decode(&t.ids).map_err(|e| TestCaseError::fail(e.to_string()))?;
    check!(text == rendered, "decoded {text:?} != rendered {rendered:?}");
    for x in m {
        check!(rendered.contains(&x.content) && rendered.contains(&x.role), "a turn is missing from {rendered:?}");
    }
    // Content's control-token text as plain text: the same text, the same turns counted.
    let split = layertap::tokenizer::Budget { split_special_tokens: true, ..layertap::tokenizer::Budget::unlimited() };
    let p = tok.encode_chat_within(m, &split).map_err(|e| TestCaseError::fail(format!("split chat refused: {e}")))?;
    check!(p.ids.len() == p.loss_mask.len(), "split: {} ids, {} mask", p.ids.len(), p.loss_mask.len());
    let text = tok.decode(&p.ids).map_err(|e| TestCaseError::fail(e.to_string()))?;
    check!(text == rendered, "split: decoded {text:?} != rendered {rendered:?}");
    check!(has_assistant == p.loss_mask.contains(&1), "split: assistant turn present: {has_assistant}");
    Ok(())
}

/// `encode_text(s)` and `/v1/tokenize {"text": s}` agree: the same ids, a mask of ones, or the
/// documented refusal when the text gives no tokens or too many.
fn check_text(s: &str) -> Result<(), TestCaseError> {
    let tok = tokenizer();
    let ids = tok.encode_text(s).map_err(|e| TestCaseError::fail(format!("text refused: {e}")))?;
    check!(tok.decode(&ids).ok().as_deref() == Some(s), "text does not round-trip: {s:?}");
    let body = serde_json::to_vec(&json!({"inputs": [{"text": s}]})).unwrap();
    let r = call("/v1/tokenize", &[("content-type", "application/json".into())], body);
    let max = common::limits().max_input_tokens;
    if ids.is_empty() || ids.len() > max {
        check!(r.status == if ids.is_empty() { 422 } else { 413 }, "{} tokens answered {}", ids.len(), r.status);
        return check_error(&r);
    }
    check!(r.status == 200, "status {} for {s:?}", r.status);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    check!(v["results"][0]["input_ids"] == json!(ids), "ids {} vs {ids:?}", v["results"][0]["input_ids"]);
    check!(v["results"][0]["loss_mask"] == json!(vec![1; ids.len()]), "mask {}", v["results"][0]["loss_mask"]);
    Ok(())
}

proptest! {
    #![proptest_config(config(256))]

    /// Arbitrary roles, contents and unicode: no panic, ids and loss_mask of equal length, the
    /// mask on exactly the chats with an assistant turn, and the ids decode to the rendering.
    #[test]
    fn chats_render_and_tokenize_consistently(m in chat()) {
        check_chat(&m)?;
    }

    #[test]
    fn text_tokenizes_like_the_tokenize_route(s in nasty_text()) {
        check_text(&s)?;
    }
}

// ---------------------------------------------------------------------------------------------
// Seeds
// ---------------------------------------------------------------------------------------------

/// Every seed string as text, as chat content and as a role, alone and in an assistant turn.
#[test]
fn seed_texts_tokenize_and_render() {
    let texts = seed_texts();
    assert!(texts.len() > 10);
    for t in &texts {
        let p = Path::new(t.as_str());
        fail_with(p, check_text(t));
        let user = ChatMessage::new("user", t.clone());
        let asst = ChatMessage::new("assistant", t.clone());
        let odd = ChatMessage::new(t.clone(), "hi");
        for chat in [vec![user.clone()], vec![user.clone(), asst.clone()], vec![odd.clone(), asst], vec![odd]] {
            fail_with(p, check_chat(&chat));
        }
    }
}
