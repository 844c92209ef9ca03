//! The store conformance suite: the same checks against the embedded backend and a real
//! etcd, so that both keep etcd's semantics. Each check is an `async fn` over
//! `&dyn Store`; the macro at the bottom runs every one on both backends.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use futures::StreamExt;
use trellis_store::{
    Error, Event, EventKind, ListRequest, Revision, Store, TxnOp, TxnResult, WatchStream,
};
use trellis_tests::StoreSettings;

fn val(s: impl Into<String>) -> Bytes {
    Bytes::from(s.into())
}

/// Reads events until `n` have arrived; fails on a stream error, an early end or 10 s.
async fn next_events(watch: &mut WatchStream, n: usize) -> Result<Vec<Event>> {
    let mut events = Vec::new();
    while events.len() < n {
        match tokio::time::timeout(Duration::from_secs(10), watch.next()).await {
            Err(_) => bail!("timed out with {} of {n} events: {events:?}", events.len()),
            Ok(None) => bail!("watch ended after {} of {n} events", events.len()),
            Ok(Some(item)) => events.extend(item.context("watch item")?),
        }
    }
    ensure!(
        events.len() == n,
        "got {} events, wanted {n}: {events:?}",
        events.len()
    );
    Ok(events)
}

/// Asserts that nothing more arrives for a short while.
async fn assert_quiet(watch: &mut WatchStream) -> Result<()> {
    if let Ok(item) = tokio::time::timeout(Duration::from_millis(200), watch.next()).await {
        bail!("unexpected watch item {item:?}");
    }
    Ok(())
}

async fn crud_follows_etcd_semantics(s: &dyn Store) -> Result<()> {
    let created = s.create("/crud/a", val("one")).await?;
    ensure!(created.version == 1 && created.create_revision == created.mod_revision);
    ensure!(
        s.get("/crud/a").await? == Some(created.clone()),
        "get returns what create wrote"
    );
    match s.create("/crud/a", val("again")).await {
        Err(Error::AlreadyExists { key }) => ensure!(key == "/crud/a"),
        other => bail!("second create: {other:?}"),
    }

    let updated = s
        .update("/crud/a", val("two"), Some(created.mod_revision))
        .await?;
    ensure!(
        updated.mod_revision == created.mod_revision + 1,
        "{updated:?}"
    );
    ensure!(updated.create_revision == created.create_revision && updated.version == 2);

    // A stale compare-and-swap fails and reports the current value.
    match s
        .update("/crud/a", val("stale"), Some(created.mod_revision))
        .await
    {
        Err(Error::Conflict {
            expected, current, ..
        }) => {
            ensure!(
                expected == created.mod_revision && *current == updated,
                "{current:?}"
            );
        }
        other => bail!("stale update: {other:?}"),
    }
    match s.delete("/crud/a", Some(created.mod_revision)).await {
        Err(Error::Conflict { current, .. }) => ensure!(*current == updated),
        other => bail!("stale delete: {other:?}"),
    }
    ensure!(
        s.get("/crud/a").await?.map(|kv| kv.value) == Some(val("two")),
        "failed writes change nothing"
    );

    let unconditional = s.update("/crud/a", val("three"), None).await?;
    ensure!(unconditional.version == 3);
    let deleted = s
        .delete("/crud/a", Some(unconditional.mod_revision))
        .await?;
    ensure!(deleted.prev == unconditional && deleted.revision == unconditional.mod_revision + 1);
    ensure!(s.get("/crud/a").await?.is_none());
    ensure!(s.current_revision().await? == deleted.revision);

    ensure!(matches!(
        s.update("/crud/a", val("x"), None).await,
        Err(Error::NotFound { .. })
    ));
    ensure!(matches!(
        s.delete("/crud/a", None).await,
        Err(Error::NotFound { .. })
    ));

    // A key created again starts over: new create revision, version 1.
    let again = s.create("/crud/a", val("four")).await?;
    ensure!(again.version == 1 && again.create_revision == deleted.revision + 1);
    Ok(())
}

async fn revisions_advance_by_one_per_committed_write(s: &dyn Store) -> Result<()> {
    let start = s.current_revision().await?;
    let mut expected = start;
    for i in 0..20 {
        let kv = s.create(&format!("/rev/{i:02}"), val("v")).await?;
        expected += 1;
        ensure!(
            kv.mod_revision == expected,
            "write {i}: {} != {expected}",
            kv.mod_revision
        );
        // Failed writes use no revision.
        ensure!(s.create(&format!("/rev/{i:02}"), val("v")).await.is_err());
        ensure!(s.update("/rev/missing", val("v"), None).await.is_err());
    }
    ensure!(s.current_revision().await? == start + 20);
    Ok(())
}

async fn list_pages_show_one_snapshot(s: &dyn Store) -> Result<()> {
    for i in 0..10 {
        s.create(&format!("/list/a/{i:02}"), val(format!("v{i}")))
            .await?;
    }
    s.create("/list/b/00", val("other prefix")).await?;
    s.create("/list/a", val("exact key, outside the prefix /list/a/"))
        .await?;

    let first = s
        .list(ListRequest {
            limit: Some(4),
            ..ListRequest::prefix("/list/a/")
        })
        .await?;
    ensure!(first.kvs.len() == 4 && first.more, "{first:?}");
    let snapshot = first.revision;

    // Change the range between pages: update, delete and insert keys in every page.
    s.update("/list/a/01", val("changed"), None).await?;
    s.delete("/list/a/05", None).await?;
    s.delete("/list/a/09", None).await?;
    s.create("/list/a/05x", val("new")).await?;
    s.create("/list/a/99", val("new")).await?;

    let mut seen = first.kvs.clone();
    let mut after = first.kvs.last().map(|kv| kv.key.clone());
    loop {
        let page = s
            .list(ListRequest {
                prefix: "/list/a/".into(),
                start_after: after.clone(),
                revision: Some(snapshot),
                limit: Some(4),
            })
            .await?;
        ensure!(page.revision == snapshot);
        seen.extend(page.kvs.iter().cloned());
        if !page.more {
            break;
        }
        after = page.kvs.last().map(|kv| kv.key.clone());
    }
    let keys: Vec<String> = seen.iter().map(|kv| kv.key.clone()).collect();
    let want: Vec<String> = (0..10).map(|i| format!("/list/a/{i:02}")).collect();
    ensure!(keys == want, "pages at the snapshot: {keys:?}");
    ensure!(
        seen.iter()
            .enumerate()
            .all(|(i, kv)| kv.value == val(format!("v{i}"))),
        "old values"
    );
    ensure!(seen.iter().all(|kv| kv.mod_revision <= snapshot));

    let latest = s.list(ListRequest::prefix("/list/a/")).await?;
    let keys: Vec<&str> = latest.kvs.iter().map(|kv| kv.key.as_str()).collect();
    ensure!(
        keys == [
            "/list/a/00",
            "/list/a/01",
            "/list/a/02",
            "/list/a/03",
            "/list/a/04",
            "/list/a/05x",
            "/list/a/06",
            "/list/a/07",
            "/list/a/08",
            "/list/a/99"
        ],
        "latest: {keys:?}"
    );
    ensure!(latest.kvs[1].value == val("changed") && !latest.more);
    ensure!(latest.revision == s.current_revision().await?);

    // Counts agree with the lists, at the snapshot and now, from any key on.
    let count = |revision, after: Option<&str>| ListRequest {
        prefix: "/list/a/".into(),
        start_after: after.map(str::to_owned),
        revision,
        limit: Some(1),
    };
    ensure!(s.count(count(Some(snapshot), None)).await? == 10);
    ensure!(s.count(count(Some(snapshot), Some("/list/a/03"))).await? == 6);
    ensure!(s.count(count(None, None)).await? == 10);
    ensure!(s.count(count(None, Some("/list/a/05"))).await? == 5);

    // A list before any of these keys existed is empty.
    let before = s
        .list(ListRequest {
            revision: Some(first.kvs[0].mod_revision - 1),
            ..ListRequest::prefix("/list/a/")
        })
        .await?;
    ensure!(before.kvs.is_empty(), "{before:?}");

    let future = latest.revision + 100;
    match s
        .list(ListRequest {
            revision: Some(future),
            ..ListRequest::prefix("/list/")
        })
        .await
    {
        Err(Error::FutureRevision { requested, .. }) => ensure!(requested == future),
        other => bail!("list at a future revision: {other:?}"),
    }
    Ok(())
}

async fn watch_replays_history_then_follows_live(s: &dyn Store) -> Result<()> {
    let a = s.create("/w/a", val("a1")).await?;
    s.create("/other/x", val("filtered out")).await?;
    let a2 = s.update("/w/a", val("a2"), None).await?;
    let b = s.create("/w/b", val("b1")).await?;
    let del = s.delete("/w/a", None).await?;

    let mut watch = s.watch("/w/", a.mod_revision).await?;
    let events = next_events(&mut watch, 4).await?;
    let revisions: Vec<Revision> = events.iter().map(Event::revision).collect();
    ensure!(
        revisions
            == [
                a.mod_revision,
                a2.mod_revision,
                b.mod_revision,
                del.revision
            ],
        "{revisions:?}"
    );
    ensure!(events[0].kind == EventKind::Put && events[0].prev.is_none() && events[0].kv == a);
    ensure!(
        events[1].kv == a2 && events[1].prev.as_ref() == Some(&a),
        "update carries prev"
    );
    ensure!(events[3].kind == EventKind::Delete && events[3].kv.key == "/w/a");
    ensure!(
        events[3].prev.as_ref() == Some(&a2),
        "delete carries prev: {:?}",
        events[3]
    );

    // Live changes follow, in order, exactly once.
    let c = s.create("/w/c", val("c1")).await?;
    s.create("/other/y", val("filtered out")).await?;
    let c2 = s.update("/w/c", val("c2"), Some(c.mod_revision)).await?;
    let live = next_events(&mut watch, 2).await?;
    ensure!(live[0].kv == c && live[1].kv == c2, "{live:?}");
    assert_quiet(&mut watch).await?;

    // A watch from "now" sees only what comes after it.
    let mut from_now = s.watch("/w/", 0).await?;
    let d = s.create("/w/d", val("d")).await?;
    let later = next_events(&mut from_now, 1).await?;
    ensure!(later[0].kv == d);
    assert_quiet(&mut from_now).await?;

    // A watch from the middle of history starts exactly there.
    let mut middle = s.watch("/w/", b.mod_revision).await?;
    let rest = next_events(&mut middle, 5).await?;
    let revisions: Vec<Revision> = rest.iter().map(Event::revision).collect();
    ensure!(
        revisions
            == [
                b.mod_revision,
                del.revision,
                c.mod_revision,
                c2.mod_revision,
                d.mod_revision
            ],
        "{revisions:?}"
    );
    Ok(())
}

async fn compaction_ends_history_below_it(s: &dyn Store) -> Result<()> {
    let mut revs = Vec::new();
    for i in 0..6 {
        revs.push(
            s.create(&format!("/c/{i}"), val(format!("v{i}")))
                .await?
                .mod_revision,
        );
    }
    s.update("/c/0", val("v0b"), None).await?;
    let mid = revs[3];
    s.compact(mid).await?;

    match s.watch("/c/", revs[1]).await {
        Err(Error::Compacted { requested, .. }) => ensure!(requested == revs[1]),
        Err(e) => bail!("watch below the compacted revision: {e}"),
        Ok(_) => bail!("watch below the compacted revision succeeded"),
    }
    match s
        .list(ListRequest {
            revision: Some(revs[1]),
            ..ListRequest::prefix("/c/")
        })
        .await
    {
        Err(Error::Compacted { .. }) => {}
        other => bail!("list below the compacted revision: {other:?}"),
    }
    // The compacted revision itself and everything after stay readable.
    let mut watch = s.watch("/c/", mid).await?;
    let events = next_events(&mut watch, 4).await?;
    ensure!(events[0].revision() == mid, "{events:?}");
    let at_mid = s
        .list(ListRequest {
            revision: Some(mid),
            ..ListRequest::prefix("/c/")
        })
        .await?;
    ensure!(
        at_mid.kvs.len() == 4 && at_mid.kvs[0].value == val("v0"),
        "{at_mid:?}"
    );
    // Latest values survive compaction, including keys last written below it.
    ensure!(s.get("/c/1").await?.map(|kv| kv.value) == Some(val("v1")));
    ensure!(s.list(ListRequest::prefix("/c/")).await?.kvs.len() == 6);

    ensure!(
        matches!(s.compact(mid).await, Err(Error::Compacted { .. })),
        "compact twice"
    );
    let current = s.current_revision().await?;
    ensure!(matches!(
        s.compact(current + 10).await,
        Err(Error::FutureRevision { .. })
    ));
    s.compact(current)
        .await
        .context("compact to the current revision")?;
    ensure!(s.get("/c/0").await?.map(|kv| kv.value) == Some(val("v0b")));
    Ok(())
}

async fn concurrent_writers_lose_no_update(s: Arc<dyn Store>) -> Result<()> {
    const WRITERS: usize = 16;
    const INCREMENTS: usize = 25;
    let created = s.create("/counter", val("0")).await?;
    let mut watch = s.watch("/counter", created.mod_revision + 1).await?;
    let mut tasks = Vec::new();
    for _ in 0..WRITERS {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let mut conflicts = 0usize;
            for _ in 0..INCREMENTS {
                loop {
                    let cur = s.get("/counter").await?.context("counter exists")?;
                    let n: usize = std::str::from_utf8(&cur.value)?.parse()?;
                    match s
                        .update("/counter", val((n + 1).to_string()), Some(cur.mod_revision))
                        .await
                    {
                        Ok(_) => break,
                        Err(Error::Conflict { .. }) => conflicts += 1,
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            anyhow::Ok(conflicts)
        }));
    }
    let mut conflicts = 0;
    for t in tasks {
        conflicts += t.await??;
    }
    let total = WRITERS * INCREMENTS;
    let last = s.get("/counter").await?.context("counter exists")?;
    ensure!(
        last.value == val(total.to_string()),
        "lost updates: {last:?}"
    );
    ensure!(last.version == total as u64 + 1);
    ensure!(
        conflicts > 0,
        "16 writers on one key should conflict at least once"
    );
    // Every update is one event, each building on the previous one.
    let events = next_events(&mut watch, total).await?;
    for (i, e) in events.iter().enumerate() {
        ensure!(e.kv.value == val((i + 1).to_string()), "event {i}: {e:?}");
        ensure!(e.prev.as_ref().map(|p| p.value.clone()) == Some(val(i.to_string())));
    }
    Ok(())
}

async fn slow_watcher_is_ended_without_blocking_others(s: Arc<dyn Store>) -> Result<()> {
    // Both backends run this with a watch buffer of 8.
    const WRITES: usize = 200;
    let start = s.current_revision().await? + 1;
    let mut slow = s.watch("/slow/", start).await?;
    let mut fast = s.watch("/slow/", start).await?;
    s.create("/slow/first", val("x")).await?;
    ensure!(next_events(&mut slow, 1).await?[0].kv.key == "/slow/first");

    // The fast watcher keeps up while the slow one is not read at all.
    let reader = tokio::spawn(async move { next_events(&mut fast, WRITES + 1).await });
    let last = tokio::time::timeout(Duration::from_secs(30), async {
        let mut last = 0;
        for i in 0..WRITES {
            last = s
                .create(&format!("/slow/{i:04}"), val("v"))
                .await?
                .mod_revision;
        }
        anyhow::Ok(last)
    })
    .await
    .context("writers were blocked by a slow watcher")??;
    let fast_events = reader.await??;
    ensure!(
        fast_events.last().map(Event::revision) == Some(last),
        "fast watcher got everything"
    );

    // The slow watcher gets what was buffered, then an error naming where to resume.
    let mut got: Vec<Revision> = vec![start];
    let resume_from = loop {
        match tokio::time::timeout(Duration::from_secs(10), slow.next()).await? {
            Some(Ok(events)) => got.extend(events.iter().map(Event::revision)),
            Some(Err(Error::WatcherLagged { resume_from })) => break resume_from,
            other => bail!("slow watcher: {other:?}"),
        }
    };
    ensure!(
        slow.next().await.is_none(),
        "the stream ends after the error"
    );
    ensure!(
        got.len() < WRITES,
        "the slow watcher was not cut off: {} events",
        got.len()
    );
    // Resuming where it said loses nothing and repeats nothing.
    let mut resumed = s.watch("/slow/", resume_from).await?;
    let rest = next_events(&mut resumed, (last - resume_from + 1) as usize).await?;
    got.extend(rest.iter().map(Event::revision));
    let want: Vec<Revision> = (start..=last).collect();
    ensure!(
        got == want,
        "revisions seen across the resume are not exactly {start}..={last}"
    );
    Ok(())
}

async fn oversized_values_are_refused(s: &dyn Store) -> Result<()> {
    // Both backends run this with a 1 KiB limit.
    let big = Bytes::from(vec![b'x'; 1025]);
    match s.create("/big", big.clone()).await {
        Err(Error::ValueTooLarge { key, size, limit }) => {
            ensure!(key == "/big" && size == 1025 && limit == 1024);
        }
        other => bail!("oversized create: {other:?}"),
    }
    let ok = s.create("/big", Bytes::from(vec![b'x'; 1024])).await?;
    ensure!(matches!(
        s.update("/big", big, None).await,
        Err(Error::ValueTooLarge { .. })
    ));
    ensure!(
        s.get("/big").await? == Some(ok.clone()),
        "the refused update changed nothing"
    );
    ensure!(s.current_revision().await? == ok.mod_revision);
    Ok(())
}

/// A transaction writes all of its keys or none: a failed condition anywhere leaves
/// every key as it was and is reported as the failing key's own error; a committed one
/// reaches a watcher whole, and an unconditional delete of a missing key is no failure.
async fn txn_writes_all_or_nothing(s: &dyn Store) -> Result<()> {
    let held = s.create("/txn/held", val("someone")).await?;
    let mut watch = s.watch("/txn/", held.mod_revision + 1).await?;
    let create = |k: &str| TxnOp::Create {
        key: k.into(),
        value: val(k),
    };
    // The last condition fails: nothing of the first two writes shows.
    match s
        .txn(vec![
            create("/txn/a"),
            create("/txn/b"),
            create("/txn/held"),
        ])
        .await
    {
        Err(Error::AlreadyExists { key }) => ensure!(key == "/txn/held"),
        other => bail!("a transaction over a taken key: {other:?}"),
    }
    ensure!(s.get("/txn/a").await?.is_none() && s.get("/txn/b").await?.is_none());
    match s
        .txn(vec![
            create("/txn/a"),
            TxnOp::Update {
                key: "/txn/held".into(),
                value: val("x"),
                expected: Some(held.mod_revision + 100),
            },
        ])
        .await
    {
        Err(Error::Conflict { key, current, .. }) => {
            ensure!(key == "/txn/held" && current.mod_revision == held.mod_revision)
        }
        other => bail!("a transaction at a stale revision: {other:?}"),
    }
    ensure!(s.get("/txn/a").await?.is_none());

    let results = s
        .txn(vec![
            create("/txn/a"),
            TxnOp::Delete {
                key: "/txn/missing".into(),
                expected: None,
            },
            TxnOp::Update {
                key: "/txn/held".into(),
                value: val("updated"),
                expected: Some(held.mod_revision),
            },
        ])
        .await?;
    let [
        TxnResult::Put(a),
        TxnResult::Deleted(None),
        TxnResult::Put(updated),
    ] = results.as_slice()
    else {
        bail!("results: {results:?}");
    };
    ensure!(a.version == 1 && updated.version == 2 && updated.mod_revision >= a.mod_revision);
    ensure!(s.get("/txn/held").await?.map(|kv| kv.value) == Some(val("updated")));
    let events = next_events(&mut watch, 2).await?;
    ensure!(events[0].kv.key == "/txn/a" && events[1].kv.key == "/txn/held");
    ensure!(s.current_revision().await? == updated.mod_revision);

    let results = s
        .txn(vec![
            TxnOp::Delete {
                key: "/txn/a".into(),
                expected: Some(a.mod_revision),
            },
            TxnOp::Delete {
                key: "/txn/held".into(),
                expected: None,
            },
        ])
        .await?;
    ensure!(
        matches!(results.as_slice(), [TxnResult::Deleted(Some(x)), TxnResult::Deleted(Some(y))]
            if x.prev.key == "/txn/a" && y.prev.value == val("updated")),
        "{results:?}"
    );
    ensure!(s.list(ListRequest::prefix("/txn/")).await?.kvs.is_empty());
    match s.txn(vec![create("/txn/a"), create("/txn/a")]).await {
        Err(Error::Backend { .. }) => {}
        other => bail!("a key twice in one transaction: {other:?}"),
    }
    Ok(())
}

/// Runs each check on a fresh embedded store and on a fresh etcd.
macro_rules! conformance {
    ($($name:ident($settings:expr, $arg:ident)),* $(,)?) => {
        mod on_redb {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() -> Result<()> {
                    let t = trellis_tests::TestStore::redb($settings)?;
                    super::$name(conformance!(@arg $arg t)).await
                }
            )*
        }
        mod on_etcd {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() -> Result<()> {
                    let t = trellis_tests::TestStore::etcd($settings).await?;
                    super::$name(conformance!(@arg $arg t)).await
                }
            )*
        }
    };
    (@arg dyn_ref $t:ident) => { $t.store.as_ref() };
    (@arg arc $t:ident) => { $t.store.clone() };
}

fn small_watch_buffer() -> StoreSettings {
    StoreSettings {
        watch_buffer: 8,
        ..StoreSettings::default()
    }
}

fn small_values() -> StoreSettings {
    StoreSettings {
        max_value_size: 1024,
        ..StoreSettings::default()
    }
}

conformance! {
    crud_follows_etcd_semantics(StoreSettings::default(), dyn_ref),
    txn_writes_all_or_nothing(StoreSettings::default(), dyn_ref),
    revisions_advance_by_one_per_committed_write(StoreSettings::default(), dyn_ref),
    list_pages_show_one_snapshot(StoreSettings::default(), dyn_ref),
    watch_replays_history_then_follows_live(StoreSettings::default(), dyn_ref),
    compaction_ends_history_below_it(StoreSettings::default(), dyn_ref),
    concurrent_writers_lose_no_update(StoreSettings::default(), arc),
    slow_watcher_is_ended_without_blocking_others(small_watch_buffer(), arc),
    oversized_values_are_refused(small_values(), dyn_ref),
}
