//! The segment cache: a text cut at its added tokens (see split.rs), each section's token ids looked up in a bounded concurrent cache keyed by the section's text, and only the missing sections run through the Hugging Face tokenizer.
//!
//! Chats re-send their whole history every turn and templates put special tokens around every
//! message, so after the first turn almost every section of a prompt is a hit.

use std::sync::Arc;

use quick_cache::sync::Cache;
use quick_cache::Weighter;
use tokenizers::{Encoding, Token};

use crate::error::TokenizerError;
use crate::split::{Piece, Splitter};

/// A section's cost in the cache, in token-sized (4-byte) units: its ids, its text (the key) and
/// about 64 bytes of bookkeeping. Never 0 (quick_cache never evicts weightless entries).
#[derive(Clone, Copy, Debug, Default)]
struct SectionWeight;

impl Weighter<Box<str>, Arc<[u32]>> for SectionWeight {
    fn weight(&self, text: &Box<str>, ids: &Arc<[u32]>) -> u64 {
        (ids.len() + text.len().div_ceil(4) + 16) as u64
    }
}

pub(crate) struct SegmentCache {
    splitter: Splitter,
    sections: Cache<Box<str>, Arc<[u32]>, SectionWeight>,
}

impl SegmentCache {
    /// A cache of at most `capacity` token-sized units (> 0).
    pub(crate) fn new(splitter: Splitter, capacity: u64) -> SegmentCache {
        // quick_cache sizes its tables from the expected entry count; a section of a chat is
        // typically a message, a few hundred units.
        let estimated_entries = (capacity / 256).clamp(16, 1 << 20) as usize;
        SegmentCache { splitter, sections: Cache::with_weighter(estimated_entries, capacity, SectionWeight) }
    }

    /// The token ids `tokenizer.encode(text, add_special_tokens)` gives.
    pub(crate) fn encode(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::with_capacity(text.len() / 3);
        for piece in self.splitter.pieces(text) {
            match piece {
                Piece::Token(id) => ids.push(id),
                Piece::Section(section) => match self.sections.get(section) {
                    Some(cached) => ids.extend_from_slice(&cached),
                    None => {
                        let encoded: Arc<[u32]> = encode_plain(tokenizer, section, false)?.into();
                        ids.extend_from_slice(&encoded);
                        self.sections.insert(section.into(), encoded);
                    }
                },
            }
        }
        if !add_special_tokens {
            return Ok(ids);
        }
        // What `encode(text, true)` does after tokenizing: the post-processor on the sequence's
        // ids (their token strings and offsets are not used for the ids).
        let tokens = ids.into_iter().map(|id| Token::new(id, String::new(), (0, 0))).collect();
        let encoding = tokenizer
            .post_process(Encoding::from_tokens(tokens, 0), None, true)
            .map_err(|error| TokenizerError::Encode { message: error.to_string() })?;
        Ok(encoding.get_ids().to_vec())
    }

    pub(crate) fn clear(&self) {
        self.sections.clear();
    }

    /// (entries, weight, capacity).
    pub(crate) fn usage(&self) -> (usize, u64, u64) {
        (self.sections.len(), self.sections.weight(), self.sections.capacity())
    }
}

/// `tokenizer.encode(text, add_special_tokens)`'s ids, without the cache.
pub(crate) fn encode_plain(
    tokenizer: &tokenizers::Tokenizer,
    text: &str,
    add_special_tokens: bool,
) -> Result<Vec<u32>, TokenizerError> {
    let encoding = tokenizer
        .encode_fast(text, add_special_tokens)
        .map_err(|error| TokenizerError::Encode { message: error.to_string() })?;
    Ok(encoding.get_ids().to_vec())
}
