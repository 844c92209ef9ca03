//! The plugin host on its own: loads, calls, limits and failures, with the
//! `misbehave` and `stamp` fixture components (plugins/fixtures).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use serde_json::json;
use trellis_plugin_host::{
    AdmissionRequest, Compilers, GroupVersionKind, GroupVersionResource, HostConfig,
    LoadErrorReason, Operation, PluginErrorKind, PluginHost, PluginKind, PluginSpec, Tier,
    UserInfo,
};
use trellis_tests::plugin_wasm;

fn wasm(name: &str) -> Result<Arc<Vec<u8>>> {
    Ok(Arc::new(std::fs::read(plugin_wasm(name)?)?))
}

fn host() -> Result<Arc<PluginHost>> {
    host_with(Compilers::Tiered)
}

fn host_with(compilers: Compilers) -> Result<Arc<PluginHost>> {
    PluginHost::new(HostConfig {
        max_instances: 200,
        compilers,
        ..HostConfig::default()
    })
}

/// A spec for the fixture. The deadline is 1 s rather than the default 100 ms: it counts
/// waiting for a CPU, and a debug build on a busy 2-core machine waits.
fn spec(kind: PluginKind, configuration: serde_json::Value) -> PluginSpec {
    let mut spec = PluginSpec::new("misbehave", kind);
    spec.configuration = configuration.to_string();
    spec.timeout = Duration::from_secs(1);
    spec
}

/// A ConfigMap create whose `misbehave` annotation picks the plugin's behaviour.
fn request(mode: &str) -> AdmissionRequest {
    let object = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "cm", "namespace": "default", "annotations": {"misbehave": mode}},
    });
    AdmissionRequest {
        uid: "u-1".into(),
        kind: GroupVersionKind {
            group: String::new(),
            version: "v1".into(),
            kind: "ConfigMap".into(),
        },
        resource: GroupVersionResource {
            group: String::new(),
            version: "v1".into(),
            resource: "configmaps".into(),
        },
        sub_resource: None,
        name: "cm".into(),
        namespace: Some("default".into()),
        operation: Operation::Create,
        user_info: UserInfo {
            username: "alice".into(),
            uid: String::new(),
            groups: vec!["system:authenticated".into()],
            extra: Vec::new(),
        },
        object: Some(object.to_string()),
        old_object: None,
        dry_run: false,
        configuration: "{}".into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_call_is_named_and_the_plugin_keeps_serving() -> Result<()> {
    bad_calls(Compilers::Optimized, Tier::Optimized).await
}

/// The same limits hold in Winch's code, which serves a new module until Cranelift's
/// is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_call_is_named_and_the_plugin_keeps_serving_on_baseline_code() -> Result<()> {
    bad_calls(Compilers::Baseline, Tier::Baseline).await
}

/// The error of a call that had to fail.
fn failed<T: std::fmt::Debug>(
    answer: std::result::Result<T, trellis_plugin_host::PluginError>,
) -> Result<trellis_plugin_host::PluginError> {
    match answer {
        Ok(answer) => anyhow::bail!("the call should have failed; it answered {answer:?}"),
        Err(e) => Ok(e),
    }
}

async fn bad_calls(compilers: Compilers, tier: Tier) -> Result<()> {
    let host = host_with(compilers)?;
    let plugin = host
        .load(
            spec(PluginKind::Validating, json!({})),
            wasm("misbehave")?,
            None,
        )
        .await?;
    ensure!(plugin.tier() == tier, "{:?}", plugin.tier());
    ensure!(plugin.digest().starts_with("sha256:") && plugin.digest().len() == 71);

    let denied = plugin.admit(&host, &request("deny")).await?;
    ensure!(!denied.allowed, "deny mode must deny");
    let status = denied.status.clone().unwrap_or_else(|| unreachable!());
    ensure!(status.code == 403 && status.message == "misbehave denies cm");
    ensure!(denied.warnings == vec!["misbehave looked at this".to_owned()]);

    // A loop is stopped at the deadline (10 ms ticks), not much later.
    let started = Instant::now();
    let err = failed(plugin.admit(&host, &request("loop")).await)?;
    let took = started.elapsed();
    ensure!(
        err.kind == PluginErrorKind::Timeout(Duration::from_secs(1)),
        "{err}"
    );
    ensure!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(5),
        "took {took:?}"
    );
    let message = err.to_string();
    ensure!(
        message.starts_with("plugin misbehave (validating, v sha256:")
            && message.ends_with(") timed out after 1000ms"),
        "{message}"
    );

    // Unbounded allocation stops at the 64 MiB cap.
    let err = failed(plugin.admit(&host, &request("alloc")).await)?;
    ensure!(err.kind == PluginErrorKind::OutOfMemory(64 << 20), "{err}");
    ensure!(
        err.to_string()
            .ends_with("exceeded its 64 MiB memory limit")
    );

    let err = failed(plugin.admit(&host, &request("trap")).await)?;
    ensure!(matches!(err.kind, PluginErrorKind::Trapped(_)), "{err}");
    ensure!(err.to_string().contains("trapped: "), "{err}");

    // A validating plugin may not patch.
    let err = failed(plugin.admit(&host, &request("label")).await)?;
    ensure!(matches!(err.kind, PluginErrorKind::BadAnswer(_)), "{err}");

    // After all that, the plugin still answers.
    let ok = plugin.admit(&host, &request("allow")).await?;
    ensure!(ok.allowed && ok.patch.is_none());
    let m = &plugin.metrics;
    use std::sync::atomic::Ordering::Relaxed;
    ensure!(
        m.calls.load(Relaxed) == 6,
        "calls {}",
        m.calls.load(Relaxed)
    );
    ensure!(m.denials.load(Relaxed) == 1 && m.timeouts.load(Relaxed) == 1);
    ensure!(
        m.errors.load(Relaxed) == 4,
        "errors {}",
        m.errors.load(Relaxed)
    );
    ensure!(
        m.memory_peak.load(Relaxed) >= 60 << 20,
        "peak {}",
        m.memory_peak.load(Relaxed)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mutating_plugin_returns_its_patch() -> Result<()> {
    let host = host()?;
    let plugin = host
        .load(
            spec(PluginKind::Mutating, json!({})),
            wasm("misbehave")?,
            None,
        )
        .await?;
    let answer = plugin.admit(&host, &request("label")).await?;
    ensure!(answer.allowed);
    let patch: serde_json::Value = serde_json::from_str(answer.patch.as_deref().unwrap_or(""))?;
    ensure!(patch[0]["path"] == "/metadata/labels", "{patch}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loads_refuse_the_wrong_world_bad_bytes_and_rejected_configuration() -> Result<()> {
    let host = host()?;
    // An initializer component has no admission-handler export, and the reverse.
    let err = host
        .load(
            spec(PluginKind::Validating, json!({})),
            wasm("stamp")?,
            None,
        )
        .await
        .unwrap_err();
    ensure!(err.reason == LoadErrorReason::WrongWorld, "{err:?}");
    ensure!(err.message.contains("admission-handler"), "{}", err.message);
    let err = host
        .load(
            spec(PluginKind::Initializer, json!({})),
            wasm("misbehave")?,
            None,
        )
        .await
        .unwrap_err();
    ensure!(err.reason == LoadErrorReason::WrongWorld, "{err:?}");
    ensure!(
        err.message.contains("initializer-handler"),
        "{}",
        err.message
    );

    // A component built against a package version this host does not link is
    // refused at load, naming the import it lacks (docs/wit.md, "Versioning").
    let future = wat::parse_str(
        r#"(component
            (import "trellis:plugin/log@0.9.0"
                (instance (export "log" (func (param "message" string))))))"#,
    )?;
    let err = host
        .load(
            spec(PluginKind::Validating, json!({})),
            Arc::new(future),
            None,
        )
        .await
        .unwrap_err();
    ensure!(err.reason == LoadErrorReason::WrongWorld, "{err:?}");
    ensure!(
        err.message.contains("trellis:plugin/log@0.9.0"),
        "{}",
        err.message
    );

    // A core module is not a component; garbage is neither.
    let core = wat::parse_str("(module)")?;
    for bytes in [core, b"not wasm at all".to_vec()] {
        let err = host
            .load(
                spec(PluginKind::Validating, json!({})),
                Arc::new(bytes),
                None,
            )
            .await
            .unwrap_err();
        ensure!(err.reason == LoadErrorReason::CompileFailed, "{err:?}");
    }

    let err = host
        .load(
            spec(PluginKind::Validating, json!({"reject": true})),
            wasm("misbehave")?,
            None,
        )
        .await
        .unwrap_err();
    ensure!(
        err.reason == LoadErrorReason::ConfigurationRejected,
        "{err:?}"
    );
    ensure!(
        err.message
            .contains("configuration rejected: reject is true"),
        "{}",
        err.message
    );
    Ok(())
}

/// A hundred calls at once into a plugin that spins `sleep_ms` per call, each with
/// `timeout`: (allowed, timed out). Nothing else may happen.
async fn hundred_calls(sleep_ms: u64, timeout: Duration) -> Result<(usize, usize)> {
    let host = host()?;
    let config = json!({"mode": "sleep", "sleepMs": sleep_ms});
    let mut spec = spec(PluginKind::Validating, config.clone());
    spec.timeout = timeout;
    let plugin = host.load(spec, wasm("misbehave")?, None).await?;
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..100 {
        let (host, plugin) = (host.clone(), plugin.clone());
        let config = config.to_string();
        calls.spawn(async move {
            let mut req = request("sleep");
            req.configuration = config;
            plugin.admit(&host, &req).await
        });
    }
    let (mut allowed, mut timed_out) = (0, 0);
    while let Some(joined) = calls.join_next().await {
        match joined? {
            Ok(answer) if answer.allowed => allowed += 1,
            Err(e) if e.kind == PluginErrorKind::Timeout(timeout) => timed_out += 1,
            other => anyhow::bail!("unexpected outcome {other:?}"),
        }
    }
    // Whatever happened, the plugin answers the next call.
    let mut req = request("allow");
    req.configuration = "{}".into();
    ensure!(plugin.admit(&host, &req).await?.allowed);
    Ok((allowed, timed_out))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_plugin_serves_a_hundred_concurrent_calls() -> Result<()> {
    // 100 × 5 ms of guest time fits easily in a 5 s deadline: every call is served,
    // on instances made as needed.
    let (allowed, timed_out) = hundred_calls(5, Duration::from_secs(5)).await?;
    ensure!(
        allowed == 100 && timed_out == 0,
        "{allowed} allowed, {timed_out} timed out"
    );
    // Calls that need 150 ms against a 100 ms deadline all time out, named, and the
    // plugin serves the next call.
    let (allowed, timed_out) = hundred_calls(150, Duration::from_millis(100)).await?;
    ensure!(
        allowed == 0 && timed_out == 100,
        "{allowed} allowed, {timed_out} timed out"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compiled_components_are_cached_by_digest() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let config = HostConfig {
        cache_dir: Some(dir.path().to_owned()),
        max_instances: 20,
        ..HostConfig::default()
    };
    let first = PluginHost::new(config.clone())?;
    let plugin = first
        .load(
            spec(PluginKind::Validating, json!({})),
            wasm("misbehave")?,
            None,
        )
        .await?;
    // A module never seen serves Winch's code at once; Cranelift's follows in the
    // background, and that is what the cache keeps.
    ensure!(plugin.tier() == Tier::Baseline, "{:?}", plugin.tier());
    ensure!(plugin.admit(&first, &request("allow")).await?.allowed);
    tokio::time::timeout(Duration::from_secs(120), plugin.optimized())
        .await
        .map_err(|_| anyhow::anyhow!("no optimized code after 120 s"))?;
    ensure!(!plugin.admit(&first, &request("deny")).await?.allowed);
    ensure!(plugin.admit(&first, &request("loop")).await.is_err());
    let hex = plugin.digest().trim_start_matches("sha256:").to_owned();
    let cached: Vec<_> = std::fs::read_dir(dir.path())?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    ensure!(
        cached.len() == 1 && cached[0].starts_with(&hex) && cached[0].ends_with(".cwasm"),
        "{cached:?}"
    );
    // A second host (a restart) loads from the cache, and a corrupt entry is
    // recompiled rather than trusted blindly.
    let second = PluginHost::new(config.clone())?;
    let again = second
        .load(
            spec(PluginKind::Validating, json!({})),
            wasm("misbehave")?,
            None,
        )
        .await?;
    ensure!(again.tier() == Tier::Optimized, "{:?}", again.tier());
    ensure!(again.admit(&second, &request("allow")).await?.allowed);
    // Replaced, not truncated in place: the running hosts map the file (as the server
    // writes it: whole, under a temporary name, then renamed).
    let tmp = dir.path().join("garbage.tmp");
    std::fs::write(&tmp, b"garbage")?;
    std::fs::rename(&tmp, dir.path().join(&cached[0]))?;
    let third = PluginHost::new(config)?;
    let healed = third
        .load(
            spec(PluginKind::Validating, json!({})),
            wasm("misbehave")?,
            None,
        )
        .await?;
    ensure!(healed.admit(&third, &request("allow")).await?.allowed);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_of_one_module_share_its_code() -> Result<()> {
    let host = host_with(Compilers::Baseline)?;
    let load = |name: &'static str, kind: PluginKind, module: &'static str| {
        let host = host.clone();
        async move {
            let mut spec = spec(kind, json!({}));
            spec.name = name.into();
            anyhow::Ok(host.load(spec, wasm(module)?, None).await?)
        }
    };
    let first = load("first", PluginKind::Validating, "misbehave").await?;
    let second = load("second", PluginKind::Mutating, "misbehave").await?;
    ensure!(
        host.modules_loaded() == 1,
        "{} modules",
        host.modules_loaded()
    );
    ensure!(!first.admit(&host, &request("deny")).await?.allowed);
    ensure!(second.admit(&host, &request("allow")).await?.allowed);
    let other = load("other", PluginKind::Initializer, "stamp").await?;
    ensure!(
        host.modules_loaded() == 2,
        "{} modules",
        host.modules_loaded()
    );
    drop((first, other));
    ensure!(
        host.modules_loaded() == 1,
        "{} modules",
        host.modules_loaded()
    );
    drop(second);
    ensure!(
        host.modules_loaded() == 0,
        "{} modules",
        host.modules_loaded()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_plugin_keeps_counting_where_the_old_version_left_off() -> Result<()> {
    use std::sync::atomic::Ordering::Relaxed;
    let host = host()?;
    let old = host
        .load(
            spec(PluginKind::Validating, json!({})),
            wasm("misbehave")?,
            None,
        )
        .await?;
    ensure!(!old.admit(&host, &request("deny")).await?.allowed);
    let new = host
        .reload(
            &old,
            spec(PluginKind::Validating, json!({"mode": "log"})),
            wasm("misbehave")?,
            None,
        )
        .await?;
    // A call still on the old version after the swap counts with the new one's.
    ensure!(old.admit(&host, &request("allow")).await?.allowed);
    ensure!(!new.admit(&host, &request("deny")).await?.allowed);
    let m = &new.metrics;
    ensure!(
        m.calls.load(Relaxed) == 3,
        "calls {}",
        m.calls.load(Relaxed)
    );
    ensure!(
        m.denials.load(Relaxed) == 2,
        "denials {}",
        m.denials.load(Relaxed)
    );

    // Another kind is another series: it starts from zero.
    let mutating = host
        .reload(
            &new,
            spec(PluginKind::Mutating, json!({})),
            wasm("misbehave")?,
            None,
        )
        .await?;
    ensure!(mutating.metrics.calls.load(Relaxed) == 0);
    Ok(())
}

/// A cluster reader with two ConfigMaps, for the fixture's `read` mode.
#[derive(Debug)]
struct TwoConfigMaps;

#[async_trait::async_trait]
impl trellis_plugin_host::ClusterReader for TwoConfigMaps {
    async fn get(
        &self,
        _resource: &GroupVersionResource,
        _namespace: Option<&str>,
        name: &str,
    ) -> std::result::Result<Option<String>, String> {
        Ok((name == "cm-b").then(|| json!({"metadata": {"name": "cm-b"}}).to_string()))
    }

    async fn list(
        &self,
        _resource: &GroupVersionResource,
        _namespace: Option<&str>,
        _label_selector: &str,
    ) -> std::result::Result<Vec<String>, String> {
        Ok(vec![
            json!({"metadata": {"name": "cm-a2"}}).to_string(),
            json!({"metadata": {"name": "cm-a1"}}).to_string(),
        ])
    }
}

/// Host imports answer the same to both tiers' code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_tiers_read_the_cluster_through_the_host() -> Result<()> {
    for compilers in [Compilers::Baseline, Compilers::Optimized] {
        let host = host_with(compilers)?;
        let plugin = host
            .load(
                spec(
                    PluginKind::Validating,
                    json!({"selector": "team=a", "get": "cm-b"}),
                ),
                wasm("misbehave")?,
                Some(Arc::new(TwoConfigMaps)),
            )
            .await?;
        // The server hands each call the plugin's configuration.
        let mut read = request("read");
        read.configuration = json!({"selector": "team=a", "get": "cm-b"}).to_string();
        let answer = plugin.admit(&host, &read).await?;
        let message = answer.status.map(|s| s.message).unwrap_or_default();
        ensure!(
            !answer.allowed && message == "misbehave read [cm-a1,cm-a2]; cm-b exists: true",
            "{compilers:?}: allowed {}, {message:?}",
            answer.allowed
        );
    }
    Ok(())
}

/// A host whose pooling allocator has `slots` instance slots, optimized code only (the
/// baseline tier's instances are not pooled).
fn host_with_slots(slots: u32) -> Result<Arc<PluginHost>> {
    PluginHost::new(HostConfig {
        max_instances: slots,
        compilers: Compilers::Optimized,
        ..HostConfig::default()
    })
}

/// A `sleep` request: the fixture busy-waits `sleep_ms`, yielding at each epoch tick,
/// so concurrent calls each hold an instance for that long.
fn sleep_request(sleep_ms: u64) -> AdmissionRequest {
    let mut req = request("sleep");
    req.configuration = json!({"sleepMs": sleep_ms}).to_string();
    req
}

/// Loads the fixture as validating plugin `name` with deadline `timeout`.
async fn load_named(
    host: &Arc<PluginHost>,
    name: &str,
    timeout: Duration,
) -> Result<Arc<trellis_plugin_host::Plugin>> {
    let mut spec = spec(PluginKind::Validating, json!({}));
    spec.name = name.into();
    spec.timeout = timeout;
    Ok(host.load(spec, wasm("misbehave")?, None).await?)
}

/// Regression: the engine's instance slots are shared by all plugins, and each plugin
/// kept up to 32 idle instances; once the slots were taken, a call needing a new
/// instance failed at once as "trapped: maximum concurrent limit … reached" (a 500
/// under `failurePolicy: Fail`). Now idle instances are capped at a fair share, a call
/// that finds the pool full takes other plugins' idle instances or waits for a slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_share_a_small_instance_pool_without_failing_calls() -> Result<()> {
    let host = host_with_slots(4)?;
    let mut plugins = Vec::new();
    for i in 0..3 {
        plugins.push(load_named(&host, &format!("busy-{i}"), Duration::from_secs(10)).await?);
    }
    // Two rounds: the second starts with the idle instances the first left behind.
    for round in 0..2 {
        let mut calls = tokio::task::JoinSet::new();
        for plugin in &plugins {
            for _ in 0..8 {
                let (host, plugin) = (host.clone(), plugin.clone());
                calls.spawn(async move { plugin.admit(&host, &sleep_request(20)).await });
            }
        }
        let mut failures = Vec::new();
        while let Some(joined) = calls.join_next().await {
            match joined? {
                Ok(answer) if answer.allowed => {}
                Ok(answer) => failures.push(format!("denied: {answer:?}")),
                Err(e) => failures.push(e.to_string()),
            }
        }
        ensure!(
            failures.is_empty(),
            "round {round}: {} of 24 calls failed: {failures:#?}",
            failures.len()
        );
    }
    // The pool was full (the test tested something): calls waited for slots.
    let waits: u64 = plugins
        .iter()
        .map(|p| {
            p.metrics
                .slot_waits
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .sum();
    ensure!(waits > 0, "no call waited for a slot");
    Ok(())
}

/// A call that finds every slot in use waits for one, and fails at its own deadline as
/// a timeout naming the plugin, not as a trap; once a slot is free it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_waits_for_a_free_slot_until_its_deadline() -> Result<()> {
    let host = host_with_slots(1)?;
    let hog = load_named(&host, "hog", Duration::from_secs(10)).await?;
    let patient = load_named(&host, "patient", Duration::from_millis(300)).await?;
    let waiter = load_named(&host, "waiter", Duration::from_secs(10)).await?;

    // The hog holds the only slot for 1.5 s: the patient plugin's 300 ms run out.
    let holding = {
        let (host, hog) = (host.clone(), hog.clone());
        tokio::spawn(async move { hog.admit(&host, &sleep_request(1_500)).await })
    };
    // Once the hog's call holds the slot (the plugin counts it), not after a guess.
    while hog
        .metrics
        .in_flight
        .load(std::sync::atomic::Ordering::Relaxed)
        == 0
    {
        ensure!(!holding.is_finished(), "the hog's call ended early");
        tokio::task::yield_now().await;
    }
    let started = Instant::now();
    let err = failed(patient.admit(&host, &request("allow")).await)?;
    let took = started.elapsed();
    ensure!(
        err.kind == PluginErrorKind::Timeout(Duration::from_millis(300)),
        "{err}"
    );
    ensure!(
        err.to_string().starts_with("plugin patient (validating"),
        "{err}"
    );
    ensure!(took >= Duration::from_millis(300), "took {took:?}");
    let m = &patient.metrics;
    use std::sync::atomic::Ordering::Relaxed;
    ensure!(
        m.slot_waits.load(Relaxed) == 1 && m.timeouts.load(Relaxed) == 1,
        "{} waits, {} timeouts",
        m.slot_waits.load(Relaxed),
        m.timeouts.load(Relaxed)
    );
    // A deadline long enough sees the slot freed when the hog's call ends.
    let answer = waiter.admit(&host, &request("allow")).await?;
    ensure!(answer.allowed);
    ensure!(holding.await??.allowed);
    Ok(())
}
