//! kvgate-index: placeholder, filled in by its issue.
