//! The approximate index as a replica consults it: its own tree's match merged with the blocks
//! its peers routed (per worker, the longer of the two), and a read-only view of the tree for
//! decisions that must not be recorded (dry runs).

use super::{PeerBlocks, PromptBlocks};
use crate::{ApproxIndex, IndexKind, PrefixIndex, PrefixMatch, PromptKey, TenantId};

/// The tree's answer without recording the choice.
#[derive(Clone, Copy)]
pub struct ReadOnlyTree<'a>(pub &'a ApproxIndex);

impl PrefixIndex for ReadOnlyTree<'_> {
    fn kind(&self) -> IndexKind {
        IndexKind::Approximate
    }

    fn route(
        &self,
        key: PromptKey<'_>,
        _now_ms: u64,
        choose: &mut dyn FnMut(&PrefixMatch) -> Option<TenantId>,
    ) -> Option<TenantId> {
        self.0.peek(key, choose)
    }

    fn tenant_size(&self, tenant: TenantId) -> usize {
        self.0.tenant_size(tenant)
    }
}

/// A replica's approximate index: `local` (its tree, recording or read-only) and what its peers
/// routed. The prompt's blocks are computed once by the host (it also publishes them).
#[derive(Clone, Copy)]
pub struct PeerMerged<'a> {
    pub local: &'a dyn PrefixIndex,
    pub peers: &'a PeerBlocks,
    pub blocks: &'a PromptBlocks,
}

impl PrefixIndex for PeerMerged<'_> {
    fn kind(&self) -> IndexKind {
        self.local.kind()
    }

    fn route(
        &self,
        key: PromptKey<'_>,
        now_ms: u64,
        choose: &mut dyn FnMut(&PrefixMatch) -> Option<TenantId>,
    ) -> Option<TenantId> {
        let peer = self.peers.leading_blocks(&self.blocks.hashes);
        if peer.is_empty() {
            return self.local.route(key, now_ms, choose);
        }
        let block_len = self.blocks.block_len;
        let mut merged = PrefixMatch::default();
        self.local.route(key, now_ms, &mut |local| {
            merge(local, &peer, block_len, &mut merged);
            choose(&merged)
        })
    }

    fn tenant_size(&self, tenant: TenantId) -> usize {
        self.local.tenant_size(tenant)
    }
}

/// `local`'s entries and the peers' leading blocks (sorted by tenant), the longer per tenant.
fn merge(local: &PrefixMatch, peer: &[(TenantId, usize)], block_len: usize, out: &mut PrefixMatch) {
    // A token prompt's tree match covers whole blocks only; the peers' blocks never exceed them.
    let query_len = local.query_len().max(peer.iter().map(|&(_, n)| n * block_len).max().unwrap_or(0));
    out.reset(query_len);
    let mut local = local.iter().peekable();
    let mut peer = peer.iter().map(|&(tenant, n)| (tenant, n * block_len)).peekable();
    loop {
        let next = match (local.peek().copied(), peer.peek().copied()) {
            (None, None) => break,
            (Some(l), None) => {
                local.next();
                l
            }
            (None, Some(p)) => {
                peer.next();
                p
            }
            (Some(l), Some(p)) if l.0 < p.0 => {
                local.next();
                l
            }
            (Some(l), Some(p)) if p.0 < l.0 => {
                peer.next();
                p
            }
            (Some(l), Some(p)) => {
                local.next();
                peer.next();
                (l.0, l.1.max(p.1))
            }
        };
        out.push(next.0, next.1);
    }
}
