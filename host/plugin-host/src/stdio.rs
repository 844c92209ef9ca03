//! A plugin's stdout and stderr, line by line into the host's log, tagged with the
//! plugin's name (WASI grants no other place to write to).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};

/// Longest line kept; a plugin printing without newlines is cut here.
const MAX_LINE: usize = 8 * 1024;

#[derive(Clone, Debug)]
pub struct LogStream {
    pub plugin: Arc<str>,
    pub stream: &'static str,
}

impl IsTerminal for LogStream {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for LogStream {
    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(LineWriter {
            target: self.clone(),
            line: Vec::new(),
        })
    }
}

struct LineWriter {
    target: LogStream,
    line: Vec<u8>,
}

impl LineWriter {
    fn emit(&mut self) {
        if self.line.is_empty() {
            return;
        }
        let text = String::from_utf8_lossy(&self.line);
        tracing::info!(
            plugin = %self.target.plugin,
            stream = self.target.stream,
            "{}",
            text.trim_end()
        );
        self.line.clear();
    }
}

impl AsyncWrite for LineWriter {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        for &byte in buf {
            if byte == b'\n' {
                self.emit();
            } else {
                self.line.push(byte);
                if self.line.len() >= MAX_LINE {
                    self.emit();
                }
            }
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.emit();
        Poll::Ready(Ok(()))
    }
}

impl Drop for LineWriter {
    fn drop(&mut self) {
        self.emit();
    }
}
