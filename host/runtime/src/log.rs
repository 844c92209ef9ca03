//! Container output in the CRI log format the kubelet reads: one record per line,
//! `<RFC 3339 UTC timestamp, nanoseconds> <stdout|stderr> <F|P> <content>\n`, where
//! `P` marks a part of a longer line (or a last line without a newline).
//!
//! A log is rotated by size, as the kubelet's `containerLogMaxSize` and
//! `containerLogMaxFiles` do it (10 MiB, 5 files): past the limit the file is renamed
//! `NAME.<nanoseconds>` and a new one begins; the oldest rotated files are removed. A
//! write that fails (a full disk) drops the output and never stops the container.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Longest record's content: a longer line is split into partial (`P`) records, as
/// the kubelet's own limit for a line is.
const MAX_LINE: usize = 16 * 1024;
/// A log file's size past which it is rotated.
const MAX_BYTES: u64 = 10 << 20;
/// Files a container's log keeps: the current one and the newest rotated ones.
const MAX_FILES: usize = 5;

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
    /// With the file's size.
    file: Mutex<Option<(std::fs::File, u64)>>,
    max_bytes: u64,
}

impl LogFile {
    /// Opens (appending) or creates the log at `path`, with its directories.
    pub(crate) fn open(path: &Path) -> std::io::Result<Arc<Self>> {
        Self::open_with_limit(path, MAX_BYTES)
    }

    fn open_with_limit(path: &Path, max_bytes: u64) -> std::io::Result<Arc<Self>> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let file = Self::open_file(path)?;
        Ok(Arc::new(Self {
            path: path.to_path_buf(),
            file: Mutex::new(Some(file)),
            max_bytes,
        }))
    }

    fn open_file(path: &Path) -> std::io::Result<(std::fs::File, u64)> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        Ok((file, size))
    }

    /// Opens the path again: the kubelet renamed the file to rotate it.
    pub(crate) fn reopen(&self) -> std::io::Result<()> {
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        *file = None;
        *file = Some(Self::open_file(&self.path)?);
        Ok(())
    }

    /// Renames the full file aside, starts a new one, and removes the oldest rotated
    /// files beyond [`MAX_FILES`].
    fn rotate(&self, file: &mut Option<(std::fs::File, u64)>) {
        let stamp = jiff::Timestamp::now().as_nanosecond();
        let mut aside = self.path.clone().into_os_string();
        aside.push(format!(".{stamp}"));
        if let Err(e) = std::fs::rename(&self.path, &aside) {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot rotate a container log");
            return;
        }
        *file = Self::open_file(&self.path).ok();
        let (Some(dir), Some(name)) = (self.path.parent(), self.path.file_name()) else {
            return;
        };
        let prefix = format!("{}.", name.to_string_lossy());
        let mut rotated: Vec<PathBuf> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .map(|e| e.path())
            .collect();
        // The suffixes are nanosecond stamps of the same width: they sort by age.
        rotated.sort();
        let keep = MAX_FILES.saturating_sub(1);
        for old in rotated.iter().take(rotated.len().saturating_sub(keep)) {
            let _ = std::fs::remove_file(old);
        }
    }

    fn record(&self, stream: Stream, partial: bool, content: &[u8]) {
        let timestamp = jiff::Timestamp::now();
        let tag = if partial { "P" } else { "F" };
        let mut line = Vec::with_capacity(content.len() + 48);
        line.extend_from_slice(format!("{timestamp} {} {tag} ", stream.as_str()).as_bytes());
        line.extend_from_slice(content);
        line.push(b'\n');
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        let Some((f, size)) = file.as_mut() else {
            return;
        };
        match f.write_all(&line) {
            Ok(()) => *size += line.len() as u64,
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot write a container log");
                return;
            }
        }
        if *size > self.max_bytes {
            self.rotate(&mut file);
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
    fn a_full_log_is_rotated_and_the_oldest_files_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c").join("0.log");
        let log = LogFile::open_with_limit(&path, 200).unwrap();
        for i in 0..100 {
            log.record(
                Stream::Stdout,
                false,
                format!("line {i:03} of a chatty container").as_bytes(),
            );
        }
        let files: Vec<String> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(files.len(), MAX_FILES, "{files:?}");
        assert!(files.contains(&"0.log".to_owned()));
        let current = std::fs::read_to_string(&path).unwrap();
        assert!(current.len() <= 200 + 100, "{current}");
        assert!(
            !current.contains("line 000"),
            "the oldest lines are gone: {current}"
        );
    }

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
