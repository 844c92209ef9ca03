//! The threads guest code runs on: a small tokio runtime owned by the host. Every
//! instantiation and call of a plugin runs there and its caller awaits the answer, so
//! a guest that computes for its whole deadline holds one of these threads, never one
//! of the caller's (the API server's workers keep serving HTTP and watches).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::runtime::{Handle, Runtime};
use tokio::task::{JoinError, JoinHandle};

pub(crate) struct CallThreads {
    handle: Handle,
    /// Taken on drop and shut down without waiting: a host may be dropped inside an
    /// async context, where a runtime may not block to join its threads.
    runtime: Option<Runtime>,
}

impl CallThreads {
    pub(crate) fn start(threads: usize) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("plugin-call")
            // Deadlines and WASI's clocks use the runtime's timers. No I/O driver: a
            // plugin is granted no sockets or files, and without one a parked thread
            // is woken by a futex rather than through epoll, a few microseconds less
            // on every call that finds the threads idle.
            .enable_time()
            .build()?;
        Ok(Self {
            handle: runtime.handle().clone(),
            runtime: Some(runtime),
        })
    }

    /// Runs `call` on the call threads. The answer comes back through the returned
    /// future; dropping that future stops the call at its next yield.
    pub(crate) fn run<F>(&self, call: F) -> Running<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        Running(self.handle.spawn(call))
    }
}

impl Drop for CallThreads {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// A call running on the call threads, stopped when dropped: a caller that gives up
/// (its client went away) frees the instance instead of leaving the guest to run.
pub(crate) struct Running<T>(JoinHandle<T>);

impl<T> Future for Running<T> {
    type Output = Result<T, JoinError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx)
    }
}

impl<T> Drop for Running<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Metadata, Subscriber};

    use crate::testing::{built, host};
    use crate::{HostConfig, PluginKind, PluginSpec, review};

    /// Counts the records plugins write through the `log` import on the thread it is
    /// the default of.
    struct GuestLogs(Arc<AtomicUsize>);

    impl Subscriber for GuestLogs {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, event: &Event<'_>) {
            if event.metadata().module_path() == Some("trellis_plugin_host::imports::log") {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }

    #[test]
    fn guest_code_runs_on_the_call_threads_not_the_callers() {
        // A host import runs on the thread that runs the guest: a record the guest
        // logs would land here if the call ran on the caller's thread.
        let logged = Arc::new(AtomicUsize::new(0));
        let _here = tracing::subscriber::set_default(GuestLogs(logged.clone()));
        // One thread, as each of the API server's workers is.
        let caller = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let answer = caller.block_on(async {
            let host = host(HostConfig::default());
            let spec = PluginSpec::new("logs", PluginKind::Validating);
            let plugin = host.load(spec, built("misbehave"), None).await.unwrap();
            let request = review::request_from_review(
                &serde_json::json!({"request": {"name": "web", "object": {}}}),
                r#"{"mode": "log"}"#,
            )
            .unwrap();
            plugin.admit(&host, &request).await.unwrap()
        });
        assert!(answer.allowed);
        assert_eq!(
            logged.load(Ordering::Relaxed),
            0,
            "the guest ran on the caller's thread"
        );
    }
}
