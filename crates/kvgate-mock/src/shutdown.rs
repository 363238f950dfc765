//! The fleet's shutdown signal as the mock's tasks wait on it: a `watch` flag that turns true once.

use tokio::sync::watch;

/// Resolves once `stop` is true (or its sender is gone).
pub(crate) async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stopped| *stopped).await;
}
