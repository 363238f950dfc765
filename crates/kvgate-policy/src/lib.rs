//! kvgate-policy: placeholder, filled in by its issue.
