//! `--layout speculators`: the files speculators reads (fp8 with its scales as hs-connectors
//! reads them), resumed and verified like the plain layout's, and what the layout cannot hold
//! refused before any request.

use crate::common::*;
use crate::{
    assert_states, entry, file_path, manifest, p, raw_tensors, run_bulk, run_extract, tensor_start, write_input, xxh64,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_speculators_layout_writes_what_speculators_reads_and_resumes() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let (input, head) = (dir.path().join("data.jsonl"), dir.path().join("head.jsonl"));
    let (plain, spec) = (dir.path().join("plain"), dir.path().join("spec"));
    let samples: Vec<(String, Vec<u32>)> =
        (0..5u32).map(|i| (format!("conv/{i}"), (0..i + 1).map(|k| 50 + 10 * i + k).collect())).collect();
    let refs: Vec<(&str, Vec<u32>)> = samples.iter().map(|(id, ids)| (id.as_str(), ids.clone())).collect();
    write_input(&input, &refs);
    write_input(&head, &refs[..3]);
    let layers = ["--layers", "1,3,final_prenorm", "--dtype", "float32"];
    let args = |inp: &std::path::Path, out: &std::path::Path, layout: &str| -> Vec<String> {
        ["--server", &s.base, "--input", &p(inp), "--out", &p(out), "--layout", layout]
            .iter()
            .chain(&layers)
            .map(|x| x.to_string())
            .collect()
    };
    let run = |a: Vec<String>| async move { run_bulk(&a.iter().map(String::as_str).collect::<Vec<_>>()).await };
    let (code, err) = run(args(&input, &plain, "plain")).await;
    assert_eq!(code, Some(0), "{err}");
    // A first run over the first three samples, then the whole input: the three are not redone.
    let (code, err) = run(args(&head, &spec, "speculators")).await;
    assert_eq!(code, Some(0), "{err}");
    s.control.seen.lock().unwrap().clear();
    let (code, err) = run(args(&input, &spec, "speculators")).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("3 samples already done, 2 to go"), "{err}");
    let mut seen = s.control.seen.lock().unwrap().clone();
    seen.sort();
    let mut want: Vec<u32> = samples[3..].iter().flat_map(|(_, ids)| ids.clone()).collect();
    want.sort();
    assert_eq!(seen, want, "resume asked for the last two samples only");

    let pm = manifest(&plain);
    let sm = manifest(&spec);
    assert_eq!(sm.len(), 5);
    for (i, (id, ids)) in samples.iter().enumerate() {
        let name = format!("hs_{i}.safetensors");
        let e = entry(&sm, id);
        assert_eq!(e["file"], name.as_str(), "{id}");
        let bytes = std::fs::read(spec.join(&name)).unwrap();
        let t = raw_tensors(&bytes);
        assert_eq!(t.keys().collect::<Vec<_>>(), ["hidden_states", "token_ids"], "{id}: nothing else");
        let (dt, shape, hs) = &t["hidden_states"];
        assert_eq!((dt.as_str(), shape.clone()), ("F32", vec![ids.len(), 3, FAKE_HIDDEN]), "{id}");
        let (dt, shape, tok) = &t["token_ids"];
        assert_eq!((dt.as_str(), shape.clone()), ("I64", vec![ids.len()]), "{id}");
        let tok: Vec<i64> = tok.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(tok, ids.iter().map(|&x| i64::from(x)).collect::<Vec<_>>(), "{id}: token_ids are the input ids");
        let plain_bytes = std::fs::read(plain.join(entry(&pm, id)["file"].as_str().unwrap())).unwrap();
        assert_eq!(hs, &raw_tensors(&plain_bytes)["hidden_states"].2, "{id}: the plain layout's states");
        let (vals, _) = read_safetensors_bytes(&bytes);
        assert_states(&vals, ids, &[1, 3, FAKE_LAYERS + 1], id);
        assert_eq!(e["xxh64"], xxh64(&bytes), "{id}");
        assert_eq!(e["checksums"]["hidden_states"], xxh64(hs), "{id}");
        assert_eq!(e["checksums"]["token_ids"], xxh64(&t["token_ids"].2), "{id}");
    }
    let mut names: Vec<String> =
        std::fs::read_dir(&spec).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    let mut want: Vec<String> = (0..5).map(|i| format!("hs_{i}.safetensors")).collect();
    want.extend(["bulk.json", "failures.jsonl", "manifest.jsonl"].map(String::from));
    want.sort();
    assert_eq!(names, want, "one flat folder");

    // --verify checks this layout too: its files carry their own checksums.
    let (code, err) = run_bulk(&["--verify", "--out", &p(&spec)]).await;
    assert_eq!(code, Some(0), "{err}");
    let mut bytes = std::fs::read(spec.join("hs_2.safetensors")).unwrap();
    let at = tensor_start(&bytes, "token_ids");
    bytes[at] ^= 0x01;
    std::fs::write(spec.join("hs_2.safetensors"), bytes).unwrap();
    // A change in the header leaves every tensor intact: only the whole file's xxh64 sees it.
    let mut bytes = std::fs::read(spec.join("hs_3.safetensors")).unwrap();
    let at = bytes.windows(11).position(|w| w == b"speculators").unwrap();
    bytes[at] = b'S';
    std::fs::write(spec.join("hs_3.safetensors"), bytes).unwrap();
    let (code, err) = run_bulk(&["--verify", "--out", &p(&spec)]).await;
    assert_eq!(code, Some(1), "{err}");
    let line_of = |id: &str| err.lines().find(|l| l.starts_with(&format!("{id}: "))).unwrap_or_default().to_string();
    let two = line_of("conv/2");
    assert!(two.starts_with("conv/2: hs_2.safetensors: corrupt") && two.contains("token_ids"), "{err}");
    let three = line_of("conv/3");
    assert!(three.starts_with("conv/3: hs_3.safetensors: corrupt") && three.contains("xxh64"), "{err}");
    // Manifest lines are in the order samples finished, which several in flight make vary.
    let mut left: Vec<String> = manifest(&spec).iter().map(|v| v["id"].as_str().unwrap().to_string()).collect();
    left.sort();
    assert_eq!(left, ["conv/0", "conv/1", "conv/4"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_speculators_layout_cannot_hold_is_refused_before_any_request() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("data.jsonl");
    write_input(&input, &[("a", vec![1, 2, 3])]);
    for (extra, says) in [(["--tokens", "assistant"], "--tokens all"), (["--tokens", "last:2"], "--tokens all")] {
        let out = dir.path().join(format!("out-{}", extra[1]));
        let mut args = vec!["--server", &s.base, "--input", &input.to_str().unwrap(), "--out", out.to_str().unwrap()];
        args.extend(["--layers", "1,final_prenorm", "--layout", "speculators"]);
        args.extend(extra);
        let (code, err) = run_bulk(&args).await;
        assert_eq!(code, Some(1), "{extra:?}: {err}");
        assert!(err.contains(says) && err.contains("speculators"), "{extra:?}: {err}");
        assert!(s.control.seen.lock().unwrap().is_empty(), "{extra:?}: a request was made");
        assert!(!out.join("hs_0.safetensors").exists());
    }
    // The plain layout takes fp8 (with its scales) and selections.
    let out = dir.path().join("plain-fp8");
    let (code, err) = run_extract(&s.base, &input, &out, "1", &["--dtype", "fp8"]).await;
    assert_eq!(code, Some(0), "{err}");
    let t = raw_tensors(&std::fs::read(file_path(&out, "a")).unwrap());
    assert_eq!((t["hidden_states"].0.as_str(), t["hidden_states_scale"].1.clone()), ("F8_E4M3", vec![3, 1]));
}

/// fp8 in the speculators layout: the answer's fp8 states as they came, and its scales as
/// `hidden_states_scales` [T, n_layers, 1] f32, which hs-connectors' fp8 reader multiplies in
/// (broadcasting over the hidden size); checksummed like the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fp8_in_the_speculators_layout_carries_its_scales_as_hs_connectors_reads_them() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("data.jsonl");
    let samples: Vec<(&str, Vec<u32>)> = vec![("a", vec![7, 8, 9, 10]), ("b", vec![300, 2])];
    write_input(&input, &samples);
    let (plain, spec) = (dir.path().join("plain"), dir.path().join("spec"));
    for (out, layout) in [(&plain, "plain"), (&spec, "speculators")] {
        let (code, err) = run_bulk(&[
            "--server",
            &s.base,
            "--input",
            &p(&input),
            "--out",
            &p(out),
            "--layers",
            "1,final_prenorm",
            "--dtype",
            "fp8",
            "--layout",
            layout,
        ])
        .await;
        assert_eq!(code, Some(0), "{layout}: {err}");
    }
    let (pm, sm) = (manifest(&plain), manifest(&spec));
    for (i, (id, ids)) in samples.iter().enumerate() {
        let bytes = std::fs::read(spec.join(format!("hs_{i}.safetensors"))).unwrap();
        let t = raw_tensors(&bytes);
        let mut names: Vec<&String> = t.keys().collect();
        names.sort();
        assert_eq!(names, ["hidden_states", "hidden_states_scales", "token_ids"], "{id}");
        let answer = raw_tensors(&std::fs::read(plain.join(entry(&pm, id)["file"].as_str().unwrap())).unwrap());
        let (dt, shape, hs) = &t["hidden_states"];
        assert_eq!((dt.as_str(), shape.clone()), ("F8_E4M3", vec![ids.len(), 2, FAKE_HIDDEN]), "{id}");
        assert_eq!(hs, &answer["hidden_states"].2, "{id}: the answer's fp8 states");
        let (dt, shape, scales) = &t["hidden_states_scales"];
        assert_eq!((dt.as_str(), shape.clone()), ("F32", vec![ids.len(), 2, 1]), "{id}");
        assert_eq!(scales, &answer["hidden_states_scale"].2, "{id}: the answer's scales, one per token and layer");
        assert!(scales.chunks_exact(4).all(|c| f32::from_le_bytes(c.try_into().unwrap()) > 0.0), "{id}");
        let e = entry(&sm, id);
        assert_eq!(e["checksums"]["hidden_states_scales"], xxh64(scales), "{id}");
        assert_eq!(e["xxh64"], xxh64(&bytes), "{id}");
    }
    let (code, err) = run_bulk(&["--verify", "--out", &p(&spec)]).await;
    assert_eq!(code, Some(0), "{err}");
}
