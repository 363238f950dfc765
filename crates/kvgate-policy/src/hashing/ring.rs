//! A consistent-hash ring with virtual nodes. Each worker owns `virtual_nodes` points placed by
//! hashing its name (the host's stable name for it, e.g. its URL; its id when none was given),
//! so a worker joining or leaving moves only the keys between its points and their neighbours:
//! about 1/N of them.

use std::collections::HashMap;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::WorkerId;

/// The ring over a set of workers.
#[derive(Debug, Default)]
pub struct HashRing {
    /// (point, worker), sorted by point.
    points: Vec<(u64, WorkerId)>,
    members: Vec<WorkerId>,
}

/// A worker's stable identity on the ring: its name's hash, or its id's.
pub fn name_hash(name: &str) -> u64 {
    xxh3_64_with_seed(name.as_bytes(), 0x6b76_6761_7465)
}

impl HashRing {
    /// A ring over `members` (`names`: a stable hash per worker; workers missing there are
    /// placed by their id).
    pub fn new(members: &[WorkerId], names: &HashMap<WorkerId, u64>, virtual_nodes: usize) -> Self {
        let mut points = Vec::with_capacity(members.len() * virtual_nodes);
        for &worker in members {
            let identity =
                names.get(&worker).copied().unwrap_or_else(|| name_hash(&format!("worker-{worker}")));
            for vnode in 0..virtual_nodes as u64 {
                points.push((xxh3_64_with_seed(&vnode.to_le_bytes(), identity), worker));
            }
        }
        points.sort_unstable();
        let mut members = members.to_vec();
        members.sort_unstable();
        Self { points, members }
    }

    /// The sorted workers the ring was built over.
    pub fn members(&self) -> &[WorkerId] {
        &self.members
    }

    /// Every member once, clockwise from `key`'s position: the owner first.
    pub fn walk(&self, key: u64) -> impl Iterator<Item = WorkerId> + '_ {
        let start = self.points.partition_point(|&(point, _)| point < key);
        let mut seen: Vec<WorkerId> = Vec::with_capacity(self.members.len());
        let total = self.members.len();
        self.points[start..].iter().chain(&self.points[..start]).map(|&(_, worker)| worker).filter(
            move |worker| {
                if seen.len() == total || seen.contains(worker) {
                    return false;
                }
                seen.push(*worker);
                true
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owners(ring: &HashRing, keys: u64) -> Vec<WorkerId> {
        (0..keys).map(|k| ring.walk(xxh3_64_with_seed(&k.to_le_bytes(), 7)).next().unwrap()).collect()
    }

    #[test]
    fn about_one_nth_of_keys_move_when_a_worker_joins_or_leaves() {
        let names: HashMap<WorkerId, u64> =
            (0..9).map(|w| (w, name_hash(&format!("http://127.0.0.1:{}", 8000 + w)))).collect();
        let eight: Vec<WorkerId> = (0..8).collect();
        let nine: Vec<WorkerId> = (0..9).collect();
        let before = owners(&HashRing::new(&eight, &names, 160), 10_000);
        let after = owners(&HashRing::new(&nine, &names, 160), 10_000);
        let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
        // Ideal: 1/9 of the keys (1,111), all of them to the new worker.
        assert!((700..=1_600).contains(&moved), "{moved} of 10,000 keys moved");
        assert!(before.iter().zip(&after).all(|(a, b)| a == b || *b == 8));
        // Balance: every worker owns a fair share (1,250 each ideally).
        for worker in 0..8 {
            let owned = before.iter().filter(|&&w| w == worker).count();
            assert!((850..=1_650).contains(&owned), "worker {worker} owns {owned}");
        }
        // Leaving: only the leaver's keys move.
        let seven: Vec<WorkerId> = (0..7).collect();
        let fewer = owners(&HashRing::new(&seven, &names, 160), 10_000);
        assert!(before.iter().zip(&fewer).all(|(a, b)| a == b || *a == 7));
    }

    #[test]
    fn a_walk_visits_every_member_once() {
        let ring = HashRing::new(&[3, 1, 2], &HashMap::new(), 4);
        let mut walked: Vec<_> = ring.walk(12345).collect();
        walked.sort_unstable();
        assert_eq!(walked, [1, 2, 3]);
        assert_eq!(HashRing::default().walk(1).count(), 0);
    }
}
