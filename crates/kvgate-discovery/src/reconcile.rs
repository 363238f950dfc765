//! The pure bookkeeping of one pod watch: which pods stand for which workers, and the joins and
//! leaves each watch event implies. A re-list (`begin_relist` .. `end_relist`) leaves alone the
//! pods it lists unchanged, so a broken watch never drops a worker that is still there.

use std::collections::HashMap;

use super::pod::{PodKey, PodTarget};

/// A change to the registry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Join(PodTarget),
    Leave(PodTarget),
}

/// The workers one watch stands for, by pod.
#[derive(Debug, Default)]
pub struct Reconciler {
    ready: HashMap<PodKey, PodTarget>,
    /// While re-listing: the Ready pods listed so far.
    listing: Option<HashMap<PodKey, PodTarget>>,
}

impl Reconciler {
    /// A pod was added or changed: `target` is its worker when it is Ready, else `None`.
    pub fn apply(&mut self, key: PodKey, target: Option<PodTarget>) -> Vec<Action> {
        let previous = match &target {
            Some(target) => self.ready.insert(key, target.clone()),
            None => self.ready.remove(&key),
        };
        match (previous, target) {
            (Some(previous), Some(target)) if previous == target => Vec::new(),
            (Some(previous), Some(target)) => vec![Action::Leave(previous), Action::Join(target)],
            (Some(previous), None) => vec![Action::Leave(previous)],
            (None, Some(target)) => vec![Action::Join(target)],
            (None, None) => Vec::new(),
        }
    }

    /// A pod was deleted.
    pub fn delete(&mut self, key: &str) -> Vec<Action> {
        self.ready.remove(key).map(Action::Leave).into_iter().collect()
    }

    /// The watch restarted: the pods listed until `end_relist` are the whole truth.
    pub fn begin_relist(&mut self) {
        self.listing = Some(HashMap::new());
    }

    /// A pod of the re-list.
    pub fn relist_pod(&mut self, key: PodKey, target: Option<PodTarget>) {
        let listing = self.listing.get_or_insert_with(HashMap::new);
        if let Some(target) = target {
            listing.insert(key, target);
        }
    }

    /// The re-list is complete: pods not listed (or no longer Ready) leave, new ones join,
    /// unchanged ones stay untouched.
    pub fn end_relist(&mut self) -> Vec<Action> {
        let listed = self.listing.take().unwrap_or_default();
        let mut actions = Vec::new();
        let mut gone: Vec<&PodKey> = self.ready.keys().filter(|key| !listed.contains_key(*key)).collect();
        gone.sort();
        for key in gone {
            actions.push(Action::Leave(self.ready[key].clone()));
        }
        let mut keys: Vec<&PodKey> = listed.keys().collect();
        keys.sort();
        for key in keys {
            let target = &listed[key];
            match self.ready.get(key) {
                Some(previous) if previous == target => {}
                Some(previous) => {
                    actions.push(Action::Leave(previous.clone()));
                    actions.push(Action::Join(target.clone()));
                }
                None => actions.push(Action::Join(target.clone())),
            }
        }
        self.ready = listed;
        actions
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_protocol::role::WorkerRole;

    fn target(ip: &str) -> PodTarget {
        PodTarget { url: format!("http://{ip}:8000"), role: WorkerRole::Regular, bootstrap_port: None }
    }

    /// Runs `steps` (`+name@ip` ready, `-name` not ready, `xname` deleted, `[` re-list,
    /// `=name@ip` listed, `]` end) and returns the actions as `+url` / `-url`.
    fn check(steps: &str, expected: &str) {
        let mut reconciler = Reconciler::default();
        let mut out = Vec::new();
        for step in steps.split_whitespace() {
            let (op, rest) = step.split_at(1);
            let (name, ip) = rest.split_once('@').unwrap_or((rest, ""));
            let actions = match op {
                "+" => reconciler.apply(name.into(), Some(target(ip))),
                "-" => reconciler.apply(name.into(), None),
                "x" => reconciler.delete(name),
                "[" => {
                    reconciler.begin_relist();
                    Vec::new()
                }
                "=" => {
                    reconciler.relist_pod(name.into(), Some(target(ip)));
                    Vec::new()
                }
                "]" => reconciler.end_relist(),
                _ => panic!("bad step {step}"),
            };
            for action in actions {
                out.push(match action {
                    Action::Join(t) => format!("+{}", t.url),
                    Action::Leave(t) => format!("-{}", t.url),
                });
            }
        }
        assert_eq!(out.join(" "), expected, "steps: {steps}");
    }

    #[test]
    fn ready_pods_join_and_leave() {
        check("+a@1.1.1.1", "+http://1.1.1.1:8000");
        check("+a@1.1.1.1 +a@1.1.1.1", "+http://1.1.1.1:8000");
        check("+a@1.1.1.1 -a", "+http://1.1.1.1:8000 -http://1.1.1.1:8000");
        check("+a@1.1.1.1 xa xa", "+http://1.1.1.1:8000 -http://1.1.1.1:8000");
        check("-a xa", "");
        check("+a@1.1.1.1 +a@2.2.2.2", "+http://1.1.1.1:8000 -http://1.1.1.1:8000 +http://2.2.2.2:8000");
    }

    #[test]
    fn a_relist_keeps_unchanged_pods_and_settles_the_rest() {
        check("+a@1.1.1.1 [ =a@1.1.1.1 ]", "+http://1.1.1.1:8000");
        check(
            "+a@1.1.1.1 +b@2.2.2.2 [ =b@2.2.2.2 =c@3.3.3.3 ]",
            "+http://1.1.1.1:8000 +http://2.2.2.2:8000 -http://1.1.1.1:8000 +http://3.3.3.3:8000",
        );
        check("+a@1.1.1.1 [ =a@9.9.9.9 ]", "+http://1.1.1.1:8000 -http://1.1.1.1:8000 +http://9.9.9.9:8000");
        check("+a@1.1.1.1 [ ] +b@2.2.2.2", "+http://1.1.1.1:8000 -http://1.1.1.1:8000 +http://2.2.2.2:8000");
    }
}
