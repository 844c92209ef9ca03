//! The child process of the store's crash and full-disk tests.
//!
//! `crash_writer write PATH WRITERS`: opens the embedded store at PATH and writes from
//! WRITERS concurrent tasks until it is killed. After each acknowledged write it prints
//! `KEY REVISION VALUE` on stdout; the parent kills it with SIGKILL at a random moment
//! and checks that every printed write survived.
//!
//! `crash_writer fill PATH`: writes until the store refuses a write (run under a file
//! size limit), printing each acknowledged write, then `ERR message` for the refusal.
//! It then checks that it can still read, and exits 0: a full disk fails the write, not
//! the process.

use std::io::Write;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use trellis_store::{RedbConfig, RedbStore, Store};

fn print_line(out: &Mutex<std::io::Stdout>, line: String) -> Result<()> {
    // One write per line: lines stay whole in the pipe even when the process is killed.
    let out = out.lock().unwrap_or_else(|e| e.into_inner());
    let mut out = out.lock();
    out.write_all(line.as_bytes())?;
    out.flush()?;
    Ok(())
}

async fn write(path: &str, writers: usize) -> Result<()> {
    let store = Arc::new(RedbStore::open(RedbConfig::new(path))?);
    let out = Arc::new(Mutex::new(std::io::stdout()));
    let pid = std::process::id();
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (store, out) = (store.clone(), out.clone());
        tasks.push(tokio::spawn(async move {
            let counter = format!("/crash/{pid}/counter/{w}");
            let mut last = store.create(&counter, Bytes::from("0")).await?;
            print_line(&out, format!("{counter} {} 0\n", last.mod_revision))?;
            for seq in 1u64.. {
                // Alternate fresh keys and compare-and-swap updates of one key per writer.
                if seq % 2 == 0 {
                    let value = seq.to_string();
                    last = store
                        .update(
                            &counter,
                            Bytes::from(value.clone()),
                            Some(last.mod_revision),
                        )
                        .await?;
                    print_line(&out, format!("{counter} {} {value}\n", last.mod_revision))?;
                } else {
                    let key = format!("/crash/{pid}/keys/{w}/{seq}");
                    let value = format!("{w}-{seq}");
                    let kv = store.create(&key, Bytes::from(value.clone())).await?;
                    print_line(&out, format!("{key} {} {value}\n", kv.mod_revision))?;
                }
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

async fn fill(path: &str) -> Result<()> {
    let store = RedbStore::open(RedbConfig::new(path))?;
    let out = Mutex::new(std::io::stdout());
    let value = Bytes::from(vec![b'f'; 16 * 1024]);
    let mut refused = None;
    for i in 0..100_000u64 {
        let key = format!("/fill/{i:06}");
        match store.create(&key, value.clone()).await {
            Ok(kv) => print_line(&out, format!("{key} {} f\n", kv.mod_revision))?,
            Err(e) => {
                print_line(&out, format!("ERR {:#}\n", anyhow::Error::from(e)))?;
                refused = Some(i);
                break;
            }
        }
    }
    let Some(refused) = refused else {
        bail!("the file size limit never stopped a write")
    };
    // Still alive, and what was acknowledged is still readable.
    let first = store
        .get("/fill/000000")
        .await
        .context("read after the refused write")?;
    if refused > 0 && first.is_none() {
        bail!("an acknowledged write is gone after the refused write");
    }
    print_line(&out, "ALIVE\n".to_owned())?;
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        [_, "write", path, writers] => write(path, writers.parse()?).await,
        [_, "fill", path] => fill(path).await,
        _ => bail!("usage: crash_writer write PATH WRITERS | fill PATH"),
    }
}
