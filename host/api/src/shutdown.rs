//! The signal that tells a component's tasks to stop (mini-redis' `Shutdown`): a
//! [`Stop`] held by whoever decides, any number of [`Shutdown`] clones passed to the
//! tasks as a parameter, never a global, so a test stops what it started.

use std::sync::OnceLock;

use tokio::sync::watch;

/// The deciding side: [`Stop::stop`], or dropping its last clone, shuts every
/// [`Shutdown`] of the signal down.
#[derive(Clone, Debug)]
pub struct Stop(watch::Sender<bool>);

/// The waiting side, cloned into every task that must end with its component.
#[derive(Clone, Debug)]
pub struct Shutdown(watch::Receiver<bool>);

impl Stop {
    /// Shuts down every [`Shutdown`] of this signal; those made later start shut down.
    pub fn stop(&self) {
        self.0.send_replace(true);
    }

    /// Another waiting side of this signal.
    pub fn subscribe(&self) -> Shutdown {
        Shutdown(self.0.subscribe())
    }
}

impl Shutdown {
    /// A new signal, not yet given.
    pub fn new() -> (Stop, Shutdown) {
        let (stop, shutdown) = watch::channel(false);
        (Stop(stop), Shutdown(shutdown))
    }

    /// A signal nobody gives: for what runs until its process ends.
    pub fn never() -> Shutdown {
        // One sender for the process' life, never used, so `wait` never returns.
        static NEVER: OnceLock<watch::Sender<bool>> = OnceLock::new();
        Shutdown(NEVER.get_or_init(|| watch::channel(false).0).subscribe())
    }

    /// Whether the signal was given (or its [`Stop`] dropped).
    pub fn is_shutdown(&self) -> bool {
        *self.0.borrow() || self.0.has_changed().is_err()
    }

    /// Returns once the signal is given, or its [`Stop`] dropped: a task that can no
    /// longer be told to stop has no one left to work for.
    pub async fn wait(&self) {
        let mut shutdown = self.0.clone();
        let _ = shutdown.wait_for(|stopped| *stopped).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stop_reaches_every_clone_and_later_ones() {
        let (stop, shutdown) = Shutdown::new();
        let other = shutdown.clone();
        assert!(!shutdown.is_shutdown());
        let waiting = tokio::spawn(async move { other.wait().await });
        stop.stop();
        waiting.await.unwrap();
        assert!(shutdown.is_shutdown());
        assert!(stop.subscribe().is_shutdown());
    }

    #[tokio::test]
    async fn a_dropped_stop_shuts_down() {
        let (stop, shutdown) = Shutdown::new();
        drop(stop);
        shutdown.wait().await;
        assert!(shutdown.is_shutdown());
    }

    #[tokio::test]
    async fn a_stop_with_a_clone_left_does_not() {
        let (stop, shutdown) = Shutdown::new();
        let kept = stop.clone();
        drop(stop);
        assert!(!shutdown.is_shutdown());
        kept.stop();
        shutdown.wait().await;
    }

    #[tokio::test]
    async fn never_stays_up() {
        let shutdown = Shutdown::never();
        let waited =
            tokio::time::timeout(std::time::Duration::from_millis(20), shutdown.wait()).await;
        assert!(waited.is_err());
        assert!(!shutdown.is_shutdown());
    }
}
