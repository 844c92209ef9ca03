//! Checks of the embedded backend beyond the shared conformance suite: reopening,
//! files that are not (or no longer) a store, a full disk, and the compactor.

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use futures::StreamExt;
use trellis_store::{Compactor, CompactorConfig, Error, ListRequest, RedbConfig, RedbStore, Store};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reopen_keeps_keys_revisions_and_history() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let config = RedbConfig::new(dir.path().join("nested/dir/store.redb"));
    let store = RedbStore::open(config.clone())?;
    let a = store.create("/k/a", Bytes::from("1")).await?;
    store
        .update("/k/a", Bytes::from("2"), Some(a.mod_revision))
        .await?;
    store.create("/k/b", Bytes::from("b")).await?;
    let deleted = store.delete("/k/b", None).await?;
    store.close().await?;
    drop(store);

    let store = RedbStore::open(config)?;
    ensure!(store.current_revision().await? == deleted.revision);
    ensure!(store.get("/k/a").await?.map(|kv| kv.version) == Some(2));
    ensure!(store.get("/k/b").await?.is_none());
    let mut watch = store.watch("/k/", a.mod_revision).await?;
    let mut events = Vec::new();
    while events.len() < 4 {
        events.extend(watch.next().await.context("watch ended")??);
    }
    ensure!(events.last().map(|e| e.revision()) == Some(deleted.revision));
    let next = store.create("/k/c", Bytes::from("c")).await?;
    ensure!(
        next.mod_revision == deleted.revision + 1,
        "revisions continue after reopen"
    );
    Ok(())
}

fn expect_open_error(path: &std::path::Path, what: &str) -> Result<String> {
    match RedbStore::open(RedbConfig::new(path)) {
        Ok(_) => bail!("{what} opened as a store"),
        Err(e) => {
            let message = format!("{:#}", anyhow::Error::from(e));
            ensure!(
                message.contains(&path.display().to_string()),
                "the error for {what} does not name the file: {message}"
            );
            Ok(message)
        }
    }
}

#[test]
fn refuses_files_that_are_not_a_store() -> Result<()> {
    let dir = tempfile::tempdir()?;

    let garbage = dir.path().join("garbage.redb");
    std::fs::write(&garbage, vec![0x5a; 64 * 1024])?;
    expect_open_error(&garbage, "a file of garbage")?;

    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "apiVersion: v1\nkind: Pod\n")?;
    expect_open_error(&text, "a text file")?;

    // A valid redb file written by another program.
    let foreign = dir.path().join("foreign.redb");
    {
        let db = redb::Database::create(&foreign)?;
        let txn = db.begin_write()?;
        txn.open_table(redb::TableDefinition::<&str, u64>::new("users"))?
            .insert("alice", 1)?;
        txn.commit()?;
    }
    let message = expect_open_error(&foreign, "another program's redb file")?;
    ensure!(message.contains("not a Trellis store"), "{message}");

    // A store cut short, as a failed copy would leave it.
    let truncated = dir.path().join("truncated.redb");
    {
        let rt = tokio::runtime::Runtime::new()?;
        rt.block_on(async {
            let store = RedbStore::open(RedbConfig::new(&truncated))?;
            for i in 0..200 {
                store
                    .create(&format!("/t/{i}"), Bytes::from(vec![b'v'; 512]))
                    .await?;
            }
            store.close().await?;
            anyhow::Ok(())
        })?;
    }
    let len = std::fs::metadata(&truncated)?.len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&truncated)?
        .set_len(len.min(4096) / 2)?;
    expect_open_error(&truncated, "a truncated store")?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_disk_fails_the_write_not_the_process() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("store.redb");
    // A file size limit stands in for a full disk: past it writes fail with EFBIG, as
    // they fail with ENOSPC on a full disk. SIGXFSZ is ignored so the write fails
    // instead of the signal killing the process, which is what ENOSPC does too.
    let script = format!(
        "trap '' XFSZ; exec prlimit --fsize={} {} fill {}",
        4 * 1024 * 1024,
        env!("CARGO_BIN_EXE_crash_writer"),
        path.display()
    );
    let output = Command::new("sh")
        .args(["-c", &script])
        .output()
        .context("run the fill child")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        output.status.success(),
        "the child failed ({}): {stderr}\n{stdout}",
        output.status
    );
    let acked: Vec<&str> = stdout.lines().filter(|l| l.starts_with("/fill/")).collect();
    let refusal = stdout
        .lines()
        .find(|l| l.starts_with("ERR "))
        .context("no refused write")?;
    ensure!(
        acked.len() > 10,
        "only {} writes before the limit",
        acked.len()
    );
    ensure!(stdout.lines().last() == Some("ALIVE"), "{stdout}");
    ensure!(
        refusal.contains("commit") || refusal.contains("write"),
        "unclear refusal: {refusal}"
    );

    // Every acknowledged write is there after reopening without the limit.
    let store = RedbStore::open(RedbConfig::new(&path))?;
    for line in &acked {
        let mut parts = line.split(' ');
        let (key, rev) = (
            parts.next().context("key")?,
            parts.next().context("rev")?.parse::<u64>()?,
        );
        let kv = store
            .get(key)
            .await?
            .with_context(|| format!("acknowledged {key} is lost"))?;
        ensure!(kv.mod_revision == rev);
    }
    ensure!(store.current_revision().await? >= acked.len() as u64 + 1);
    store
        .create("/after/full", Bytes::from("room again"))
        .await?;
    Ok(())
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn compactor_keeps_a_time_window_of_history() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let store = RedbStore::open(RedbConfig::new(dir.path().join("store.redb")))?;
    let window = Duration::from_secs(300);
    let mut compactor = Compactor::new(CompactorConfig {
        window,
        interval: Duration::from_secs(30),
    });

    let first = store.create("/w/1", Bytes::from("1")).await?.mod_revision;
    ensure!(
        compactor.tick(&store).await.is_none(),
        "nothing is a window old yet"
    );
    tokio::time::advance(Duration::from_secs(200)).await;
    let second = store.create("/w/2", Bytes::from("2")).await?.mod_revision;
    ensure!(compactor.tick(&store).await.is_none());
    tokio::time::advance(Duration::from_secs(150)).await;
    // The first sample is now 350 s old: history before it goes, history after stays.
    ensure!(compactor.tick(&store).await == Some(first));
    let old = store
        .list(ListRequest {
            revision: Some(first - 1),
            ..ListRequest::prefix("/w/")
        })
        .await;
    ensure!(matches!(old, Err(Error::Compacted { .. })), "{old:?}");
    let kept = store
        .list(ListRequest {
            revision: Some(first),
            ..ListRequest::prefix("/w/")
        })
        .await?;
    ensure!(kept.kvs.len() == 1);
    ensure!(store.watch("/w/", second).await.is_ok());
    Ok(())
}

/// Waits for the committer to finish purging history after a compaction.
async fn purged(store: &RedbStore) -> Result<()> {
    for _ in 0..500 {
        if !store.is_purging() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    bail!("history purge did not finish within 5 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_keeps_exactly_what_reads_after_the_compaction_need() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("store.redb");
    let store = RedbStore::open(RedbConfig::new(&path))?;
    let v = |s: &str| Bytes::from(s.to_owned());
    let r2 = store.create("/p/a", v("a1")).await?.mod_revision;
    store.update("/p/a", v("a2"), None).await?; // 3
    store.update("/p/a", v("a3"), None).await?; // 4
    store.create("/p/b", v("b1")).await?; // 5
    store.delete("/p/b", None).await?; // 6
    store.create("/p/c", v("c1")).await?; // 7
    store.create("/p/d", v("d1")).await?; // 8
    let compact_at = store.update("/p/a", v("a4"), None).await?.mod_revision; // 9
    let last = store.update("/p/d", v("d2"), None).await?.mod_revision; // 10
    ensure!(r2 == 2 && compact_at == 9 && last == 10);

    store.compact(compact_at).await?;
    purged(&store).await?;

    // Reads at and after the compacted revision see values and previous values.
    let at = store
        .list(ListRequest {
            revision: Some(compact_at),
            ..ListRequest::prefix("/p/")
        })
        .await?;
    let values: Vec<&[u8]> = at.kvs.iter().map(|kv| kv.value.as_ref()).collect();
    ensure!(values == [b"a4".as_ref(), b"c1", b"d1"], "{values:?}");
    let mut watch = store.watch("/p/", compact_at).await?;
    let events = watch.next().await.context("watch ended")??;
    ensure!(events.len() == 2, "{events:?}");
    ensure!(events[0].prev.as_ref().map(|p| p.value.clone()) == Some(v("a3")));
    ensure!(events[1].prev.as_ref().map(|p| p.value.clone()) == Some(v("d1")));
    drop(watch);
    ensure!(store.get("/p/c").await?.map(|kv| kv.value) == Some(v("c1")));
    store.close().await?;
    drop(store);

    // What stays below the compacted revision: a3 (the previous value of revision 9),
    // c1 (c's value) and d1 (the previous value of revision 10); a1, a2, b1 and b's
    // deletion are gone.
    let db = redb::Database::create(&path)?;
    let txn = redb::ReadableDatabase::begin_read(&db)?;
    let log = txn.open_table(redb::TableDefinition::<u64, &[u8]>::new("log"))?;
    let revisions: Vec<u64> = redb::ReadableTable::iter(&log)?
        .map(|item| item.map(|(rev, _)| rev.value()))
        .collect::<Result<_, _>>()?;
    ensure!(
        revisions == [4, 7, 8, 9, 10],
        "history after the purge: {revisions:?}"
    );
    Ok(())
}
