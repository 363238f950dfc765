//! kvgate-mock: placeholder, filled in by its issue.
