//! The one reader of a streamed answer's server-sent events at the client (`kvgate replay` and
//! `kvgate soak`): bytes go in as they arrive, cut anywhere; the payload of each complete
//! `data:` line comes out, trimmed. Lines end with `\n` or `\r\n`; other fields (`event:`, `id:`,
//! comments) and blank lines are skipped.

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
    use super::SseData;

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
