//! `--kv-events-out`: the simulated engines' KV event stream written as JSON lines, so the index
//! bench (`benches/dynamo-index`) can replay a scenario's real stores and removals.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use kvgate_engine::{KvEvent, KvEventBatch, LoraAdapter, Tier};
use serde::Serialize;

use crate::SimError;

/// The open file; the first write error is kept and reported when the run ends.
pub(crate) struct KvEventsOut {
    path: PathBuf,
    writer: BufWriter<File>,
    error: Option<std::io::Error>,
    line: Vec<u8>,
}

/// One line: an engine's batch.
#[derive(Serialize)]
struct Line<'a> {
    run: &'a str,
    engine: usize,
    seq: u64,
    timestamp_us: u64,
    events: Vec<Event<'a>>,
}

/// A [`KvEvent`] with each stored block's token ids as one digest.
#[derive(Serialize)]
enum Event<'a> {
    BlockStored {
        block_hashes: &'a [u64],
        parent_block_hash: Option<u64>,
        /// Per block, `kvgate_index::content_hash(0, its token ids)`.
        block_digests: Vec<u64>,
        block_size: u32,
        tier: Tier,
        lora: &'a Option<LoraAdapter>,
    },
    BlockRemoved {
        block_hashes: &'a [u64],
        tier: Tier,
    },
    AllBlocksCleared,
}

impl<'a> Event<'a> {
    fn of(event: &'a KvEvent) -> Self {
        match event {
            KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, tier, lora } => {
                let block_digests = match *block_size {
                    0 => Vec::new(),
                    size => token_ids
                        .chunks(size as usize)
                        .map(|block| kvgate_index::content_hash(0, block))
                        .collect(),
                };
                Event::BlockStored {
                    block_hashes,
                    parent_block_hash: *parent_block_hash,
                    block_digests,
                    block_size: *block_size,
                    tier: *tier,
                    lora,
                }
            }
            KvEvent::BlockRemoved { block_hashes, tier } => Event::BlockRemoved { block_hashes, tier: *tier },
            KvEvent::AllBlocksCleared => Event::AllBlocksCleared,
        }
    }
}

impl KvEventsOut {
    pub(crate) fn create(path: &Path) -> Result<Self, SimError> {
        let file = File::create(path).map_err(|e| output_error(path, &e))?;
        Ok(Self { path: path.to_path_buf(), writer: BufWriter::new(file), error: None, line: Vec::new() })
    }

    /// Writes one engine batch of run `run`.
    pub(crate) fn write(&mut self, run: &str, engine: usize, batch: &KvEventBatch) {
        if self.error.is_some() {
            return;
        }
        let line = Line {
            run,
            engine,
            seq: batch.seq,
            timestamp_us: batch.timestamp_us,
            events: batch.events.iter().map(Event::of).collect(),
        };
        self.line.clear();
        serde_json::to_writer(&mut self.line, &line).expect("a line serializes");
        self.line.push(b'\n');
        if let Err(error) = self.writer.write_all(&self.line) {
            self.error = Some(error);
        }
    }

    /// Flushes a finished run's lines; reports the first write error.
    pub(crate) fn finish_run(&mut self) -> Result<(), SimError> {
        if let Some(error) = self.error.take().or_else(|| self.writer.flush().err()) {
            return Err(output_error(&self.path, &error));
        }
        Ok(())
    }
}

fn output_error(path: &Path, error: &std::io::Error) -> SimError {
    SimError::Output { path: path.display().to_string(), message: error.to_string() }
}
