//! Container output in the CRI log format the kubelet reads: one record per line,
//! `<RFC 3339 UTC timestamp, nanoseconds> <stdout|stderr> <F|P> <content>\n`, where
//! `P` marks a part of a longer line (or a last line without a newline).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Longest record's content: a longer line is split into partial (`P`) records, as
/// the kubelet's own limit for a line is.
const MAX_LINE: usize = 16 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    fn as_str(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// A container's log file, shared by its stdout and stderr writers.
#[derive(Debug)]
pub(crate) struct LogFile {
    path: PathBuf,
    /// `None` after a failed reopen: output is dropped rather than kept in memory.
    file: Mutex<Option<std::fs::File>>,
}

impl LogFile {
    /// Opens (appending) or creates the log at `path`, with its directories.
    pub(crate) fn open(path: &Path) -> std::io::Result<Arc<Self>> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let file = Self::open_file(path)?;
        Ok(Arc::new(Self {
            path: path.to_path_buf(),
            file: Mutex::new(Some(file)),
        }))
    }

    fn open_file(path: &Path) -> std::io::Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
    }

    /// Opens the path again: the kubelet renamed the file to rotate it.
    pub(crate) fn reopen(&self) -> std::io::Result<()> {
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        *file = None;
        *file = Some(Self::open_file(&self.path)?);
        Ok(())
    }

    fn record(&self, stream: Stream, partial: bool, content: &[u8]) {
        let timestamp = jiff::Timestamp::now();
        let tag = if partial { "P" } else { "F" };
        let mut line = Vec::with_capacity(content.len() + 48);
        line.extend_from_slice(format!("{timestamp} {} {tag} ", stream.as_str()).as_bytes());
        line.extend_from_slice(content);
        line.push(b'\n');
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = file.as_mut()
            && let Err(e) = f.write_all(&line)
        {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot write a container log");
        }
    }
}

/// Cuts one stream's bytes into records.
#[derive(Debug)]
pub(crate) struct Lines {
    stream: Stream,
    log: Option<Arc<LogFile>>,
    line: Vec<u8>,
}

impl Lines {
    /// Lines of `stream` into `log`; with no log the output is dropped.
    pub(crate) fn new(stream: Stream, log: Option<Arc<LogFile>>) -> Self {
        Self {
            stream,
            log,
            line: Vec::new(),
        }
    }

    pub(crate) fn push(&mut self, bytes: &[u8]) {
        let Some(log) = &self.log else { return };
        let mut rest = bytes;
        while !rest.is_empty() {
            match memchr_newline(rest) {
                Some(i) => {
                    self.line.extend_from_slice(&rest[..i]);
                    log.record(self.stream, false, &self.line);
                    self.line.clear();
                    rest = &rest[i + 1..];
                }
                None => {
                    self.line.extend_from_slice(rest);
                    rest = &[];
                }
            }
            while self.line.len() >= MAX_LINE {
                log.record(self.stream, true, &self.line[..MAX_LINE]);
                self.line.drain(..MAX_LINE);
            }
        }
    }

    /// The stream ended: a last line without a newline is written as partial.
    pub(crate) fn finish(&mut self) {
        if let Some(log) = &self.log
            && !self.line.is_empty()
        {
            log.record(self.stream, true, &self.line);
            self.line.clear();
        }
    }
}

impl Drop for Lines {
    fn drop(&mut self) {
        self.finish();
    }
}

fn memchr_newline(bytes: &[u8]) -> Option<usize> {
    bytes.iter().position(|&b| b == b'\n')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_lines_and_an_unfinished_last_line_are_partial_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/b/0.log");
        let log = LogFile::open(&path).unwrap();
        let mut lines = Lines::new(Stream::Stderr, Some(log));
        lines.push(b"one\ntw");
        lines.push(b"o\n");
        lines.push(&vec![b'x'; MAX_LINE + 3]);
        lines.push(b"\nend");
        drop(lines);
        let text = std::fs::read_to_string(&path).unwrap();
        let records: Vec<(&str, &str, usize)> = text
            .lines()
            .map(|l| {
                let mut parts = l.splitn(4, ' ');
                let time = parts.next().unwrap();
                assert!(time.parse::<jiff::Timestamp>().is_ok(), "{time}");
                assert_eq!(parts.next(), Some("stderr"));
                let tag = parts.next().unwrap();
                let content = parts.next().unwrap();
                (tag, &content[..content.len().min(3)], content.len())
            })
            .collect();
        assert_eq!(
            records,
            [
                ("F", "one", 3),
                ("F", "two", 3),
                ("P", "xxx", MAX_LINE),
                ("F", "xxx", 3),
                ("P", "end", 3)
            ]
        );
    }
}
