//! `trellis bench plugin-reload`: how soon a changed plugin serves, against the target
//! "a plugin change is serving within 1 s".
//!
//! A server is started in this process on an embedded store in a temporary directory,
//! with a plugins directory of its own. The bundled Rust validating plugin (pod-policy)
//! is installed twice: as a Plugin object and as a `NAME.yaml` + `NAME.wasm` pair in
//! the plugins directory. Each judges only Pods carrying its own `route` label, so the
//! two never see each other's probes.
//!
//! Every round flips the plugin's configuration between an allow-list that holds the
//! probe's image and one that does not, so the old and the new version give different
//! answers. The clock starts when the change is acknowledged (the API write's response;
//! the rename of the rewritten YAML file into place) and stops when a dry-run Pod create,
//! sent every [`PROBE_EVERY`], comes back with the new version's answer. The figure
//! therefore includes up to one probe interval and one request.
//!
//! Three routes are measured, one after the other:
//! - `object`: a new configuration in the Plugin object; the module is unchanged, so it
//!   comes from the compiled cache.
//! - `object_new_module`: a new configuration and a module never seen before (the
//!   plugin with a custom section appended, naming the round), so every round compiles.
//! - `directory`: a new configuration in the plugins directory's YAML file, found by
//!   the server's poll of the directory.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Args;
use clap::builder::RangedU64ValueParser;
use hyper::{Method, StatusCode};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::time::{Instant, MissedTickBehavior};

use super::Percentiles;
use super::admission::plugin_or_bundled;
use super::cluster::LocalCluster;
use crate::rest::{Target, exchange};

/// How often a probe is sent while waiting for the new version: the resolution of the
/// figures.
const PROBE_EVERY: Duration = Duration::from_millis(5);

/// Longest wait for a change to serve before the run fails: far above the target, only
/// there so a change that never takes effect ends the run with an error.
const GIVE_UP: Duration = Duration::from_secs(30);

/// How often the server looks at its plugins directory (its `DIR_POLL`).
const DIR_POLL: Duration = Duration::from_millis(250);

/// The target of the plugin issue, reported beside the figures.
const TARGET: Duration = Duration::from_secs(1);

/// The probe's image: in the allowing configuration's registries, not the denying one's.
const IMAGE: &str = "registry.k8s.io/pause:3.10";

/// The Plugin object's name, and the plugins directory's file stem.
const OBJECT_PLUGIN: &str = "reload-object";
const FILE_PLUGIN: &str = "reload-file";

#[derive(Debug, Args)]
pub struct PluginReloadArgs {
    /// Changes measured per route.
    #[arg(long, default_value_t = 20, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    rounds: usize,

    /// Changes measured on the route that compiles a new module each time (seconds
    /// each for a large module on a small machine).
    #[arg(long, default_value_t = 5, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    module_rounds: usize,

    /// The validating plugin to reload; by default the pod-policy example built by
    /// `plugins/build.sh`. It must take `{"allowedRegistries": [...]}` as pod-policy does.
    #[arg(long, value_name = "FILE.wasm")]
    plugin: Option<PathBuf>,

    /// Print one JSON object instead of lines of text.
    #[arg(long)]
    json: bool,
}

/// Percentiles of one route's rounds, in milliseconds.
#[derive(Debug, Serialize)]
struct RouteReport {
    route: &'static str,
    rounds: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

impl RouteReport {
    fn of(route: &'static str, samples: &mut [Duration]) -> Self {
        let p = Percentiles::of(samples);
        Self {
            route,
            rounds: samples.len(),
            p50_ms: p.p50_ms,
            p99_ms: p.p99_ms,
            max_ms: p.max_ms,
        }
    }
}

#[derive(Debug, Serialize)]
struct Report {
    plugin: String,
    probe_every_ms: f64,
    target_ms: f64,
    /// Whether every round of every route served within the target.
    within_target: bool,
    routes: Vec<RouteReport>,
}

pub async fn run(args: PluginReloadArgs) -> anyhow::Result<()> {
    let plugin = plugin_or_bundled(args.plugin.as_deref())?;
    let module =
        std::fs::read(&plugin).with_context(|| format!("read the plugin {}", plugin.display()))?;

    let cluster = LocalCluster::start_with(|config| {
        let plugin_dir = config.data_dir.join("plugins");
        std::fs::create_dir_all(&plugin_dir).context("create the plugins directory")?;
        config.plugin_dir = Some(plugin_dir);
        Ok(())
    })
    .await?;
    let measured = measure(&cluster, &module, args.rounds, args.module_rounds).await;
    let stopped = cluster.stop().await;
    let routes = measured?;
    stopped?;

    let target_ms = super::ms(TARGET);
    let report = Report {
        plugin: plugin.display().to_string(),
        probe_every_ms: super::ms(PROBE_EVERY),
        target_ms,
        within_target: routes.iter().all(|r| r.max_ms < target_ms),
        routes,
    };
    super::print_report(args.json, &report, || {
        let mut text = format!(
            "plugin reload (probe every {} ms), change acknowledged to the first create \
             judged by the new version:",
            report.probe_every_ms
        );
        for r in &report.routes {
            text.push_str(&format!(
                "\n  {:<18} {:>3} rounds  p50 {:>9.3} ms  p99 {:>9.3} ms  max {:>9.3} ms",
                r.route, r.rounds, r.p50_ms, r.p99_ms, r.max_ms
            ));
        }
        text.push_str(&format!(
            "\n  every change served within {} ms: {}",
            report.target_ms,
            if report.within_target { "yes" } else { "no" }
        ));
        text
    })
}

async fn measure(
    cluster: &LocalCluster,
    module: &[u8],
    rounds: usize,
    module_rounds: usize,
) -> anyhow::Result<Vec<RouteReport>> {
    let target = Target::from_kubeconfig(&cluster.server.kubeconfig, false)?;
    let modules = cluster.dir.path().join("modules");
    std::fs::create_dir_all(&modules).context("create the modules directory")?;
    let base_module = modules.join("plugin.wasm");
    std::fs::write(&base_module, module).context("write the plugin module")?;

    // Installed denying, so the probe tells a serving plugin from none.
    let mut generation = put_plugin(&target, &base_module, false, None).await?;
    wait_loaded(&target, generation).await?;
    until_judged(&target, "object", false).await?;

    let mut object = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let allows = round % 2 == 0;
        generation = put_plugin(&target, &base_module, allows, Some(generation)).await?;
        let started = Instant::now();
        object.push(until_judged(&target, "object", allows).await? - started);
        // The next change must not land while this one is still being reported.
        wait_loaded(&target, generation).await?;
    }

    let mut new_module = Vec::with_capacity(module_rounds);
    for round in 0..module_rounds {
        let allows = round % 2 == 0;
        let path = modules.join(format!("plugin-{round}.wasm"));
        std::fs::write(&path, tagged(module, round)).context("write a new module")?;
        generation = put_plugin(&target, &path, allows, Some(generation)).await?;
        let started = Instant::now();
        new_module.push(until_judged(&target, "object", allows).await? - started);
        wait_loaded(&target, generation).await?;
    }

    let plugin_dir = &cluster.dir.path().join("plugins");
    std::fs::write(plugin_dir.join(format!("{FILE_PLUGIN}.wasm")), module)
        .context("write the module into the plugins directory")?;
    write_spec_file(plugin_dir, false)?;
    until_judged(&target, "directory", false).await?;
    let mut directory = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let allows = round % 2 == 0;
        // Each round would otherwise start just after the poll that found the last
        // change, and always wait a whole poll; spread the starts over the poll period.
        let phase = (round as u64 * 97) % DIR_POLL.as_millis() as u64;
        tokio::time::sleep(Duration::from_millis(phase)).await;
        write_spec_file(plugin_dir, allows)?;
        let started = Instant::now();
        directory.push(until_judged(&target, "directory", allows).await? - started);
    }

    Ok(vec![
        RouteReport::of("object", &mut object),
        RouteReport::of("object_new_module", &mut new_module),
        RouteReport::of("directory", &mut directory),
    ])
}

/// pod-policy's configuration: an allow-list with or without the probe's registry.
fn configuration(allows: bool) -> Value {
    let registry = if allows {
        "registry.k8s.io/"
    } else {
        "example.com/"
    };
    json!({ "allowedRegistries": [registry] })
}

/// The spec both declarations share, judging only Pods labelled `route: {route}`.
fn spec(route: &str, module_url: Option<String>, allows: bool) -> Value {
    let mut spec = json!({
        "kind": "validating",
        "configuration": configuration(allows),
        "rules": [{"operations": ["CREATE"], "apiGroups": [""],
                   "apiVersions": ["v1"], "resources": ["pods"]}],
        "objectSelector": {"matchLabels": {"route": route}},
        "failurePolicy": "Fail",
        // Compiling a new module takes every core for a moment; a probe that waits for
        // a CPU meanwhile must not fail the run on the default 100 ms deadline.
        "timeoutMs": 2000,
    });
    if let Some(url) = module_url {
        spec["module"] = json!({ "url": url });
    }
    spec
}

/// Creates (without `previous`) or replaces the Plugin object; returns its generation
/// once the write is acknowledged.
async fn put_plugin(
    target: &Target,
    module: &Path,
    allows: bool,
    previous: Option<i64>,
) -> anyhow::Result<i64> {
    let mut obj = json!({
        "apiVersion": "trellis.dev/v1",
        "kind": "Plugin",
        "metadata": {"name": OBJECT_PLUGIN},
        "spec": spec("object", Some(format!("file://{}", module.display())), allows),
    });
    let (method, path, expected) = match previous {
        None => (
            Method::POST,
            "/apis/trellis.dev/v1/plugins".to_owned(),
            StatusCode::CREATED,
        ),
        Some(_) => (
            Method::PUT,
            format!("/apis/trellis.dev/v1/plugins/{OBJECT_PLUGIN}"),
            StatusCode::OK,
        ),
    };
    let (status, body) = loop {
        if previous.is_some() {
            // The current resourceVersion, so the replace is a plain update.
            let current = get_plugin(target).await?;
            obj["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"].clone();
        }
        let answer = exchange(target, method.clone(), &path, obj.to_string().into_bytes()).await?;
        // The server writes the status between our read and our write now and then.
        if answer.0 != StatusCode::CONFLICT {
            break answer;
        }
    };
    if status != expected {
        bail!(
            "write the Plugin {OBJECT_PLUGIN}: {status}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    let written: Value = serde_json::from_slice(&body).context("read the written Plugin")?;
    let generation = written["metadata"]["generation"]
        .as_i64()
        .context("the written Plugin has no generation")?;
    if previous.is_some_and(|p| generation <= p) {
        bail!("the Plugin's generation did not move past {previous:?} on a spec change");
    }
    Ok(generation)
}

async fn get_plugin(target: &Target) -> anyhow::Result<Value> {
    let (status, body) = exchange(
        target,
        Method::GET,
        &format!("/apis/trellis.dev/v1/plugins/{OBJECT_PLUGIN}"),
        Vec::new(),
    )
    .await?;
    if status != StatusCode::OK {
        bail!("read the Plugin {OBJECT_PLUGIN}: {status}");
    }
    serde_json::from_slice(&body).context("read the Plugin as JSON")
}

/// Waits until the Plugin reports `Loaded` for `generation`; fails on a failed load.
async fn wait_loaded(target: &Target, generation: i64) -> anyhow::Result<()> {
    let deadline = Instant::now() + GIVE_UP;
    loop {
        let obj = get_plugin(target).await?;
        let cond = &obj["status"]["conditions"][0];
        if cond["observedGeneration"].as_i64() == Some(generation) {
            match cond["status"].as_str() {
                Some("True") => return Ok(()),
                _ => bail!("load the Plugin {OBJECT_PLUGIN}: {}", cond["message"]),
            }
        }
        if Instant::now() > deadline {
            bail!("load the Plugin {OBJECT_PLUGIN}: no status for generation {generation}");
        }
        tokio::time::sleep(PROBE_EVERY).await;
    }
}

/// Writes `FILE_PLUGIN.yaml` whole under another name and renames it into place, so
/// the server's poll never reads half a file.
fn write_spec_file(dir: &Path, allows: bool) -> anyhow::Result<()> {
    let yaml = serde_saphyr::to_string(&spec("directory", None, allows))
        .context("write the plugin spec as YAML")?;
    let path = dir.join(format!("{FILE_PLUGIN}.yaml"));
    let tmp = dir.join(format!("{FILE_PLUGIN}.yaml.tmp"));
    std::fs::write(&tmp, yaml).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("write {}", path.display()))
}

/// The module with a custom section naming `round` appended: the same code under a new
/// digest, so loading it compiles.
fn tagged(module: &[u8], round: usize) -> Vec<u8> {
    let name = b"trellis-bench";
    let payload = format!("round {round}");
    let mut out = module.to_vec();
    out.push(0); // custom section
    leb128(&mut out, name.len() + 1 + payload.len());
    leb128(&mut out, name.len());
    out.extend_from_slice(name);
    out.extend_from_slice(payload.as_bytes());
    out
}

fn leb128(out: &mut Vec<u8>, mut value: usize) {
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// Sends a dry-run Pod create labelled `route` every [`PROBE_EVERY`] until the answer
/// is `allows`' (201 or 403); returns when that answer arrived.
async fn until_judged(target: &Target, route: &str, allows: bool) -> anyhow::Result<Instant> {
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "reload-probe", "labels": {"route": route}},
        "spec": {"containers": [{"name": "main", "image": IMAGE}]},
    })
    .to_string()
    .into_bytes();
    let started = Instant::now();
    let mut every = tokio::time::interval(PROBE_EVERY);
    every.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let (status, body) = exchange(
            target,
            Method::POST,
            "/api/v1/namespaces/default/pods?dryRun=All",
            pod.clone(),
        )
        .await?;
        let answered = Instant::now();
        match status {
            StatusCode::CREATED if allows => return Ok(answered),
            StatusCode::FORBIDDEN if !allows => return Ok(answered),
            StatusCode::CREATED | StatusCode::FORBIDDEN => {}
            other => bail!(
                "probe the {route} plugin: {other}: {}",
                String::from_utf8_lossy(&body)
            ),
        }
        if answered - started > GIVE_UP {
            bail!("the {route} plugin's change did not serve within {GIVE_UP:?}");
        }
    }
}

#[cfg(test)]
// A panic is how a test reports failure.
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn leb128_splits_seven_bits_at_a_time() {
        let mut out = Vec::new();
        leb128(&mut out, 5);
        leb128(&mut out, 300);
        assert_eq!(out, [5, 0xac, 0x02]);
    }

    #[test]
    fn a_tagged_module_ends_with_a_named_custom_section() {
        let out = tagged(b"\0asm", 7);
        let tail = &out[4..];
        assert_eq!(tail[0], 0);
        assert_eq!(usize::from(tail[1]), tail.len() - 2);
        assert_eq!(usize::from(tail[2]), "trellis-bench".len());
        assert!(tail.ends_with(b"trellis-benchround 7"));
    }

    #[test]
    fn the_two_configurations_differ_on_the_probe_image() {
        let allow = configuration(true);
        let deny = configuration(false);
        let listed = |c: &Value| {
            c["allowedRegistries"][0]
                .as_str()
                .is_some_and(|r| IMAGE.starts_with(r))
        };
        assert!(listed(&allow) && !listed(&deny));
    }
}
