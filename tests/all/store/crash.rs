//! Crash safety of the embedded store: a child process writes from many concurrent
//! writers and is killed with SIGKILL at a random moment, again and again on the same
//! file. After each kill the file is reopened and every write the child acknowledged
//! must be there at the revision it was acknowledged at; revisions must be gapless; a
//! watch must resume across the crash.
//!
//! `TRELLIS_CRASH_ITERATIONS` sets the number of kills (default 200).

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use futures::StreamExt;
use rand::Rng;
use trellis_store::{Event, RedbConfig, RedbStore, Revision, Store};

const WRITERS: usize = 16;

struct Ack {
    key: String,
    revision: Revision,
    value: String,
}

fn parse_acks(stdout: &[u8]) -> Result<Vec<Ack>> {
    let text = std::str::from_utf8(stdout)?;
    let mut acks = Vec::new();
    for line in text.split_inclusive('\n').filter(|l| l.ends_with('\n')) {
        let mut parts = line.trim_end().splitn(3, ' ');
        let (Some(key), Some(rev), Some(value)) = (parts.next(), parts.next(), parts.next()) else {
            bail!("malformed line from the child: {line:?}");
        };
        acks.push(Ack {
            key: key.into(),
            revision: rev.parse()?,
            value: value.into(),
        });
    }
    Ok(acks)
}

/// Reads history from `from` up to the store's current revision, in order.
async fn history(store: &RedbStore, from: Revision) -> Result<Vec<Event>> {
    let current = store.current_revision().await?;
    let mut events = Vec::new();
    if current < from {
        return Ok(events);
    }
    let mut watch = store.watch("/", from).await?;
    while events.last().map(Event::revision) != Some(current) {
        let item = tokio::time::timeout(Duration::from_secs(10), watch.next())
            .await
            .context("history replay timed out")?
            .context("history replay ended early")?;
        events.extend(item?);
    }
    Ok(events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_survive_sigkill() -> Result<()> {
    let iterations: usize = match std::env::var("TRELLIS_CRASH_ITERATIONS") {
        Ok(n) => n.parse().context("TRELLIS_CRASH_ITERATIONS")?,
        Err(_) => 200,
    };
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("store.redb");
    let config = RedbConfig::new(&path);
    // An empty store is at revision 1; everything after it must be accounted for.
    let mut verified: Revision = 1;
    let mut acked_total = 0usize;
    let mut kills_mid_write = 0usize;
    let mut rng = rand::rng();

    for iteration in 0..iterations {
        let mut child = Command::new(env!("CARGO_BIN_EXE_crash_writer"))
            .args([
                "write",
                path.to_str().context("utf-8 path")?,
                &WRITERS.to_string(),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("start the writer child")?;
        tokio::time::sleep(Duration::from_millis(rng.random_range(5..80))).await;
        child.kill().context("kill the writer child")?;
        let output = child.wait_with_output()?;
        if output.status.signal() != Some(9) {
            bail!(
                "iteration {iteration}: the writer exited on its own ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let acks = parse_acks(&output.stdout)?;
        if !acks.is_empty() {
            kills_mid_write += 1;
        }
        acked_total += acks.len();

        let store = RedbStore::open(config.clone())
            .with_context(|| format!("iteration {iteration}: reopen after SIGKILL"))?;
        let current = store.current_revision().await?;
        let events = history(&store, verified + 1).await?;
        let revisions: Vec<Revision> = events.iter().map(Event::revision).collect();
        ensure!(
            revisions.iter().copied().eq(verified + 1..=current),
            "iteration {iteration}: revisions after {verified} are not gapless up to {current}"
        );
        let by_revision: BTreeMap<Revision, &Event> =
            events.iter().map(|e| (e.revision(), e)).collect();
        for ack in &acks {
            let event = by_revision.get(&ack.revision).with_context(|| {
                format!(
                    "iteration {iteration}: acknowledged revision {} of {} is lost",
                    ack.revision, ack.key
                )
            })?;
            ensure!(
                event.kv.key == ack.key && event.kv.value == ack.value.as_bytes(),
                "iteration {iteration}: revision {} holds {:?}, acknowledged {} = {}",
                ack.revision,
                event.kv,
                ack.key,
                ack.value
            );
            let latest = store
                .get(&ack.key)
                .await?
                .context("acknowledged key is gone")?;
            ensure!(
                latest.mod_revision >= ack.revision,
                "{} went back in time",
                ack.key
            );
        }

        // A watch started before a write after the crash sees it at the next revision.
        let mut watch = store.watch("/resume/", 0).await?;
        let after = store
            .create(&format!("/resume/{iteration}"), Bytes::from("x"))
            .await?;
        ensure!(
            after.mod_revision == current + 1,
            "the first write after reopen skipped revisions"
        );
        let seen = tokio::time::timeout(Duration::from_secs(10), watch.next())
            .await?
            .context("watch ended")??;
        ensure!(seen.len() == 1 && seen[0].kv == after);
        drop(watch);
        store.close().await?;
        drop(store);
        verified = after.mod_revision;
    }
    ensure!(
        kills_mid_write * 2 >= iterations,
        "only {kills_mid_write} of {iterations} kills landed while the child was writing"
    );
    eprintln!(
        "{iterations} kills, {kills_mid_write} mid-write, {acked_total} acknowledged writes verified"
    );
    Ok(())
}
