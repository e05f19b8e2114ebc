//! `--shard I/N` and several servers: shards split the input the same way every time, run side
//! by side over two servers (one shut down midway) and land every sample once.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::Value;

use crate::common::*;
use crate::{assert_states, bulk_cmd, failures_of, ids_of, p, run_bulk, run_extract, walk, write_input, xxh64};

/// Every manifest of `out` (manifest.jsonl and manifest-I-of-N.jsonl), by name; complete lines
/// only (a run may be writing them). None before `out` exists.
fn manifests(out: &std::path::Path) -> std::collections::BTreeMap<String, Vec<Value>> {
    std::fs::read_dir(out)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().into_string().unwrap())
        .filter(|n| n.starts_with("manifest") && n.ends_with(".jsonl"))
        .map(|n| {
            let lines = std::fs::read_to_string(out.join(&n)).unwrap();
            (n, lines.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
        })
        .collect()
}

fn shard_of(id: &str, n: u64) -> u64 {
    xxhash_rust::xxh64::xxh64(id.as_bytes(), 0) % n
}

/// (answered, failed) of `base` in a run's closing report.
fn server_counts(err: &str, base: &str) -> (u64, u64) {
    let line = err
        .lines()
        .find(|l| l.starts_with(&format!("server {base}: ")))
        .unwrap_or_else(|| panic!("no report for {base}: {err}"));
    let num = |what: &str| -> u64 {
        let before = line.split(&format!(" {what}")).next().unwrap();
        before.rsplit(' ').next().unwrap().parse().unwrap_or_else(|_| panic!("{line}"))
    };
    (num("answered"), num("failed"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_shards_over_two_servers_one_shut_down_midway_land_every_sample_once() {
    let a = fake_server(limits(), vec![]).await;
    let b = fake_server(limits(), vec![]).await;
    a.control.delay_ms.store(25, Ordering::SeqCst);
    b.control.delay_ms.store(25, Ordering::SeqCst);
    let dir = tempfile::tempdir().unwrap();
    let (input, out) = (dir.path().join("data.jsonl"), dir.path().join("out"));
    let samples: Vec<(String, Vec<u32>)> =
        (0..90u32).map(|i| (format!("s{i}"), (0..i % 5 + 1).map(|k| (i * 5 + k) % 500).collect())).collect();
    let refs: Vec<(&str, Vec<u32>)> = samples.iter().map(|(id, ids)| (id.as_str(), ids.clone())).collect();
    write_input(&input, &refs);
    let mut children = Vec::new();
    for k in 0..3 {
        let shard = format!("{k}/3");
        let mut args = vec!["--input".to_string(), p(&input), "--out".into(), p(&out), "--shard".into(), shard];
        if k == 0 {
            // The comma-separated form; the others repeat --server.
            args.extend(["--server".into(), format!("{},{}", a.base, b.base)]);
        } else {
            args.extend(["--server".into(), a.base.clone(), "--server".into(), b.base.clone()]);
        }
        args.extend(["--layers", "1,-1", "--dtype", "float32", "--concurrency", "2"].map(String::from));
        let mut c = bulk_cmd(&args.iter().map(String::as_str).collect::<Vec<_>>());
        children.push(c.spawn().unwrap());
    }
    let landed = || manifests(&out).values().map(Vec::len).sum::<usize>();
    for _ in 0..1000 {
        if landed() >= 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    b.running.shutdown.cancel();
    let at_shutdown = landed();
    assert!((20..80).contains(&at_shutdown), "server b should go down midway, {at_shutdown} had landed");
    let outputs = tokio::task::spawn_blocking(move || {
        children.into_iter().map(|c| c.wait_with_output().unwrap()).collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let (mut from_a, mut from_b, mut b_failed) = (0, 0, 0);
    for (k, o) in outputs.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(0), "shard {k}: {err}");
        let (ok_a, _) = server_counts(&err, &a.base);
        let (ok_b, fail_b) = server_counts(&err, &b.base);
        let m = &manifests(&out)[&format!("manifest-{k}-of-3.jsonl")];
        assert_eq!((ok_a + ok_b) as usize, m.len(), "shard {k}: the counts add up to its samples: {err}");
        from_a += ok_a;
        from_b += ok_b;
        b_failed += fail_b;
        assert!(failures_of(&out, &format!("failures-{k}-of-3.jsonl")).is_empty(), "shard {k}");
    }
    assert!(from_a > 0 && from_b > 0, "both servers answered: a {from_a}, b {from_b}");
    assert!(b_failed > 0, "requests to the shut-down server failed and went elsewhere");
    assert_eq!(from_a + from_b, 90);
    println!("{at_shutdown} samples had landed when server b shut down; a answered {from_a}, b {from_b}, {b_failed} requests to b failed and went to a");

    let all = manifests(&out);
    assert_eq!(
        all.keys().collect::<Vec<_>>(),
        ["manifest-0-of-3.jsonl", "manifest-1-of-3.jsonl", "manifest-2-of-3.jsonl"]
    );
    let mut union: Vec<String> = Vec::new();
    for (k, (_, m)) in all.iter().enumerate() {
        for id in ids_of(m) {
            assert_eq!(shard_of(&id, 3), k as u64, "{id} is shard {}'s", shard_of(&id, 3));
            union.push(id);
        }
    }
    assert_eq!(union.len(), 90, "every sample once: {union:?}");
    let distinct: HashSet<&String> = union.iter().collect();
    assert_eq!(distinct.len(), 90, "no sample twice");
    for m in all.values() {
        for e in m {
            let id = e["id"].as_str().unwrap();
            let ids = &samples.iter().find(|(i, _)| i == id).unwrap().1;
            let bytes = std::fs::read(out.join(e["file"].as_str().unwrap())).unwrap();
            assert_eq!(e["xxh64"], xxh64(&bytes), "{id}");
            assert_states(&read_safetensors_bytes(&bytes).0, ids, &[1, FAKE_LAYERS], id);
        }
    }
    let files: Vec<_> = walk(&out).into_iter().map(|f| p(f.strip_prefix(&out).unwrap())).collect();
    assert_eq!(files.iter().filter(|f| f.ends_with(".safetensors")).count(), 90, "{files:?}");
    assert!(!files.iter().any(|f| f.ends_with(".tmp")), "{files:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shard_split_is_deterministic_verify_knows_shards_and_bad_shards_are_refused() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("data.jsonl");
    let samples: Vec<(String, Vec<u32>)> = (0..40u32).map(|i| (format!("item-{i}"), vec![i + 1, i + 2])).collect();
    let refs: Vec<(&str, Vec<u32>)> = samples.iter().map(|(id, ids)| (id.as_str(), ids.clone())).collect();
    write_input(&input, &refs);
    let mut splits = Vec::new();
    for (run, conc) in [("one", "4"), ("two", "1")] {
        let out = dir.path().join(run);
        for k in 0..4 {
            let shard = format!("{k}/4");
            let (code, err) =
                run_extract(&s.base, &input, &out, "1", &["--shard", &shard, "--concurrency", conc]).await;
            assert_eq!(code, Some(0), "{err}");
            let want = samples.iter().filter(|(id, _)| shard_of(id, 4) == k).count();
            assert!(err.contains(&format!("0 samples already done, {want} to go (shard {k}/4)")), "{err}");
        }
        let split: Vec<HashSet<String>> = manifests(&out).values().map(|m| ids_of(m).into_iter().collect()).collect();
        splits.push(split);
    }
    assert_eq!(splits[0], splits[1], "the same split twice");
    assert_eq!(splits[0].len(), 4);
    for (k, part) in splits[0].iter().enumerate() {
        let want: HashSet<String> =
            samples.iter().map(|(id, _)| id.clone()).filter(|id| shard_of(id, 4) == k as u64).collect();
        assert_eq!(part, &want, "shard {k} holds the ids whose xxh64 mod 4 is {k}");
        assert!(!part.is_empty(), "shard {k} is empty: the split is not spread");
    }
    // A second run of one shard finds its own manifest only.
    let out = dir.path().join("one");
    let (code, err) = run_extract(&s.base, &input, &out, "1", &["--shard", "2/4"]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains(&format!("{} samples already done, 0 to go", splits[0][2].len())), "{err}");

    // --verify checks every manifest, or --shard's alone.
    let (code, err) = run_bulk(&["--verify", "--out", &p(&out)]).await;
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(err.matches("all intact").count(), 4, "{err}");
    let m = &manifests(&out)["manifest-3-of-4.jsonl"];
    let victim = m[0]["file"].as_str().unwrap();
    std::fs::remove_file(out.join(victim)).unwrap();
    let (code, err) = run_bulk(&["--verify", "--out", &p(&out), "--shard", "1/4"]).await;
    assert_eq!((code, err.matches("all intact").count()), (Some(0), 1), "{err}");
    let (code, err) = run_bulk(&["--verify", "--out", &p(&out)]).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(victim) && err.contains("missing"), "{err}");
    assert_eq!(manifests(&out)["manifest-3-of-4.jsonl"].len(), m.len() - 1);

    for bad in ["4/4", "0/0", "5/2", "x/3", "3", "1/-2"] {
        let (code, err) = run_extract(&s.base, &input, &dir.path().join("bad"), "1", &["--shard", bad]).await;
        assert_eq!(code, Some(2), "{bad}: {err}");
        assert!(err.contains("--shard") && err.contains("I/N"), "{bad}: {err}");
    }
    assert!(!dir.path().join("bad").exists(), "nothing was started for a refused shard");
}
