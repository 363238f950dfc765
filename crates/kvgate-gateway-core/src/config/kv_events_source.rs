//! Where a worker's KV events come from: one ZMQ publisher (and optionally its replay socket)
//! per data-parallel rank, as given by `--kv-events-endpoints`, YAML or `POST /workers`.

use serde::Serialize;

/// One rank's publisher and replay socket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RankEndpoints {
    /// ZMQ PUB endpoint, `tcp://host:port`.
    pub events: String,
    /// ZMQ ROUTER replay endpoint, `tcp://host:port`.
    pub replay: Option<String>,
}

/// A worker's KV event publishers, rank 0 first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KvEventsSource {
    pub ranks: Vec<RankEndpoints>,
}

/// Marks a worker without KV events in a positional list (`--kv-events-endpoints`).
pub const NO_ENDPOINT: &str = "-";

impl KvEventsSource {
    /// Parses one worker's entry: `-` or empty for none, else comma-separated endpoints, one per
    /// data-parallel rank; `replay` (same shape, same count) names their replay sockets.
    pub fn parse(events: &str, replay: Option<&str>) -> Result<Option<KvEventsSource>, String> {
        let events = split(events);
        let replay = replay.map(split).unwrap_or_default();
        if events.is_empty() {
            if !replay.is_empty() {
                return Err("a replay endpoint is given for a worker without a KV events endpoint".into());
            }
            return Ok(None);
        }
        if !replay.is_empty() && replay.len() != events.len() {
            return Err(format!(
                "{} KV events endpoints but {} replay endpoints (one per data-parallel rank)",
                events.len(),
                replay.len()
            ));
        }
        let mut ranks = Vec::with_capacity(events.len());
        for (rank, endpoint) in events.iter().enumerate() {
            check_endpoint(endpoint)?;
            let replay =
                replay.get(rank).map(|endpoint| check_endpoint(endpoint).map(|()| endpoint.to_string()));
            ranks.push(RankEndpoints { events: endpoint.to_string(), replay: replay.transpose()? });
        }
        Ok(Some(KvEventsSource { ranks }))
    }
}

fn split(list: &str) -> Vec<&str> {
    let list = list.trim();
    if list.is_empty() || list == NO_ENDPOINT {
        return Vec::new();
    }
    list.split(',').map(str::trim).collect()
}

/// `tcp://host:port` with a host a subscriber can connect to.
fn check_endpoint(endpoint: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("KV events endpoint {endpoint:?} {why}"));
    let Some(address) = endpoint.strip_prefix("tcp://") else {
        return bad("must look like tcp://host:port");
    };
    let Some((host, port)) = address.rsplit_once(':') else {
        return bad("has no port");
    };
    if host.is_empty() || host == "*" || host == "0.0.0.0" {
        return bad("needs the engine's address (the engine binds a wildcard; connect to its host)");
    }
    match port.parse::<u16>() {
        Ok(port) if port > 0 => Ok(()),
        _ => bad("has an invalid port"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_parse_per_rank() {
        assert_eq!(KvEventsSource::parse("-", None), Ok(None));
        assert_eq!(KvEventsSource::parse("", None), Ok(None));
        let one =
            KvEventsSource::parse("tcp://127.0.0.1:5557", Some("tcp://127.0.0.1:5558")).unwrap().unwrap();
        assert_eq!(
            one.ranks,
            [RankEndpoints {
                events: "tcp://127.0.0.1:5557".into(),
                replay: Some("tcp://127.0.0.1:5558".into())
            }]
        );
        let dp = KvEventsSource::parse("tcp://127.0.0.1:5557, tcp://127.0.0.1:5558", None).unwrap().unwrap();
        assert_eq!(dp.ranks.len(), 2);
        assert!(dp.ranks.iter().all(|rank| rank.replay.is_none()));
    }

    #[test]
    fn bad_entries_say_why() {
        for (events, replay, needle) in [
            ("127.0.0.1:5557", None, "tcp://host:port"),
            ("tcp://*:5557", None, "engine's address"),
            ("tcp://127.0.0.1:99999", None, "invalid port"),
            ("tcp://127.0.0.1", None, "no port"),
            ("tcp://127.0.0.1:1", Some("tcp://127.0.0.1:2,tcp://127.0.0.1:3"), "2 replay endpoints"),
            ("-", Some("tcp://127.0.0.1:2"), "without a KV events endpoint"),
        ] {
            let error = KvEventsSource::parse(events, replay).unwrap_err();
            assert!(error.contains(needle), "{events:?}: {error}");
        }
    }
}
