//! An error and its sources on one line, `: `-separated: the messages of hyper's and reqwest's
//! errors name the step that failed and leave the cause to their sources.

use std::fmt::Write as _;

/// `error`'s message followed by each of its sources' (`a: b: c`).
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let _ = write!(text, ": {cause}");
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[derive(Debug, thiserror::Error)]
    #[error("sending the request")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn every_source_follows_the_message() {
        let error = Outer(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused"));
        assert_eq!(error_chain(&error), "sending the request: connection refused");
        assert_eq!(error_chain(&std::fmt::Error), "an error occurred when formatting an argument");
    }
}
