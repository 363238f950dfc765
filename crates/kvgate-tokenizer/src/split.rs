//! Where a Hugging Face tokenizer cuts a text before tokenizing it (at the added tokens it finds in the raw text), and whether cutting there ourselves gives exactly its token ids.
//!
//! `tokenizers` encodes a text in three steps (`TokenizerImpl::encode_single_sequence` and
//! `AddedVocabulary::extract_and_normalize` in tokenizers 0.22):
//! 1. the added tokens flagged `normalized: false` are found in the raw text by one aho-corasick
//!    automaton (leftmost-longest); each match becomes its token id and the text between matches
//!    becomes independent *sections*;
//! 2. each section is normalized on its own, and the added tokens flagged `normalized: true` are
//!    found in it (that only ever splits the section further);
//! 3. each remaining piece is pre-tokenized and run through the model on its own;
//!
//! then the post-processor runs once on the concatenated ids. So `encode(text)`'s ids are the
//! matched tokens' ids and, between them, each section's ids as `encode(section)` gives them,
//! provided that:
//! - we find the same matches as step 1: the same patterns (every `normalized: false` added
//!   token) with the same automaton, and none of those tokens changes its match with `lstrip`,
//!   `rstrip` or `single_word` (those look at the text around the match);
//! - a section's encoding does not depend on where it sits in the text. The one component that
//!   looks at that is the `Metaspace` pre-tokenizer with `prepend_scheme: first` (it prepends `▁`
//!   only to a piece starting at offset 0 of the whole text); and BPE dropout is random;
//! - `encode(section)`'s post-processing (`add_special_tokens: false`) keeps the ids, which every
//!   post-processor does, and the one at the end only reads the ids (checked by kind below).
//!
//! Inside `encode(section)` step 1 finds nothing: a match inside the section would have been a
//! match of the whole text, found before the one that ends the section.

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use serde::Deserialize;
use tokenizers::pre_tokenizers::metaspace::PrependScheme;
use tokenizers::{AddedToken, ModelWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper};

/// Cuts texts where `tokenizers` cuts them before normalization: at every added token with
/// `normalized: false`, leftmost-longest.
pub(crate) struct Splitter {
    automaton: AhoCorasick,
    /// The token id of each pattern of `automaton`.
    ids: Vec<u32>,
}

/// A part of a text: an added token, or a non-empty section between added tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Piece<'a> {
    Token(u32),
    Section(&'a str),
}

impl Splitter {
    /// The splitter for `tokenizer`, or why splitting could change its token ids. `listed` is
    /// tokenizer.json's `added_tokens` list, what `tokenizers` built its vocabulary from.
    pub(crate) fn for_tokenizer(
        tokenizer: &tokenizers::Tokenizer,
        listed: &[AddedToken],
    ) -> Result<Splitter, String> {
        if tokenizer.get_encode_special_tokens() {
            return Err("the tokenizer encodes special tokens as text".to_string());
        }
        if tokenizer.get_truncation().is_some() || tokenizer.get_padding().is_some() {
            return Err("the tokenizer truncates or pads".to_string());
        }
        model_reason(tokenizer.get_model())
            .or_else(|| tokenizer.get_normalizer().and_then(normalizer_reason))
            .or_else(|| tokenizer.get_pre_tokenizer().and_then(pre_tokenizer_reason))
            .or_else(|| tokenizer.get_post_processor().and_then(post_processor_reason))
            .map_or(Ok(()), Err)?;

        let (patterns, ids) = split_tokens(tokenizer, listed)?;
        let automaton = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&patterns)
            .map_err(|error| format!("cannot build the added-token matcher: {error}"))?;
        Ok(Splitter { automaton, ids })
    }

    /// The pieces of `text`, in order; sections are never empty.
    pub(crate) fn pieces<'a>(&'a self, text: &'a str) -> impl Iterator<Item = Piece<'a>> + 'a {
        let mut matches = self.automaton.find_iter(text);
        let mut position = 0;
        let mut pending_token = None;
        std::iter::from_fn(move || {
            if let Some(id) = pending_token.take() {
                return Some(Piece::Token(id));
            }
            match matches.next() {
                Some(found) => {
                    let id = self.ids[found.pattern().as_usize()];
                    let section = &text[position..found.start()];
                    position = found.end();
                    if section.is_empty() {
                        Some(Piece::Token(id))
                    } else {
                        pending_token = Some(id);
                        Some(Piece::Section(section))
                    }
                }
                None if position < text.len() => {
                    let section = &text[position..];
                    position = text.len();
                    Some(Piece::Section(section))
                }
                None => None,
            }
        })
    }
}

/// The patterns and ids of the added tokens `tokenizers` matches on the raw text, after checking
/// that its added vocabulary is the one tokenizer.json lists and that plain matching finds them.
fn split_tokens(
    tokenizer: &tokenizers::Tokenizer,
    listed: &[AddedToken],
) -> Result<(Vec<String>, Vec<u32>), String> {
    // `tokenizers` builds its matchers from the list as given but looks each match's flags up by
    // id, last entry wins: with one entry per content both are the same tokens.
    let mut contents = std::collections::HashSet::with_capacity(listed.len());
    if let Some(duplicate) = listed.iter().find(|token| !contents.insert(token.content.as_str())) {
        return Err(format!("tokenizer.json lists the added token {:?} more than once", duplicate.content));
    }
    let decoder = tokenizer.get_added_tokens_decoder();
    let vocabulary = tokenizer.get_added_vocabulary().get_vocab();
    if decoder.len() != listed.len() || vocabulary.len() != listed.len() {
        return Err(format!(
            "the added vocabulary has {} tokens where tokenizer.json lists {}",
            decoder.len(),
            listed.len()
        ));
    }
    let mut patterns = Vec::new();
    let mut ids = Vec::new();
    for token in listed {
        let id = vocabulary.get(&token.content).copied();
        if id.and_then(|id| decoder.get(&id)) != Some(token) {
            return Err(format!("the added token {:?} was not added as listed", token.content));
        }
        if token.normalized {
            continue; // found inside a section, by encode(section) itself
        }
        if token.lstrip || token.rstrip || token.single_word {
            return Err(format!(
                "the added token {:?} has lstrip, rstrip or single_word (its match depends on the text around it)",
                token.content
            ));
        }
        patterns.push(token.content.clone());
        ids.push(id.unwrap_or_default());
    }
    Ok((patterns, ids))
}

fn model_reason(model: &ModelWrapper) -> Option<String> {
    match model {
        // tokenizers applies dropout unless it is None or exactly 0.
        ModelWrapper::BPE(bpe) => match bpe.dropout {
            None | Some(0.0) => None,
            Some(_) => Some("the BPE model has dropout (random merges)".to_string()),
        },
        ModelWrapper::WordPiece(_) | ModelWrapper::WordLevel(_) | ModelWrapper::Unigram(_) => None,
    }
}

/// Normalizers see one section at a time, in the whole text as alone; listed so that a new kind
/// in a `tokenizers` upgrade must be looked at here.
fn normalizer_reason(normalizer: &NormalizerWrapper) -> Option<String> {
    match normalizer {
        NormalizerWrapper::Sequence(sequence) => sequence.as_ref().iter().find_map(normalizer_reason),
        NormalizerWrapper::BertNormalizer(_)
        | NormalizerWrapper::StripNormalizer(_)
        | NormalizerWrapper::StripAccents(_)
        | NormalizerWrapper::NFC(_)
        | NormalizerWrapper::NFD(_)
        | NormalizerWrapper::NFKC(_)
        | NormalizerWrapper::NFKD(_)
        | NormalizerWrapper::Lowercase(_)
        | NormalizerWrapper::Nmt(_)
        | NormalizerWrapper::Precompiled(_)
        | NormalizerWrapper::Replace(_)
        | NormalizerWrapper::Prepend(_)
        | NormalizerWrapper::ByteLevel(_) => None,
    }
}

fn pre_tokenizer_reason(pre_tokenizer: &PreTokenizerWrapper) -> Option<String> {
    match pre_tokenizer {
        PreTokenizerWrapper::Sequence(sequence) => sequence.as_ref().iter().find_map(pre_tokenizer_reason),
        PreTokenizerWrapper::Metaspace(metaspace)
            if metaspace.get_prepend_scheme() == PrependScheme::First =>
        {
            Some(
                "the Metaspace pre-tokenizer prepends only at the start of the text (prepend_scheme: first)"
                    .to_string(),
            )
        }
        PreTokenizerWrapper::Metaspace(_)
        | PreTokenizerWrapper::BertPreTokenizer(_)
        | PreTokenizerWrapper::ByteLevel(_)
        | PreTokenizerWrapper::Delimiter(_)
        | PreTokenizerWrapper::Whitespace(_)
        | PreTokenizerWrapper::Split(_)
        | PreTokenizerWrapper::Punctuation(_)
        | PreTokenizerWrapper::WhitespaceSplit(_)
        | PreTokenizerWrapper::Digits(_)
        | PreTokenizerWrapper::UnicodeScripts(_)
        | PreTokenizerWrapper::FixedLength(_) => None,
    }
}

/// Every post-processor keeps the ids when not adding special tokens, and, when adding them,
/// puts its own ids around the sequence's without reading anything but the ids.
fn post_processor_reason(processor: &PostProcessorWrapper) -> Option<String> {
    match processor {
        PostProcessorWrapper::Sequence(sequence) => sequence.as_ref().iter().find_map(post_processor_reason),
        PostProcessorWrapper::Roberta(_)
        | PostProcessorWrapper::Bert(_)
        | PostProcessorWrapper::ByteLevel(_)
        | PostProcessorWrapper::Template(_) => None,
    }
}

/// The fields of tokenizer.json read here; the rest is skipped.
#[derive(Deserialize)]
struct AddedTokensOnly {
    #[serde(default)]
    added_tokens: Vec<AddedToken>,
}

/// tokenizer.json's `added_tokens`, as `tokenizers` read them.
pub(crate) fn listed_added_tokens(tokenizer_json: &[u8]) -> Result<Vec<AddedToken>, String> {
    serde_json::from_slice::<AddedTokensOnly>(tokenizer_json)
        .map(|file| file.added_tokens)
        .map_err(|error| format!("cannot read the added tokens of tokenizer.json: {error}"))
}

#[cfg(test)]
mod tests;
