//! The CRI log files of the node's containers, read as the kubelet's
//! `kuberuntime/logs` reads them for `kubectl logs`: which file a request reads
//! ([`locate`]), the decoding of its records, `tailLines`, `sinceTime`, `limitBytes`
//! and following ([`stream`]). The route that serves them is [`crate::server`]'s.
//!
//! # Files
//! The runtime writes each container run to
//! `ROOT/logs/NAMESPACE_POD_UID/CONTAINER/ATTEMPT.log`, one record a line:
//! `<RFC 3339 timestamp> <stdout|stderr> <F|P> <content>`, where `P` is a piece of a
//! line the next records of the same stream continue and `F` its last piece. The
//! highest attempt is the current run; the one before it is `previous=true`'s.
//! Namespace and pod names cannot hold `_`, so `NAMESPACE_POD_` names one pod; when
//! several pods of that name left directories (deleted and created again), the newest
//! is read.
//!
//! # Following
//! `follow=true` polls the file and sends what it gains. The runtime does not tell when
//! a run ends, so the stream ends once the file has not grown for [`IDLE_BEFORE_END`]
//! and either a newer attempt's file exists, the pod's log directory is gone, or the
//! runtime lists the run as exited (or no longer lists it). Otherwise it lasts until
//! the client goes away or the agent stops. Rotated files are not followed.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use jiff::Timestamp;
use tokio::io::AsyncReadExt as _;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::debug;

use crate::Context;
use crate::http::parse_bool;
use crate::labels::{CONTAINER_NAME, POD_UID};
use crate::paths::pod_logs_prefix;

/// How often a followed file is looked at for new records.
const POLL: Duration = Duration::from_millis(100);
/// How long a followed file must stay as it is before the agent asks whether its run
/// ended: a run that is writing is never ended early.
const IDLE_BEFORE_END: Duration = Duration::from_secs(1);
/// How long the runtime may take to list a pod's containers.
const RUNTIME_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes read from a file at a time, and the size output is sent in.
const CHUNK: usize = 64 * 1024;
/// The longest line assembled from partial records; longer ones are sent in pieces of
/// this size, so one endless line cannot use up the agent's memory.
const MAX_LINE: usize = 1 << 20;

/// `PodLogOptions`, as the query carries them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogOptions {
    pub follow: bool,
    pub previous: bool,
    pub timestamps: bool,
    pub tail_lines: Option<u64>,
    /// From `sinceTime`, or `sinceSeconds` before the request.
    pub since: Option<Timestamp>,
    pub limit_bytes: Option<u64>,
}

impl LogOptions {
    /// Parses the query string, with Kubernetes' validation of `PodLogOptions`; the
    /// error is the message for the client.
    pub fn parse(query: &str, now: Timestamp) -> Result<LogOptions, String> {
        let mut options = LogOptions::default();
        let mut since_seconds = None;
        let mut since_time = None;
        for (key, value) in form_urlencoded::parse(query.as_bytes()) {
            let number = |v: &str| {
                v.parse::<i64>()
                    .map_err(|_| format!("invalid {key} {v:?}: not an integer"))
            };
            match key.as_ref() {
                "follow" => options.follow = parse_bool(&key, &value)?,
                "previous" => options.previous = parse_bool(&key, &value)?,
                "timestamps" => options.timestamps = parse_bool(&key, &value)?,
                "tailLines" => {
                    let n = number(&value)?;
                    options.tail_lines =
                        Some(u64::try_from(n).map_err(|_| format!("tailLines {n} must be >= 0"))?);
                }
                "limitBytes" => {
                    let n = number(&value)?;
                    if n < 1 {
                        return Err(format!("limitBytes {n} must be greater than 0"));
                    }
                    options.limit_bytes = u64::try_from(n).ok();
                }
                "sinceSeconds" => {
                    let n = number(&value)?;
                    if n < 1 {
                        return Err(format!("sinceSeconds {n} must be greater than 0"));
                    }
                    since_seconds = Some(n);
                }
                "sinceTime" => {
                    since_time = Some(value.parse::<Timestamp>().map_err(|e| {
                        format!("invalid sinceTime {value:?}: not an RFC 3339 time: {e}")
                    })?);
                }
                _ => {}
            }
        }
        options.since = match (since_seconds, since_time) {
            (Some(_), Some(_)) => {
                return Err("at most one of `sinceTime` or `sinceSeconds` may be specified".into());
            }
            (Some(seconds), None) => Some(
                now.checked_sub(jiff::SignedDuration::from_secs(seconds))
                    .unwrap_or(Timestamp::MIN),
            ),
            (None, time) => time,
        };
        if options.previous {
            // A previous run has ended: there is nothing to wait for.
            options.follow = false;
        }
        Ok(options)
    }
}

/// The log file a request reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Located {
    /// `ROOT/logs/NAMESPACE_POD_UID`.
    pod_dir: PathBuf,
    uid: String,
    container: String,
    /// The run the file belongs to (its restart count).
    attempt: u32,
    pub(crate) path: PathBuf,
}

#[derive(Debug)]
pub(crate) enum LocateError {
    /// The message for the client.
    NotFound(String),
    Io(std::io::Error),
}

impl From<std::io::Error> for LocateError {
    fn from(e: std::io::Error) -> Self {
        LocateError::Io(e)
    }
}

/// Finds the file of the latest run of `container` in `logs` (the agent's
/// `ROOT/logs`), or of the run before it when `previous`.
pub(crate) fn locate(
    logs: &Path,
    namespace: &str,
    pod: &str,
    container: &str,
    previous: bool,
) -> Result<Located, LocateError> {
    let Some((pod_dir, uid)) = pod_log_dir(logs, namespace, pod)? else {
        return Err(LocateError::NotFound(format!(
            "pod {pod:?} in namespace {namespace:?} has no logs on this node"
        )));
    };
    let runs = attempts(&pod_dir.join(container))?;
    let chosen = if previous {
        runs.len().checked_sub(2).and_then(|i| runs.get(i))
    } else {
        runs.last()
    };
    let Some((attempt, path)) = chosen.cloned() else {
        return Err(LocateError::NotFound(if previous {
            format!("previous terminated container {container:?} in pod {pod:?} not found")
        } else {
            format!("container {container:?} in pod {pod:?} is waiting to start")
        }));
    };
    Ok(Located {
        pod_dir,
        uid,
        container: container.to_owned(),
        attempt,
        path,
    })
}
/// The newest `NAMESPACE_POD_UID` directory in `logs`, with its UID.
fn pod_log_dir(
    logs: &Path,
    namespace: &str,
    pod: &str,
) -> std::io::Result<Option<(PathBuf, String)>> {
    let prefix = pod_logs_prefix(namespace, pod);
    let entries = match std::fs::read_dir(logs) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut newest: Option<(std::time::SystemTime, PathBuf, String)> = None;
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let Some(uid) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        if uid.is_empty() || uid.contains('_') {
            continue;
        }
        let Ok(meta) = entry.metadata() else {
            continue;
        };
        if !meta.is_dir() {
            continue;
        }
        let modified = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
        if newest.as_ref().is_none_or(|(m, _, _)| modified > *m) {
            newest = Some((modified, entry.path(), uid.to_owned()));
        }
    }
    Ok(newest.map(|(_, path, uid)| (path, uid)))
}

/// A container directory's `ATTEMPT.log` files, oldest run first; none when the
/// directory does not exist.
fn attempts(dir: &Path) -> std::io::Result<Vec<(u32, PathBuf)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut runs = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let Some(attempt) = name
            .to_str()
            .and_then(|n| n.strip_suffix(".log"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        runs.push((attempt, entry.path()));
    }
    runs.sort();
    Ok(runs)
}

/// One record of a CRI log file.
#[derive(Debug, PartialEq, Eq)]
struct Record<'a> {
    timestamp: &'a str,
    stderr: bool,
    partial: bool,
    content: &'a [u8],
}

impl<'a> Record<'a> {
    /// Parses one line, without its newline; `None` if it is not a record.
    fn parse(line: &'a [u8]) -> Option<Record<'a>> {
        let mut fields = line.splitn(4, |b| *b == b' ');
        let timestamp = std::str::from_utf8(fields.next()?).ok()?;
        let stderr = match fields.next()? {
            b"stdout" => false,
            b"stderr" => true,
            _ => return None,
        };
        let partial = match fields.next()? {
            b"F" => false,
            b"P" => true,
            _ => return None,
        };
        if timestamp.is_empty() {
            return None;
        }
        Some(Record {
            timestamp,
            stderr,
            partial,
            content: fields.next().unwrap_or_default(),
        })
    }
}

/// One line of output: a record, or the partial records of a stream joined. A line
/// longer than [`MAX_LINE`] comes in pieces: the first, then continuations.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Line {
    /// The first piece's timestamp, as the file has it.
    timestamp: String,
    at: Option<Timestamp>,
    content: Vec<u8>,
    /// Ended by an `F` record; a line the run never finished is shown without a newline.
    complete: bool,
    /// Which stream it is of: a long line's pieces may be interleaved with the other
    /// stream's lines.
    stderr: bool,
    /// A later piece of a line longer than [`MAX_LINE`]: it carries on the one before
    /// of its stream, without a timestamp of its own, and is not a line of its own
    /// for `tailLines`.
    continuation: bool,
}

impl Line {
    fn render(&self, timestamps: bool, out: &mut Vec<u8>) {
        if timestamps && !self.continuation {
            out.extend_from_slice(self.timestamp.as_bytes());
            out.push(b' ');
        }
        out.extend_from_slice(&self.content);
        if self.complete {
            out.push(b'\n');
        }
    }
}

/// Turns a CRI log's bytes, as they are read, into lines: a record is taken once its
/// newline is read, and partial records are joined per stream until their `F`.
#[derive(Debug, Default)]
struct Decoder {
    /// Bytes of a record whose newline is not read yet.
    carry: Vec<u8>,
    /// The unfinished line of stdout, and of stderr.
    partial: [Option<Line>; 2],
    /// Per stream, the first piece's timestamp while a line longer than [`MAX_LINE`]
    /// is being sent in pieces.
    pieces: [Option<(String, Option<Timestamp>)>; 2],
}

impl Decoder {
    fn feed(&mut self, bytes: &[u8], out: &mut Vec<Line>) {
        let mut rest = bytes;
        while let Some(end) = rest.iter().position(|b| *b == b'\n') {
            if self.carry.is_empty() {
                self.record(&rest[..end], out);
            } else {
                let mut line = std::mem::take(&mut self.carry);
                line.extend_from_slice(&rest[..end]);
                self.record(&line, out);
            }
            rest = &rest[end + 1..];
        }
        self.carry.extend_from_slice(rest);
    }

    fn record(&mut self, line: &[u8], out: &mut Vec<Line>) {
        let Some(record) = Record::parse(line) else {
            debug!(
                line = %String::from_utf8_lossy(&line[..line.len().min(80)]),
                "skipping a log line that is not a CRI record"
            );
            return;
        };
        let stream = usize::from(record.stderr);
        let slot = &mut self.partial[stream];
        let line = match slot {
            Some(pending) => {
                pending.content.extend_from_slice(record.content);
                pending
            }
            None => {
                let (timestamp, at, continuation) = match &self.pieces[stream] {
                    Some((timestamp, at)) => (timestamp.clone(), *at, true),
                    None => (
                        record.timestamp.to_owned(),
                        record.timestamp.parse().ok(),
                        false,
                    ),
                };
                slot.insert(Line {
                    timestamp,
                    at,
                    content: record.content.to_vec(),
                    complete: false,
                    stderr: record.stderr,
                    continuation,
                })
            }
        };
        if !record.partial {
            line.complete = true;
        }
        if line.complete {
            self.pieces[stream] = None;
            out.extend(slot.take());
        } else if line.content.len() >= MAX_LINE {
            self.pieces[stream] = Some((line.timestamp.clone(), line.at));
            out.extend(slot.take());
        }
    }

    /// The end of a log that will not grow: its unfinished lines, as they are.
    fn finish(&mut self, out: &mut Vec<Line>) {
        if !self.carry.is_empty() {
            let carry = std::mem::take(&mut self.carry);
            self.record(&carry, out);
        }
        let mut rest: Vec<Line> = self.partial.iter_mut().filter_map(Option::take).collect();
        rest.sort_by(|a, b| a.timestamp.cmp(&b.timestamp));
        out.extend(rest);
    }
}

/// Applies `sinceTime`, `tailLines`, `timestamps` and `limitBytes` to lines, into the
/// bytes to send.
#[derive(Debug)]
struct Selector {
    since: Option<Timestamp>,
    timestamps: bool,
    /// While the file's existing lines are read with `tailLines`: the last ones.
    tail: Option<Tail>,
    /// Bytes still allowed by `limitBytes`.
    remaining: Option<u64>,
    out: Vec<u8>,
}

impl Selector {
    fn new(options: &LogOptions) -> Self {
        Self {
            since: options.since,
            timestamps: options.timestamps,
            tail: options
                .tail_lines
                .map(|n| Tail::new(usize::try_from(n).unwrap_or(usize::MAX))),
            remaining: options.limit_bytes,
            out: Vec::new(),
        }
    }

    /// Whether `limitBytes` is used up: nothing more will be sent.
    fn done(&self) -> bool {
        self.remaining == Some(0)
    }

    fn push(&mut self, line: Line) {
        if let (Some(since), Some(at)) = (self.since, line.at)
            && at < since
        {
            return;
        }
        if let Some(tail) = &mut self.tail {
            tail.push(line);
            return;
        }
        self.emit(&line);
    }

    /// The existing lines are read: the kept tail goes out, and later lines (a
    /// follow's) are sent as they come.
    fn end_of_existing(&mut self) {
        if let Some(tail) = self.tail.take() {
            for line in tail.kept {
                self.emit(&line);
            }
        }
    }

    fn emit(&mut self, line: &Line) {
        if self.done() {
            return;
        }
        let start = self.out.len();
        line.render(self.timestamps, &mut self.out);
        if let Some(remaining) = &mut self.remaining {
            let added = (self.out.len() - start) as u64;
            if added > *remaining {
                self.out
                    .truncate(start + usize::try_from(*remaining).unwrap_or(usize::MAX));
                *remaining = 0;
            } else {
                *remaining -= added;
            }
        }
    }

    fn take(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.out)
    }
}

/// The last `n` lines, a line longer than [`MAX_LINE`] with all its pieces.
#[derive(Debug)]
struct Tail {
    n: usize,
    kept: VecDeque<Line>,
    /// Lines begun in `kept` (first pieces), which is what `n` counts.
    lines: usize,
    /// Per stream: a line was dropped from the front before its last piece, so its
    /// remaining pieces go too.
    dropping: [bool; 2],
}

impl Tail {
    fn new(n: usize) -> Self {
        Self {
            n,
            kept: VecDeque::new(),
            lines: 0,
            dropping: [false; 2],
        }
    }

    fn push(&mut self, line: Line) {
        let stream = usize::from(line.stderr);
        if line.continuation && self.dropping[stream] {
            self.dropping[stream] = !line.complete;
            return;
        }
        if !line.continuation {
            self.lines += 1;
        }
        self.kept.push_back(line);
        while self.lines > self.n {
            self.pop_front();
        }
        // Pieces whose first piece is gone, now at the front.
        while self
            .kept
            .front()
            .is_some_and(|l| l.continuation && self.dropping[usize::from(l.stderr)])
        {
            self.pop_front();
        }
    }

    fn pop_front(&mut self) {
        let Some(line) = self.kept.pop_front() else {
            return;
        };
        if !line.continuation {
            self.lines -= 1;
        }
        self.dropping[usize::from(line.stderr)] = !line.complete;
    }
}

/// Reads `file` into `tx` as `options` ask; follows it until its run ends.
pub(crate) async fn stream(
    ctx: &Context,
    mut file: tokio::fs::File,
    located: &Located,
    options: &LogOptions,
    tx: mpsc::Sender<Bytes>,
) -> anyhow::Result<()> {
    let mut decoder = Decoder::default();
    let mut selector = Selector::new(options);
    let mut lines = Vec::new();
    let mut chunk = vec![0u8; CHUNK];
    // What the file holds now.
    loop {
        let n = file.read(&mut chunk).await.context("read the log")?;
        if n == 0 {
            break;
        }
        decoder.feed(&chunk[..n], &mut lines);
        for line in lines.drain(..) {
            selector.push(line);
        }
        if selector.tail.is_none() && selector.out.len() >= CHUNK {
            send(&tx, selector.take()).await?;
        }
        if selector.done() {
            break;
        }
    }
    if !options.follow {
        decoder.finish(&mut lines);
        for line in lines.drain(..) {
            selector.push(line);
        }
        selector.end_of_existing();
        return send(&tx, selector.take()).await;
    }
    selector.end_of_existing();
    send(&tx, selector.take()).await?;
    // What it gains.
    let mut grew = Instant::now();
    let mut asked = Instant::now();
    while !selector.done() {
        let n = file.read(&mut chunk).await.context("read the log")?;
        if n > 0 {
            decoder.feed(&chunk[..n], &mut lines);
            for line in lines.drain(..) {
                selector.push(line);
            }
            if selector.out.len() >= CHUNK {
                send(&tx, selector.take()).await?;
            }
            grew = Instant::now();
            continue;
        }
        send(&tx, selector.take()).await?;
        if grew.elapsed() >= IDLE_BEFORE_END && asked.elapsed() >= IDLE_BEFORE_END {
            asked = Instant::now();
            if run_ended(ctx, located).await {
                // Whatever it wrote last, then its unfinished lines.
                loop {
                    let n = file.read(&mut chunk).await.context("read the log")?;
                    if n == 0 {
                        break;
                    }
                    decoder.feed(&chunk[..n], &mut lines);
                }
                decoder.finish(&mut lines);
                for line in lines.drain(..) {
                    selector.push(line);
                }
                break;
            }
        }
        tokio::select! {
            () = tx.closed() => return Ok(()),
            () = tokio::time::sleep(POLL) => {}
        }
    }
    send(&tx, selector.take()).await
}

async fn send(tx: &mpsc::Sender<Bytes>, bytes: Vec<u8>) -> anyhow::Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    tx.send(Bytes::from(bytes))
        .await
        .map_err(|_| anyhow::anyhow!("the client went away"))
}

/// Whether the run a followed file belongs to is over (see the module's
/// documentation).
async fn run_ended(ctx: &Context, located: &Located) -> bool {
    let (pod_dir, container, attempt) = (
        located.pod_dir.clone(),
        located.container.clone(),
        located.attempt,
    );
    let on_disk = tokio::task::spawn_blocking(move || {
        if !pod_dir.is_dir() {
            return true;
        }
        attempts(&pod_dir.join(container)).is_ok_and(|runs| runs.iter().any(|(a, _)| *a > attempt))
    })
    .await
    .unwrap_or(false);
    on_disk || runtime_says_ended(ctx, located).await
}

/// Whether the runtime lists the run as exited, or no longer lists it. An unanswered
/// question keeps the follow going.
async fn runtime_says_ended(ctx: &Context, located: &Located) -> bool {
    use k8s_cri::v1 as cri;
    let mut runtime = ctx.cri.runtime.clone();
    let request = cri::ListContainersRequest {
        filter: Some(cri::ContainerFilter {
            label_selector: [
                (POD_UID.to_owned(), located.uid.clone()),
                (CONTAINER_NAME.to_owned(), located.container.clone()),
            ]
            .into(),
            ..Default::default()
        }),
    };
    let listed = match tokio::time::timeout(RUNTIME_TIMEOUT, runtime.list_containers(request)).await
    {
        Ok(Ok(listed)) => listed.into_inner().containers,
        Ok(Err(e)) => {
            debug!(error = %e.message(), "list a pod's containers for a followed log failed");
            return false;
        }
        Err(_) => return false,
    };
    let run = listed.iter().find(|c| {
        c.labels.get(POD_UID) == Some(&located.uid)
            && c.metadata
                .as_ref()
                .is_some_and(|m| m.name == located.container && m.attempt == located.attempt)
    });
    run.is_none_or(|c| c.state == cri::ContainerState::ContainerExited as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(query: &str) -> LogOptions {
        LogOptions::parse(query, "2024-05-01T12:00:00Z".parse().unwrap()).unwrap()
    }

    /// What a request with `query` shows of `log`, as a non-followed read does it.
    fn read(log: &str, query: &str) -> String {
        let options = options(query);
        let mut decoder = Decoder::default();
        let mut selector = Selector::new(&options);
        let mut lines = Vec::new();
        // Fed in small pieces, as reads of a growing file return them.
        for piece in log.as_bytes().chunks(7) {
            decoder.feed(piece, &mut lines);
        }
        decoder.finish(&mut lines);
        for line in lines {
            selector.push(line);
        }
        selector.end_of_existing();
        String::from_utf8(selector.take()).unwrap()
    }

    const LOG: &str = "\
2024-05-01T11:59:00.000000001Z stdout F one
2024-05-01T11:59:10Z stderr F two
2024-05-01T11:59:20Z stdout P th
2024-05-01T11:59:21Z stderr F four
2024-05-01T11:59:22Z stdout P re
2024-05-01T11:59:23Z stdout F e
2024-05-01T11:59:30Z stdout F 
2024-05-01T11:59:40Z stdout F five with spaces  
";

    #[test]
    fn joins_partial_records_and_interleaves_streams() {
        assert_eq!(
            read(LOG, ""),
            "one\ntwo\nfour\nthree\n\nfive with spaces  \n"
        );
    }

    #[test]
    fn timestamps_prefix_each_line_with_its_first_piece() {
        let out = read(LOG, "timestamps=true");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "2024-05-01T11:59:00.000000001Z one");
        assert_eq!(lines[3], "2024-05-01T11:59:20Z three");
        assert_eq!(lines[4], "2024-05-01T11:59:30Z ");
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        assert_eq!(read(LOG, "tailLines=2"), "\nfive with spaces  \n");
        assert_eq!(read(LOG, "tailLines=0"), "");
        assert_eq!(read(LOG, "tailLines=100"), read(LOG, ""));
    }

    #[test]
    fn since_keeps_lines_at_or_after() {
        assert_eq!(
            read(LOG, "sinceTime=2024-05-01T11%3A59%3A21Z"),
            "four\n\nfive with spaces  \n"
        );
        // 12:00:00 - 30 s: 11:59:30 and later.
        assert_eq!(read(LOG, "sinceSeconds=30"), "\nfive with spaces  \n");
        assert_eq!(
            read(
                LOG,
                "sinceTime=2024-05-01T13%3A59%3A21%2B02%3A00&tailLines=1"
            ),
            "five with spaces  \n"
        );
    }

    #[test]
    fn limit_bytes_cuts_the_output() {
        assert_eq!(read(LOG, "limitBytes=6"), "one\ntw");
        assert_eq!(read(LOG, "limitBytes=4&tailLines=1"), "five");
    }

    #[test]
    fn unfinished_last_line_is_shown_without_newline() {
        let log = "2024-05-01T11:59:00Z stdout F a\n2024-05-01T11:59:01Z stdout P b\n2024-05-01T11:59:02Z stdout F c";
        // The last record lacks its newline and the partial one its `F`: both shown.
        assert_eq!(read(log, ""), "a\nbc\n");
        let log = "2024-05-01T11:59:00Z stdout F a\n2024-05-01T11:59:01Z stdout P b\n";
        assert_eq!(read(log, ""), "a\nb");
    }

    #[test]
    fn skips_lines_that_are_not_records() {
        let log = "garbage\n2024-05-01T11:59:00Z stdout F a\n2024-05-01T11:59:00Z other F x\n\n";
        assert_eq!(read(log, ""), "a\n");
    }

    #[test]
    fn record_without_content_is_an_empty_line() {
        assert_eq!(
            Record::parse(b"2024-05-01T11:59:00Z stderr F"),
            Some(Record {
                timestamp: "2024-05-01T11:59:00Z",
                stderr: true,
                partial: false,
                content: b"",
            })
        );
    }

    #[test]
    fn endless_line_is_sent_in_pieces() {
        let mut decoder = Decoder::default();
        let mut lines = Vec::new();
        let piece = "x".repeat(16 * 1024);
        for _ in 0..(MAX_LINE / piece.len()) + 1 {
            decoder.feed(
                format!("2024-05-01T11:59:00Z stdout P {piece}\n").as_bytes(),
                &mut lines,
            );
        }
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0].content.len(), MAX_LINE);
        assert!(!lines[0].complete);
    }

    /// A log with a line of `len` bytes between two short ones, written as the runtime
    /// writes one: 16 KiB partial records, then the rest in a full one (an empty one
    /// with `empty_end`); a stderr line comes in between its pieces.
    fn log_with_long_line(len: usize, empty_end: bool) -> (String, String) {
        let long: String = (0..len)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        let mut log = String::from("2024-05-01T11:59:00Z stdout F before\n");
        let mut pieces = long.as_bytes().chunks(16 * 1024).peekable();
        let mut i = 0;
        while let Some(piece) = pieces.next() {
            let tag = if pieces.peek().is_some() || empty_end {
                "P"
            } else {
                "F"
            };
            let piece = std::str::from_utf8(piece).unwrap();
            log.push_str(&format!("2024-05-01T11:59:01Z stdout {tag} {piece}\n"));
            if i == 3 {
                log.push_str("2024-05-01T11:59:01Z stderr F between\n");
            }
            i += 1;
        }
        if empty_end {
            log.push_str("2024-05-01T11:59:01Z stdout F \n");
        }
        log.push_str("2024-05-01T11:59:02Z stdout F after\n");
        (log, long)
    }

    #[test]
    fn tail_counts_a_line_longer_than_the_cap_once() {
        // More than the cap, and exactly the cap with an empty `F` record after it.
        for (len, empty_end) in [(MAX_LINE + MAX_LINE / 2, false), (MAX_LINE, true)] {
            let (log, long) = log_with_long_line(len, empty_end);
            assert_eq!(
                read(&log, "tailLines=2"),
                format!("{long}\nafter\n"),
                "{len}"
            );
            assert_eq!(
                read(&log, "tailLines=3"),
                format!("between\n{long}\nafter\n"),
                "{len}"
            );
            assert_eq!(
                read(&log, "tailLines=4"),
                format!("before\nbetween\n{long}\nafter\n")
            );
            assert_eq!(read(&log, "tailLines=1"), "after\n");
            assert_eq!(read(&log, ""), read(&log, "tailLines=4"));
            let stamped = read(&log, "timestamps=true&tailLines=2");
            assert_eq!(
                stamped,
                format!("2024-05-01T11:59:01Z {long}\n2024-05-01T11:59:02Z after\n")
            );
        }
    }

    #[test]
    fn options_follow_kubernetes_validation() {
        let now: Timestamp = "2024-05-01T12:00:00Z".parse().unwrap();
        let o = options("follow=true&timestamps=1&tailLines=10&limitBytes=5&previous=false");
        assert!(o.follow && o.timestamps && !o.previous);
        assert_eq!((o.tail_lines, o.limit_bytes), (Some(10), Some(5)));
        // A previous run is read, never followed.
        assert!(!options("follow=true&previous=true").follow);
        assert_eq!(
            options("sinceSeconds=60").since,
            Some("2024-05-01T11:59:00Z".parse().unwrap())
        );
        for bad in [
            "tailLines=-1",
            "limitBytes=0",
            "sinceSeconds=0",
            "sinceSeconds=1&sinceTime=2024-05-01T11%3A59%3A00Z",
            "sinceTime=yesterday",
            "follow=maybe",
            "tailLines=ten",
        ] {
            assert!(LogOptions::parse(bad, now).is_err(), "{bad}");
        }
    }

    fn write(path: &Path, contents: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, contents).unwrap();
    }

    #[test]
    fn locates_latest_and_previous_runs() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path();
        let pod = logs.join("default_web_uid-1");
        write(&pod.join("app/0.log"), "");
        write(&pod.join("app/1.log"), "");
        write(&pod.join("app/10.log"), "");
        write(&pod.join("app/notes.txt"), "");
        // Another pod whose name starts the same.
        write(&logs.join("default_web-2_uid-2/app/5.log"), "");

        let latest = locate(logs, "default", "web", "app", false).unwrap();
        assert_eq!((latest.attempt, latest.uid.as_str()), (10, "uid-1"));
        assert_eq!(latest.path, pod.join("app/10.log"));
        let previous = locate(logs, "default", "web", "app", true).unwrap();
        assert_eq!(previous.attempt, 1);

        write(&logs.join("default_single_uid-3/app/0.log"), "");
        let Err(LocateError::NotFound(message)) = locate(logs, "default", "single", "app", true)
        else {
            panic!("a first run has no previous one");
        };
        assert_eq!(
            message,
            r#"previous terminated container "app" in pod "single" not found"#
        );
        assert!(matches!(
            locate(logs, "default", "web", "sidecar", false),
            Err(LocateError::NotFound(_))
        ));
        assert!(matches!(
            locate(logs, "default", "gone", "app", false),
            Err(LocateError::NotFound(_))
        ));
        assert!(matches!(
            locate(&logs.join("missing"), "default", "web", "app", false),
            Err(LocateError::NotFound(_))
        ));
    }

    #[test]
    fn locates_the_newest_of_several_pods_of_one_name() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path();
        write(&logs.join("ns_p_old/c/0.log"), "");
        let past = std::time::SystemTime::now() - Duration::from_secs(3600);
        std::fs::File::open(logs.join("ns_p_old"))
            .unwrap()
            .set_modified(past)
            .unwrap();
        write(&logs.join("ns_p_new/c/0.log"), "");
        assert_eq!(locate(logs, "ns", "p", "c", false).unwrap().uid, "new");
    }
}
