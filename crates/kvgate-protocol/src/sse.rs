//! Server-sent events as the engines frame an answer: one `data: <json>` line and a blank line
//! per event, `data: [DONE]` last. The writer ([`data_event`], [`DONE`]); the gateway's
//! frame-by-frame view ([`split_events`], [`last_boundary`], [`event_data`]); and the one reader
//! of a streamed answer at the client ([`SseData`]: `kvgate replay` and `kvgate soak`), where
//! bytes go in as they arrive, cut anywhere, and the payload of each complete `data:` line comes
//! out, trimmed (lines end with `\n` or `\r\n`; other fields, comments and blank lines are
//! skipped).

use bytes::Bytes;

/// The last event of a stream.
pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// Appends `data: <json>\n\n`.
pub fn data_event(value: &serde_json::Value, out: &mut Vec<u8>) {
    out.extend_from_slice(b"data: ");
    serde_json::to_writer(&mut *out, value).expect("a JSON value always serializes");
    out.extend_from_slice(b"\n\n");
}

/// One event `data: <json>\n\n` as bytes.
pub fn data_event_bytes(value: &serde_json::Value) -> Bytes {
    let mut out = Vec::with_capacity(128);
    data_event(value, &mut out);
    Bytes::from(out)
}

/// The end of the last complete event (just past its blank line), if any.
pub fn last_boundary(buffer: &[u8]) -> Option<usize> {
    buffer.windows(2).rposition(|window| window == b"\n\n").map(|at| at + 2)
}

/// The events of `buffer`, each with its terminating blank line (a trailing partial one too).
pub fn split_events(buffer: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = buffer;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = rest.windows(2).position(|window| window == b"\n\n").map_or(rest.len(), |at| at + 2);
        let (event, tail) = rest.split_at(end);
        rest = tail;
        Some(event)
    })
}

/// The `data:` payload of an event (a single data line, as the engines write them; `[DONE]`
/// included), trimmed; `None` for an event without data.
pub fn event_data(event: &[u8]) -> Option<&[u8]> {
    let text = std::str::from_utf8(event).ok()?;
    let line = text.lines().find_map(|line| line.strip_prefix("data:"))?;
    Some(line.trim().as_bytes())
}

/// An incremental reader of `data:` lines.
#[derive(Debug, Default)]
pub struct SseData {
    buffer: Vec<u8>,
    /// Where the first line not yet read starts in `buffer`.
    start: usize,
}

impl SseData {
    /// Appends bytes of the stream.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.start == self.buffer.len() {
            self.buffer.clear();
            self.start = 0;
        }
        self.buffer.extend_from_slice(bytes);
    }

    /// The payload of the next complete `data:` line (`[DONE]` included), or `None` until more
    /// bytes complete one.
    pub fn next_data(&mut self) -> Option<String> {
        while let Some(offset) = self.buffer[self.start..].iter().position(|&b| b == b'\n') {
            let line = &self.buffer[self.start..self.start + offset];
            self.start += offset + 1;
            let line = String::from_utf8_lossy(line);
            if let Some(payload) = line.trim().strip_prefix("data:") {
                return Some(payload.trim().to_string());
            }
        }
        // Only an incomplete line is left: keep it alone.
        self.buffer.drain(..self.start);
        self.start = 0;
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_events_read_back_whole() {
        let mut stream = Vec::new();
        data_event(&serde_json::json!({"i": 0}), &mut stream);
        stream.extend_from_slice(&data_event_bytes(&serde_json::json!({"i": 1})));
        stream.extend_from_slice(DONE);
        let events: Vec<&[u8]> = split_events(&stream).collect();
        assert_eq!(events.len(), 3);
        assert_eq!(event_data(events[0]), Some(&br#"{"i":0}"#[..]));
        assert_eq!(event_data(events[2]), Some(&b"[DONE]"[..]));
        assert_eq!(event_data(b": a comment\n\n"), None);
        assert_eq!(last_boundary(&stream), Some(stream.len()));
        assert_eq!(last_boundary(&stream[..stream.len() - 1]), Some(stream.len() - DONE.len()));
    }

    fn read_in_pieces(stream: &str, piece: usize) -> Vec<String> {
        let mut reader = SseData::default();
        let mut payloads = Vec::new();
        for bytes in stream.as_bytes().chunks(piece) {
            reader.push(bytes);
            while let Some(payload) = reader.next_data() {
                payloads.push(payload);
            }
        }
        payloads
    }

    #[test]
    fn data_lines_come_out_whole_however_the_stream_is_cut() {
        let stream =
            "data: {\"i\":0}\n\n: a comment\nevent: message\r\ndata:{\"i\":1}\r\n\r\n  data: [DONE]  \n";
        for piece in 1..=stream.len() {
            assert_eq!(read_in_pieces(stream, piece), [r#"{"i":0}"#, r#"{"i":1}"#, "[DONE]"], "{piece}");
        }
    }

    #[test]
    fn an_unfinished_line_waits_for_its_end() {
        let mut reader = SseData::default();
        reader.push(b"data: par");
        assert_eq!(reader.next_data(), None);
        reader.push(b"tial\ndata: next");
        assert_eq!(reader.next_data().as_deref(), Some("partial"));
        assert_eq!(reader.next_data(), None);
        reader.push(b"\n");
        assert_eq!(reader.next_data().as_deref(), Some("next"));
        assert_eq!(reader.next_data(), None);
        assert_eq!(reader.buffer.len(), 0, "read lines are not kept");
    }
}
