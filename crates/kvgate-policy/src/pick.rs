//! Tie-breaking shared by the policies: the minimum by a key, ties broken with the injected RNG so
//! that several gateway replicas do not herd onto the same worker.

use rand::Rng;

/// The candidate with the fewest requests in flight (ties at random); 0 for an empty slice.
pub fn least_in_flight(candidates: &[crate::Candidate], rng: &mut dyn rand::RngCore) -> usize {
    pick_min_by(0..candidates.len(), |i| candidates[i].in_flight, rng).unwrap_or(0)
}

/// One of the indices that minimise `key`, chosen at random among ties.
pub fn pick_min_by<K: PartialOrd + Copy>(
    indices: impl Iterator<Item = usize>,
    key: impl Fn(usize) -> K,
    rng: &mut dyn rand::RngCore,
) -> Option<usize> {
    let mut best: Vec<usize> = Vec::new();
    let mut best_key: Option<K> = None;
    for i in indices {
        let k = key(i);
        match best_key {
            Some(b) if k > b => {}
            Some(b) if k == b => best.push(i),
            _ => {
                best_key = Some(k);
                best.clear();
                best.push(i);
            }
        }
    }
    match best.len() {
        0 => None,
        1 => Some(best[0]),
        n => Some(best[rng.random_range(0..n)]),
    }
}
