//! A bounded fuzz run over everything that decodes client input before a handler
//! sees it: query strings, content types, bodies (JSON, YAML and Kubernetes'
//! protobuf envelope, seeded with the bodies kubectl sends in `testdata/protobuf`),
//! selectors, patches and the typed decode of every built-in kind. Inputs are random mutations of valid
//! requests; every one must yield a value or an `ApiError` with a 4xx code, never a
//! panic. `TRELLIS_FUZZ_ITERATIONS` runs it longer (default 20,000).

#![cfg(test)]

use axum::http::{HeaderMap, HeaderValue, header};
use rand::{Rng, SeedableRng};
use serde_json::Value;

use crate::endpoints::request::{self, Query};
use crate::fieldmanager::patch;
use crate::object;
use crate::registry::typed;

const SEEDS: &[&str] = &[
    r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p","labels":{"a":"b"}},"spec":{"containers":[{"name":"c","image":"nginx","ports":[{"containerPort":80}]}]}}"#,
    r#"{"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"d"},"spec":{"replicas":2,"selector":{"matchLabels":{"a":"b"}},"template":{"metadata":{"labels":{"a":"b"}},"spec":{"containers":[{"name":"c","image":"i"}]}},"strategy":{"rollingUpdate":{"maxSurge":"25%"}}}}"#,
    "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c\ndata:\n  k: v\n",
    r#"[{"op":"replace","path":"/spec/replicas","value":3}]"#,
    r#"{"metadata":{"labels":{"x":null}},"spec":{"containers":[{"name":"c","$patch":"delete"}]}}"#,
    r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"c","managedFields":[{"manager":"m","operation":"Apply","apiVersion":"v1","fieldsType":"FieldsV1","fieldsV1":{"f:data":{"f:k":{}},"f:spec":{"f:ports":{"k:{\"port\":1}":{".":{},"f:port":{}}},"f:finalizers":{"v:\"x\"":{}}}}}]},"data":{"k":"v"}}"#,
];

const QUERIES: &[&str] = &[
    "labelSelector=app%3Dweb%2Ctier+in+(a%2Cb)&limit=5&continue=eyJydiI6MX0&watch=true",
    "fieldSelector=spec.nodeName%3Dn1%2Cstatus.phase!%3DRunning&resourceVersion=10&resourceVersionMatch=Exact",
    "dryRun=All&fieldManager=kubectl&fieldValidation=Strict&timeoutSeconds=30&allowWatchBookmarks=1",
];

fn iterations() -> usize {
    std::env::var("TRELLIS_FUZZ_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000)
}

/// A random mutation: flips, inserts, deletes or splices bytes.
fn mutate(rng: &mut impl Rng, input: &[u8]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..rng.random_range(1..6) {
        let at = if out.is_empty() {
            0
        } else {
            rng.random_range(0..out.len())
        };
        match rng.random_range(0..5) {
            0 if !out.is_empty() => out[at] ^= 1 << rng.random_range(0..8),
            1 => out.insert(at, rng.random()),
            2 if !out.is_empty() => {
                out.remove(at);
            }
            3 => {
                let tokens: &[&[u8]] = &[
                    b"{", b"}", b"[", b"]", b"\"", b":", b",", b"null", b"-1e999", b"\\u0000",
                    b"%", b"&", b"=", b"\xff", b"\n  - ",
                ];
                let t = tokens[rng.random_range(0..tokens.len())];
                out.splice(at..at, t.iter().copied());
            }
            _ => out.truncate(at),
        }
    }
    out
}

fn client_error(code: u16) -> bool {
    (400..500).contains(&code)
}

#[test]
fn request_decoding_never_panics_and_refuses_with_4xx() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x7e11);
    let resources = trellis_api::registry::builtins();
    for _ in 0..iterations() {
        let seed = SEEDS[rng.random_range(0..SEEDS.len())].as_bytes();
        let pick = rng.random_range(0..resources.len());
        let body = mutate(&mut rng, seed);
        for yaml in [false, true] {
            match object::decode(&body, yaml) {
                Ok(mut obj) => {
                    let res = &resources[pick];
                    let _ = object::check_type(&mut obj, res);
                    let unknown = [
                        typed::UnknownFields::Ignore,
                        typed::UnknownFields::Warn,
                        typed::UnknownFields::Strict,
                    ][rng.random_range(0..3)];
                    if let Err(e) = typed::default_and_validate_with(res, &mut obj, None, unknown) {
                        assert!(
                            client_error(e.code),
                            "typed decode answered {}: {}",
                            e.code,
                            e.message
                        );
                    }
                }
                Err(e) => assert!(client_error(e.code), "{}", e.message),
            }
        }
        if let (Ok(mut doc), Ok(p)) = (
            serde_json::from_slice::<Value>(seed),
            serde_json::from_slice::<Value>(&body),
        ) {
            if rng.random() {
                patch::merge(&mut doc, &p);
            } else {
                let _ = patch::strategic_merge(&mut doc, &p);
            }
            if let Ok(ops) = serde_json::from_value::<json_patch::Patch>(p.clone()) {
                let _ = json_patch::patch(&mut doc, &ops);
            }
            if let (Value::Object(live), Value::Object(config)) =
                (serde_json::from_slice::<Value>(seed).unwrap_or_default(), p)
            {
                fuzz_field_management(&live, &config, rng.random());
            }
        }

        let pick = rng.random_range(0..QUERIES.len());
        let query = mutate(&mut rng, QUERIES[pick].as_bytes());
        let query = String::from_utf8_lossy(&query);
        if let Err(e) = Query::parse(Some(&query)) {
            assert!(client_error(e.code), "{}", e.message);
        }
        for (k, v) in request::form_pairs(&query) {
            let _ = (k.len(), v.len());
            let _ = trellis_api::selector::LabelSelector::parse(&v);
            let _ = trellis_api::selector::FieldSelector::parse(&v);
        }

        let mut headers = HeaderMap::new();
        if let Ok(ct) = HeaderValue::from_bytes(&mutate(
            &mut rng,
            b"application/merge-patch+json; charset=utf-8",
        )) {
            headers.insert(header::CONTENT_TYPE, ct);
        }
        let _ = request::body_format(&headers);
        let _ = request::wants_table(&headers);
    }
}

/// Protobuf bodies as kubectl sends them, mutated: the decoder answers an object or a
/// 4xx, never a panic, and never loops (each input is bounded by its length).
#[test]
fn protobuf_decoding_never_panics_and_refuses_with_4xx() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/testdata/protobuf");
    let mut seeds: Vec<Vec<u8>> = std::fs::read_dir(dir)
        .expect("the protobuf fixtures")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "pb"))
        .filter_map(|p| std::fs::read(p).ok())
        .collect();
    seeds.sort();
    assert!(seeds.len() >= 5, "protobuf fixtures missing from {dir}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x9b0f);
    for _ in 0..iterations() {
        let seed = &seeds[rng.random_range(0..seeds.len())];
        let body = mutate(&mut rng, seed);
        if let Err(e) = crate::endpoints::protobuf::decode(&body) {
            assert!(
                client_error(e.code),
                "protobuf decode answered {}: {}",
                e.code,
                e.message
            );
        }
    }
}

/// Applies `config` to `live` and records it as an update: errors must be 4xx.
fn fuzz_field_management(live: &object::Object, config: &object::Object, force: bool) {
    use crate::fieldmanager::managed_fields::{Schema, Scope, record_update};
    use crate::fieldmanager::structured_merge::Applied;
    let applied = Applied {
        manager: "fuzz",
        force,
        schema: Schema::Builtin,
        scope: Scope::NoStatus,
        api_version: "v1",
        subresource: "",
        now: "2026-01-01T00:00:00Z",
    };
    if let Err(e) = applied.apply_to(live, config) {
        assert!(
            client_error(e.code),
            "apply answered {}: {}",
            e.code,
            e.message
        );
    }
    let mut new = config.clone();
    let _ = record_update(
        Some(live),
        &mut new,
        Schema::Builtin,
        Scope::All,
        "fuzz",
        "v1",
        "",
        "t",
    );
}
