//! I/O threads (`--io-threads N`), nginx's model: N threads, each with its own single-threaded
//! runtime and its own `SO_REUSEPORT` listener on the gateway's address, so the kernel spreads
//! new connections over them and a client connection, its requests and the upstream connections
//! they use stay on one thread (one reactor, no wake-up or task hand-off between threads).
//! The background loops stay on the caller's runtime. With `--io-threads 0` (the default) one
//! listener is served on the caller's runtime.

use std::io;
use std::net::SocketAddr;

use axum::Router;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use super::{connection_slots, serve, Surface};
use kvgate_proxy::state::SharedState;

/// Backlog of each listener (tokio's default for `TcpListener::bind`).
const BACKLOG: u32 = 1024;

/// Listen on `addr` (`host:port`): one listener, or `count` listeners sharing the address
/// through `SO_REUSEPORT` (all on the port the first one got, for port 0).
pub async fn bind(addr: &str, count: usize) -> io::Result<Vec<TcpListener>> {
    if count <= 1 {
        return Ok(vec![TcpListener::bind(addr).await?]);
    }
    let mut resolved = tokio::net::lookup_host(addr).await?;
    let mut at: SocketAddr =
        resolved.next().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no address"))?;
    let mut listeners = Vec::with_capacity(count);
    for _ in 0..count {
        let socket = if at.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
        socket.set_reuseaddr(true)?;
        socket.set_reuseport(true)?;
        socket.bind(at)?;
        let listener = socket.listen(BACKLOG)?;
        at = listener.local_addr()?;
        listeners.push(listener);
    }
    Ok(listeners)
}

/// Serve each listener on a thread of its own until `stop` turns true. The returned task ends
/// when every thread has finished its open requests; aborting it stops the threads at once
/// (their open connections are dropped).
pub fn spawn_io_threads(
    listeners: Vec<TcpListener>,
    state: SharedState,
    router: Router,
    stop: watch::Receiver<bool>,
) -> io::Result<JoinHandle<()>> {
    let slots = connection_slots(&state);
    let mut finished = Vec::with_capacity(listeners.len());
    let mut aborts = Vec::with_capacity(listeners.len());
    for (index, listener) in listeners.into_iter().enumerate() {
        let listener = listener.into_std()?;
        let (abort, aborted) = oneshot::channel::<()>();
        let (done, finish) = oneshot::channel::<()>();
        let (state, router, stop, slots) = (state.clone(), router.clone(), stop.clone(), slots.clone());
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        std::thread::Builder::new().name(format!("kvgate-io-{index}")).spawn(move || {
            kvgate_gateway_core::conn::use_shard(index + 1);
            runtime.block_on(async move {
                let listener = match TcpListener::from_std(listener) {
                    Ok(listener) => listener,
                    Err(error) => return tracing::error!(%error, "I/O thread cannot listen"),
                };
                tokio::select! {
                    _ = serve(listener, state, router, stop, slots, Surface::Traffic) => {}
                    // The owner went away (aborted after the grace period): stop now.
                    _ = aborted => {}
                }
            });
            // Dropping the runtime drops the connections still open.
            drop(runtime);
            let _ = done.send(());
        })?;
        aborts.push(abort);
        finished.push(finish);
    }
    Ok(tokio::spawn(async move {
        let _aborts = aborts;
        for finish in finished {
            let _ = finish.await;
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn listeners_share_one_port_and_each_accepts() {
        let listeners = bind("127.0.0.1:0", 3).await.unwrap();
        assert_eq!(listeners.len(), 3);
        let port = listeners[0].local_addr().unwrap().port();
        assert!(listeners.iter().all(|l| l.local_addr().unwrap().port() == port), "one port for all");
        // The kernel spreads connections over the listeners: every one of them gets some.
        let mut accepted = [0usize; 3];
        let mut clients = Vec::new();
        for _ in 0..60 {
            clients.push(tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap());
            for (index, listener) in listeners.iter().enumerate() {
                let ready = tokio::time::timeout(std::time::Duration::from_millis(1), listener.accept());
                if let Ok(Ok(_)) = ready.await {
                    accepted[index] += 1;
                }
            }
        }
        assert!(accepted.iter().all(|&n| n > 0), "accepted per listener: {accepted:?}");
    }

    #[tokio::test]
    async fn one_listener_needs_no_reuseport() {
        let listeners = bind("127.0.0.1:0", 1).await.unwrap();
        assert_eq!(listeners.len(), 1);
        assert!(bind("not an address", 2).await.is_err());
    }
}
