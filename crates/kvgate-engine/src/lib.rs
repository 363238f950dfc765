//! kvgate-engine: placeholder, filled in by its issue.
