//! A stop signal many tasks can wait on (shutdown, a subscriber whose configuration went).

use std::sync::Arc;

/// A stop signal many tasks can wait on.
#[derive(Debug, Clone)]
pub struct Stop(Arc<tokio::sync::watch::Sender<bool>>);

impl Default for Stop {
    fn default() -> Self {
        Stop(Arc::new(tokio::sync::watch::channel(false).0))
    }
}

impl Stop {
    pub fn cancel(&self) {
        self.0.send_replace(true);
    }

    pub fn is_cancelled(&self) -> bool {
        *self.0.borrow()
    }

    pub async fn cancelled(&self) {
        let mut rx = self.0.subscribe();
        // The sender lives as long as `self`: `wait_for` ends only once the flag is set.
        let _ = rx.wait_for(|stopped| *stopped).await;
    }
}
