//! Inputs other than JSONL of ids: ShareGPT conversations, and Parquet files (written here with
//! the crate's own writer, and by pyarrow) with bad rows, each input column and ShareGPT chats.

use std::collections::HashSet;

use serde_json::Value;

use crate::common::*;
use crate::{assert_states, entry, failures_of, file_path, ids_of, manifest, raw_tensors, run_extract};

// ---------------------------------------------------------------------------------------------
// ShareGPT chats
// ---------------------------------------------------------------------------------------------

/// A ShareGPT chat (`conversations` of `{from, value}`, read with `--messages-column
/// conversations`) gives the same tokens, loss mask and states as the same chat in `{role,
/// content}`; an unknown speaker is a failed sample naming it, and the rest land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharegpt_conversations_extract_as_the_same_chat_in_roles() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let (roles, sharegpt) = (dir.path().join("roles.jsonl"), dir.path().join("sharegpt.jsonl"));
    let chat = serde_json::json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there, how are you?"},
        {"role": "assistant", "content": "Very well, thank you."}]);
    let shared = serde_json::json!([
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi there, how are you?"},
        {"from": "gpt", "value": "Very well, thank you."}]);
    let odd = serde_json::json!([{"from": "narrator", "value": "Once"}]);
    std::fs::write(&roles, serde_json::json!({"id": "c", "messages": chat}).to_string() + "\n").unwrap();
    let lines = [
        serde_json::json!({"id": "c", "conversations": shared}),
        serde_json::json!({"id": "odd", "conversations": odd}),
    ];
    std::fs::write(&sharegpt, lines.iter().map(|l| l.to_string() + "\n").collect::<String>()).unwrap();
    let (out_roles, out_sharegpt) = (dir.path().join("out-roles"), dir.path().join("out-sharegpt"));
    let (code, err) = run_extract(&s.base, &roles, &out_roles, "2,-1", &[]).await;
    assert_eq!(code, Some(0), "{err}");
    let (code, err) =
        run_extract(&s.base, &sharegpt, &out_sharegpt, "2,-1", &["--messages-column", "conversations"]).await;
    assert_eq!(code, Some(1), "the unknown speaker fails its sample: {err}");
    let failures = failures_of(&out_sharegpt, "failures.jsonl");
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0]["id"], "odd");
    let error = failures[0]["error"].as_str().unwrap();
    assert!(error.contains("message 0: its from is \"narrator\", not one of human"), "{error}");
    let read = |out: &std::path::Path| read_safetensors_bytes(&std::fs::read(file_path(out, "c")).unwrap()).0;
    let (a, b) = (read(&out_roles), read(&out_sharegpt));
    assert!(b["loss_mask"].i64.contains(&1) && b["loss_mask"].i64.contains(&0), "a chat's loss mask");
    for name in ["input_ids", "loss_mask"] {
        assert_eq!(a[name].i64, b[name].i64, "{name}");
    }
    assert_eq!(a["hidden_states"].f32, b["hidden_states"].f32);
}

/// A chat's line carries its template variables and its messages their reasoning to the server,
/// as the API takes them; a variable the server sets itself fails that sample, naming it.
/// `--chat-template-kwargs` gives every chat its variables and is pinned in the folder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_lines_carry_template_variables_and_reasoning() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("chats.jsonl");
    let chat = serde_json::json!([
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two."}]);
    let lines = [
        serde_json::json!({"id": "plain", "messages": chat}),
        serde_json::json!({"id": "kw", "messages": chat, "chat_template_kwargs": {"reasoning_effort": "high"}}),
        serde_json::json!({"id": "bad", "messages": chat, "chat_template_kwargs": {"messages": []}}),
    ];
    std::fs::write(&input, lines.iter().map(|l| l.to_string() + "\n").collect::<String>()).unwrap();
    let out = dir.path().join("out");
    let (code, err) = run_extract(&s.base, &input, &out, "2,-1", &[]).await;
    assert_eq!(code, Some(1), "the bad line fails its sample: {err}");
    let failures = failures_of(&out, "failures.jsonl");
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0]["id"], "bad");
    let error = failures[0]["error"].as_str().unwrap();
    assert!(error.contains("422") && error.contains("chat_template_kwargs sets"), "{error}");
    let read = |id: &str| read_safetensors_bytes(&std::fs::read(file_path(&out, id)).unwrap()).0;
    let (a, b) = (read("plain"), read("kw"));
    assert!(a["loss_mask"].i64.contains(&1));
    assert_eq!(a["input_ids"].i64, b["input_ids"].i64, "this template reads neither variable");

    // --chat-template-kwargs for every chat: recorded in bulk.json; a run with others is refused.
    let out = dir.path().join("out-flag");
    let flag = ["--chat-template-kwargs", r#"{"enable_thinking": false}"#];
    let (code, err) = run_extract(&s.base, &input, &out, "2,-1", &flag).await;
    assert_eq!(code, Some(1), "{err}");
    let pinned: Value = serde_json::from_str(&std::fs::read_to_string(out.join("bulk.json")).unwrap()).unwrap();
    assert_eq!(pinned["settings"]["chat_template_kwargs"], serde_json::json!({"enable_thinking": false}));
    let other = ["--chat-template-kwargs", r#"{"enable_thinking": true}"#];
    let (code, err) = run_extract(&s.base, &input, &out, "2,-1", &other).await;
    assert_ne!(code, Some(0));
    assert!(err.contains("--chat-template-kwargs"), "{err}");
    for bad in ["[1]", "{not json", r#"{"eos_token": "x"}"#] {
        let (code, err) =
            run_extract(&s.base, &input, &dir.path().join("out-bad"), "2,-1", &["--chat-template-kwargs", bad]).await;
        assert_eq!(code, Some(2), "{bad}: {err}");
        assert!(err.contains("--chat-template-kwargs"), "{bad}: {err}");
    }
}

// ---------------------------------------------------------------------------------------------
// Parquet
// ---------------------------------------------------------------------------------------------

/// Writes a Parquet file with the crate's own writer: columns id (string), text (optional
/// string), n (int64) and ids (optional list of optional int64), in row groups of `group` rows.
type PqRow = (String, Option<String>, i64, Option<Vec<Option<i64>>>);

fn write_parquet(path: &std::path::Path, rows: &[PqRow], group: usize) {
    use parquet::basic::Compression;
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::types::ColumnPath;
    let schema = parquet::schema::parser::parse_message_type(
        "message schema {
            REQUIRED BYTE_ARRAY id (UTF8);
            OPTIONAL BYTE_ARRAY text (UTF8);
            REQUIRED INT64 n;
            OPTIONAL group ids (LIST) { REPEATED group list { OPTIONAL INT64 element; } }
        }",
    )
    .unwrap();
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(Default::default()))
        .set_column_compression(ColumnPath::from("text"), Compression::SNAPPY)
        .set_column_compression(
            ColumnPath::from(vec!["ids".into(), "list".into(), "element".into()]),
            Compression::GZIP(Default::default()),
        )
        .build();
    let file = std::fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(file, std::sync::Arc::new(schema), std::sync::Arc::new(props)).unwrap();
    for chunk in rows.chunks(group) {
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let ids: Vec<ByteArray> = chunk.iter().map(|r| ByteArray::from(r.0.as_str())).collect();
        col.typed::<ByteArrayType>().write_batch(&ids, None, None).unwrap();
        col.close().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let texts: Vec<ByteArray> = chunk.iter().filter_map(|r| r.1.as_deref().map(ByteArray::from)).collect();
        let defs: Vec<i16> = chunk.iter().map(|r| i16::from(r.1.is_some())).collect();
        col.typed::<ByteArrayType>().write_batch(&texts, Some(&defs), None).unwrap();
        col.close().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        col.typed::<Int64Type>().write_batch(&chunk.iter().map(|r| r.2).collect::<Vec<_>>(), None, None).unwrap();
        col.close().unwrap();
        // A list's levels: definition 0 null list, 1 empty list, 2 null element, 3 a value.
        let (mut vals, mut defs, mut reps) = (Vec::new(), Vec::new(), Vec::new());
        for r in chunk {
            match &r.3 {
                None => {
                    defs.push(0);
                    reps.push(0);
                }
                Some(l) if l.is_empty() => {
                    defs.push(1);
                    reps.push(0);
                }
                Some(l) => {
                    for (i, e) in l.iter().enumerate() {
                        reps.push(i16::from(i > 0));
                        defs.push(if e.is_some() { 3 } else { 2 });
                        vals.extend(*e);
                    }
                }
            }
        }
        let mut col = rg.next_column().unwrap().unwrap();
        col.typed::<Int64Type>().write_batch(&vals, Some(&defs), Some(&reps)).unwrap();
        col.close().unwrap();
        rg.close().unwrap();
    }
    w.close().unwrap();
}

/// The tensors of a run's file for `id` (via its manifest `m`), but the metadata.
fn tensors_of(
    out: &std::path::Path,
    m: &[Value],
    id: &str,
) -> std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    raw_tensors(&std::fs::read(out.join(entry(m, id)["file"].as_str().unwrap())).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_input_with_bad_rows_reports_them_with_id_and_row_and_the_rest_land() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("data.parquet");
    let rows: Vec<PqRow> = (0..12i64)
        .map(|i| {
            let text = (i != 3).then(|| format!("sample number {i} says hello"));
            let ids = match i {
                4 => Some(vec![]),
                6 => None,
                8 => Some(vec![Some(5), None, Some(6)]),
                9 => Some(vec![Some(FAKE_VOCAB as i64)]),
                10 => Some(vec![Some(-3)]),
                _ => Some((0..i % 4 + 1).map(|k| Some((i * 10 + k) % 500)).collect()),
            };
            (format!("r{i}"), text, i, ids)
        })
        .collect();
    write_parquet(&input, &rows, 5);

    // --ids-column: the reader's bad rows and the server's refusal are failures, the rest land.
    let out = dir.path().join("ids");
    let (code, err) = run_extract(&s.base, &input, &out, "1,-1", &["--ids-column", "ids", "--dtype", "float32"]).await;
    assert_eq!(code, Some(1), "{err}");
    let f = failures_of(&out, "failures.jsonl");
    let got: Vec<(String, u64)> =
        f.iter().map(|v| (v["id"].as_str().unwrap().into(), v["row"].as_u64().unwrap())).collect();
    let want: Vec<(String, u64)> = [4, 6, 8, 9, 10].iter().map(|&i| (format!("r{i}"), i)).collect();
    assert_eq!(got, want, "{f:?}");
    let msg = |id: &str| f.iter().find(|v| v["id"] == id).unwrap()["error"].as_str().unwrap().to_string();
    assert!(msg("r4").contains("empty"), "{}", msg("r4"));
    assert!(msg("r6").contains("null"), "{}", msg("r6"));
    assert!(msg("r8").contains("token id 1") && msg("r8").contains("null"), "{}", msg("r8"));
    assert!(msg("r9").contains("422"), "{}", msg("r9"));
    assert!(msg("r10").contains("-3"), "{}", msg("r10"));
    let m = manifest(&out);
    assert_eq!(
        ids_of(&m).into_iter().collect::<HashSet<_>>(),
        ["r0", "r1", "r2", "r3", "r5", "r7", "r11"].map(String::from).into_iter().collect()
    );
    for (id, _, _, ids) in &rows {
        if let Some(e) = m.iter().find(|v| v["id"] == id.as_str()) {
            let want: Vec<u32> = ids.as_ref().unwrap().iter().map(|x| x.unwrap() as u32).collect();
            let t = read_safetensors(&out.join(e["file"].as_str().unwrap()));
            assert_eq!(t["input_ids"].i64, want.iter().map(|&x| i64::from(x)).collect::<Vec<_>>(), "{id}");
            assert_states(&t, &want, &[1, FAKE_LAYERS], id);
        }
    }

    // --text-column, ids taken from a column that is not there: the row numbers. The same texts
    // from JSONL give the same states.
    let out = dir.path().join("text");
    let (code, err) = run_extract(&s.base, &input, &out, "2", &["--text-column", "text", "--id-column", "key"]).await;
    assert_eq!(code, Some(1), "{err}");
    let f = failures_of(&out, "failures.jsonl");
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!((f[0]["id"].as_str(), f[0]["row"].as_u64()), (Some("3"), Some(3)));
    assert!(f[0]["error"].as_str().unwrap().contains("null"), "{f:?}");
    let jsonl = dir.path().join("text.jsonl");
    let lines: String = rows
        .iter()
        .enumerate()
        .filter_map(|(i, r)| {
            r.1.as_ref().map(|t| serde_json::json!({"id": i.to_string(), "text": t}).to_string() + "\n")
        })
        .collect();
    std::fs::write(&jsonl, lines).unwrap();
    let out_j = dir.path().join("text-jsonl");
    let (code, err) = run_extract(&s.base, &jsonl, &out_j, "2", &[]).await;
    assert_eq!(code, Some(0), "{err}");
    let (m, mj) = (manifest(&out), manifest(&out_j));
    assert_eq!(m.len(), 11);
    for i in (0..12).filter(|&i| i != 3) {
        let id = i.to_string();
        let t = tensors_of(&out, &m, &id);
        assert!(t["input_ids"].1[0] > 0, "{id}");
        assert_eq!(t, tensors_of(&out_j, &mj, &id), "row {i}: Parquet and JSONL agree");
    }

    // A column of the wrong type: every row fails, and no request is made.
    s.control.seen.lock().unwrap().clear();
    let out = dir.path().join("n");
    let (code, err) = run_extract(&s.base, &input, &out, "1", &["--text-column", "n"]).await;
    assert_eq!(code, Some(1), "{err}");
    let f = failures_of(&out, "failures.jsonl");
    assert_eq!(f.len(), 12);
    assert!(f.iter().all(|v| v["error"].as_str().unwrap().contains("an integer, not a string")), "{f:?}");
    assert!(s.control.seen.lock().unwrap().is_empty());
    assert!(manifest(&out).is_empty());

    // Exactly one input column for Parquet; a missing column is named with those there.
    for (extra, says) in [
        (vec!["--text-column", "text", "--ids-column", "ids"], "exactly one"),
        (vec![], "exactly one"),
        (vec!["--messages-column", "chat"], "no column \"chat\" (its columns: id, text, n, ids)"),
    ] {
        let (code, err) = run_extract(&s.base, &input, &dir.path().join("refused"), "1", &extra).await;
        assert_eq!(code, Some(1), "{extra:?}: {err}");
        assert!(err.contains(says), "{extra:?}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_file_written_by_pyarrow_reads_its_text_messages_and_ids_columns() {
    // tests/fixtures/bulk/mixed.parquet, from scripts/make_parquet_fixture.py.
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let input = fixtures().join("bulk/mixed.parquet");
    let chat = |turns: &[(&str, &str)]| -> Value {
        turns.iter().map(|(r, c)| serde_json::json!({"role": r, "content": c})).collect()
    };
    let texts =
        [("a", "hello world"), ("c", "the quick brown fox"), ("d", "a b c"), ("e", "Zürich ✓"), ("f", "last row")];
    let chats = [
        ("a", chat(&[("user", "Hi"), ("assistant", "Hello!")])),
        ("d", chat(&[("system", "Be brief."), ("user", "What is 2+2?"), ("assistant", "4")])),
        ("e", chat(&[("user", "x"), ("assistant", "y")])),
    ];
    let ids: [(&str, Vec<u32>); 4] =
        [("a", vec![1, 2, 3]), ("d", vec![7]), ("e", vec![100, 200, 300, 400]), ("f", vec![511])];
    let expect_bad = |column: &str, out: &std::path::Path, want: &[(&str, u64, &str)]| {
        let f = failures_of(out, "failures.jsonl");
        let got: Vec<(&str, u64)> = f.iter().map(|v| (v["id"].as_str().unwrap(), v["row"].as_u64().unwrap())).collect();
        assert_eq!(got, want.iter().map(|w| (w.0, w.1)).collect::<Vec<_>>(), "{column}: {f:?}");
        for (v, w) in f.iter().zip(want) {
            assert!(v["error"].as_str().unwrap().contains(w.2), "{column}: {v}");
        }
    };

    let out = dir.path().join("ids");
    let (code, err) = run_extract(&s.base, &input, &out, "1,-1", &["--ids-column", "ids", "--dtype", "float32"]).await;
    assert_eq!(code, Some(1), "{err}");
    expect_bad("ids", &out, &[("b", 1, "empty"), ("c", 2, "null")]);
    let m = manifest(&out);
    assert_eq!(m.len(), 4);
    for (id, want) in &ids {
        let t = read_safetensors(&out.join(entry(&m, id)["file"].as_str().unwrap()));
        assert_eq!(t["input_ids"].i64, want.iter().map(|&x| i64::from(x)).collect::<Vec<_>>(), "{id}");
        assert_states(&t, want, &[1, FAKE_LAYERS], id);
    }

    // Text and messages: the same states as the same inputs given as JSONL.
    for (column, key, inputs, bad) in [
        (
            "--text-column",
            "text",
            texts.iter().map(|(i, t)| (*i, Value::from(*t))).collect::<Vec<_>>(),
            vec![("b", 1, "null")],
        ),
        (
            "--messages-column",
            "messages",
            chats.to_vec(),
            vec![("b", 1, "null"), ("c", 2, "message 1: its content is null"), ("f", 5, "empty")],
        ),
    ] {
        let out = dir.path().join(key);
        let col = key.to_string();
        let (code, err) = run_extract(&s.base, &input, &out, "2", &[column, &col]).await;
        assert_eq!(code, Some(1), "{column}: {err}");
        expect_bad(key, &out, &bad);
        let jsonl = dir.path().join(format!("{key}.jsonl"));
        let lines: String =
            inputs.iter().map(|(id, v)| serde_json::json!({"id": id, key: v}).to_string() + "\n").collect();
        std::fs::write(&jsonl, lines).unwrap();
        let out_j = dir.path().join(format!("{key}-jsonl"));
        let (code, err) = run_extract(&s.base, &jsonl, &out_j, "2", &[]).await;
        assert_eq!(code, Some(0), "{err}");
        let (m, mj) = (manifest(&out), manifest(&out_j));
        assert_eq!(m.len(), inputs.len(), "{column}");
        for (id, _) in &inputs {
            let t = tensors_of(&out, &m, id);
            assert!(t["input_ids"].1[0] > 0, "{column} {id}");
            assert_eq!(t, tensors_of(&out_j, &mj, id), "{column} {id}: Parquet and JSONL agree");
        }
    }
}

/// tests/fixtures/bulk/sharegpt.parquet (scripts/make_parquet_fixture.py): ShareGPT chats of
/// `{from, value}` read with `--messages-column conversations` give the same files as
/// mixed.parquet's `{role, content}` chats of the same messages; the unknown speaker is a
/// failed row naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_file_of_sharegpt_conversations_reads_as_the_same_chats_in_roles() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let (out, out_roles) = (dir.path().join("sharegpt"), dir.path().join("roles"));
    let input = fixtures().join("bulk/sharegpt.parquet");
    let (code, err) = run_extract(&s.base, &input, &out, "2", &["--messages-column", "conversations"]).await;
    assert_eq!(code, Some(1), "{err}");
    let f = failures_of(&out, "failures.jsonl");
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!((f[0]["id"].as_str(), f[0]["row"].as_u64()), (Some("odd"), Some(2)));
    assert!(f[0]["error"].as_str().unwrap().contains("message 0: its from is \"narrator\""), "{}", f[0]);
    let roles = fixtures().join("bulk/mixed.parquet");
    let (code, err) = run_extract(&s.base, &roles, &out_roles, "2", &["--messages-column", "messages"]).await;
    assert_eq!(code, Some(1), "{err}");
    let (m, mr) = (manifest(&out), manifest(&out_roles));
    assert_eq!(ids_of(&m).len(), 2, "{m:?}");
    for id in ["a", "d"] {
        let t = tensors_of(&out, &m, id);
        assert!(t["input_ids"].1[0] > 0, "{id}");
        assert_eq!(t, tensors_of(&out_roles, &mr, id), "{id}: ShareGPT and roles agree");
    }
}
